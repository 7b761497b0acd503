"""Sampled tokens as OpenAI's answers show them: a sequence's text, its finish reason, and its logprobs in the chat
and the completions forms, whole (a response) or a stretch at a time (a streamed chunk)."""

from __future__ import annotations


def answer_tokens(tokenizer, seq: dict) -> list[int]:
    """The tokens of a finished sequence that are its answer: the end-of-turn token that ended it is not."""
    tokens = list(seq["tokens"])
    if finish_reason(seq) == "stop" and tokens and tokens[-1] in tokenizer.all_special_ids:
        return tokens[:-1]
    return tokens


def finish_reason(seq: dict) -> str:
    return "length" if seq["stop_reason"] == "length" else "stop"


def text_of(tokenizer, tokens: list[int], stops: list[str]) -> tuple[str, bool]:
    """The text of `tokens`, cut before the first stop string; and whether one was found."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def chat_logprobs(tokenizer, tokens: list[int], logprobs: list[float], top: list | None) -> list[dict]:
    """`logprobs.content` of a chat choice: one entry per token, with its `top_logprobs` (empty when not asked)."""
    return [
        {**_token(tokenizer, t, lp), "top_logprobs": [_token(tokenizer, a, alp) for a, alp in (top[i] if top else [])]}
        for i, (t, lp) in enumerate(zip(tokens, logprobs))
    ]


def completion_logprobs(tokenizer, tokens: list[int], logprobs: list[float], top: list | None) -> dict:
    """`logprobs` of a completions choice; `top_logprobs` maps each alternative's text to its logprob (None when
    not asked). `text_offset` is left empty."""
    return {
        "tokens": [tokenizer.decode([t]) for t in tokens],
        "token_logprobs": list(logprobs[: len(tokens)]),
        "top_logprobs": [{tokenizer.decode([a]): alp for a, alp in row} for row in top[: len(tokens)]] if top else None,
        "text_offset": [],
    }


def choice(index: int, tokenizer, seq: dict, stops: list[str], chat: bool, with_logprobs: bool) -> dict:
    """One choice of a (not streamed) response."""
    tokens = answer_tokens(tokenizer, seq)
    text, _ = text_of(tokenizer, tokens, stops)
    logprobs, top = seq.get("logprobs") or [], seq.get("topk_logprobs")
    rendered: dict | None = None
    if with_logprobs and chat:
        rendered = {"content": chat_logprobs(tokenizer, tokens, logprobs, top)}
    elif with_logprobs:
        rendered = completion_logprobs(tokenizer, tokens, logprobs, top)
    answer = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"index": index, "finish_reason": finish_reason(seq), **answer, "logprobs": rendered}


def usage(prompt_tokens: int, sequences: list[dict]) -> dict:
    completion = sum(len(seq["tokens"]) for seq in sequences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _token(tokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
