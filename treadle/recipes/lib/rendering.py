"""Chat rendering through the tokenizer's own chat template, with an assistant-only loss mask.

We never hand-write a model's prompt format: the chat template shipped with the tokenizer is the
format the model was tuned on. To know which tokens belong to assistant turns (the only ones we
train on) without relying on `{% generation %}` markers, which few templates have, we render the
conversation one message at a time and tokenize each new piece of text separately. That needs the
template to be *incremental*: rendering `messages[:i+1]` must extend the text of `messages[:i]` (and,
before an assistant turn, the text with the generation prompt). ChatML, Llama 3 and most templates
are; one that is not raises an error naming the message.

Tokenizing pieces separately is also exactly what RL does (prompt tokens + sampled tokens), so SFT
and RL see the same token boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

Message = dict[str, str]


@dataclass
class RenderedConversation:
    """Token ids of a whole conversation and, per token, 1.0 if it belongs to an assistant turn."""

    tokens: list[int]
    mask: list[float]


def _text(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    if not messages and not add_generation_prompt:
        return ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _extension(before: str, after: str, what: str) -> str:
    if not after.startswith(before):
        raise ValueError(
            f"chat template is not incremental at {what}: rendering one more message rewrote earlier text "
            f"(expected a continuation of {before[-60:]!r}, got {after[: len(before)][-60:]!r})"
        )
    return after[len(before) :]


def render_generation_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Tokens of the conversation so far plus the assistant header the model continues from."""
    return _encode(tokenizer, _text(tokenizer, messages, add_generation_prompt=True))


def render_conversation(
    tokenizer: Any, messages: Sequence[Message], train_on: str = "all_assistant"
) -> RenderedConversation:
    """Tokens of a full conversation with a loss mask on assistant content and its end-of-turn token.

    `train_on="last_assistant"` masks every assistant turn but the last one.
    """
    if train_on not in ("all_assistant", "last_assistant"):
        raise ValueError(f"train_on must be 'all_assistant' or 'last_assistant', got {train_on!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("conversation has no assistant message, so nothing to train on")
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    tokens: list[int] = []
    mask: list[float] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            header = _extension(
                done, _text(tokenizer, messages[:i], add_generation_prompt=True), f"message {i} (header)"
            )
            ids = _encode(tokenizer, header)
            tokens += ids
            mask += [0.0] * len(ids)
            done += header
        full = _text(tokenizer, messages[: i + 1], add_generation_prompt=False)
        piece = _extension(done, full, f"message {i}")
        # Whitespace after the end-of-turn token separates turns; the model never generates it.
        body, separator = piece.rstrip(), piece[len(piece.rstrip()) :]
        trained = message["role"] == "assistant" and (train_on == "all_assistant" or i == last_assistant)
        for text, weight in ((body, 1.0 if trained else 0.0), (separator, 0.0)):
            ids = _encode(tokenizer, text)
            tokens += ids
            mask += [weight] * len(ids)
        done = full
    return RenderedConversation(tokens=tokens, mask=mask)


def tool_message(tokenizer: Any, name: str, content: str) -> Message:
    """A tool result as the chat template renders it: role `tool` if the template shows that role's
    content, else (a template without tool support) a user message that says which tool answered."""
    probe = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "name": name, "content": "\x1fprobe"},
    ]
    try:
        supported = "\x1fprobe" in _text(tokenizer, probe, add_generation_prompt=True)
    except Exception:  # jinja raises its own TemplateError (e.g. "roles must alternate") for unknown roles
        supported = False
    if supported:
        return {"role": "tool", "name": name, "content": content}
    return {"role": "user", "content": f"[{name} result]\n{content}"}


def render_continuation(
    tokenizer: Any,
    messages: Sequence[Message],
    reply: str,
    reply_tokens_end_turn: bool,
    new_messages: Sequence[Message],
) -> list[int]:
    """Tokens that follow a sampled assistant `reply` to make the next generation prompt.

    They are the rest of the reply's turn (its end-of-turn marker, unless the sampled tokens already
    end with it), then `new_messages` (a tool result, say), then the assistant header, all rendered
    by the chat template. The sampled tokens themselves are kept as sampled, so the next prompt is
    exactly what the model saw and wrote, and training on it trains on the tokens of inference.
    """
    before = _text(tokenizer, messages, add_generation_prompt=True) + reply
    after = _text(
        tokenizer, [*messages, {"role": "assistant", "content": reply}, *new_messages], add_generation_prompt=True
    )
    rest = _extension(before, after, "the message after the sampled reply")
    if reply_tokens_end_turn:
        end = tokenizer.eos_token
        if not rest.startswith(end):
            raise ValueError(
                f"the template does not close an assistant turn with the end token {end!r}: it continues with {rest[:40]!r}"
            )
        rest = rest[len(end) :]
    return _encode(tokenizer, rest)
