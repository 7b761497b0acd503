"""`stream=true` on the OpenAI endpoint: server-sent events in OpenAI's chunk format, as the sampler draws tokens.

The sample request names a stream id, so its worker publishes each row's tokens as they are drawn
(treadle.queue.sample_stream). This module reads them and sends each choice's new text as a chunk
(`chat.completion.chunk` with a `delta`, or `text_completion` with `text`), then, once the sample's answer is
stored, the rest of each choice from the answer, a chunk with each `finish_reason`, a last chunk with `usage` when
`stream_options.include_usage` asks for it, and `data: [DONE]`.

What a chunk may send of a choice's text is what no later token can change: the last token drawn is held back
(it may be the end-of-turn token, which is not text), as are a trailing half of a multi-byte character, trailing
white space (a tokenizer's clean-up may still join it to what follows: " ." becomes ".") and the tail that could
still begin a stop string. So the chunks of a choice add up to the text the same request gets unstreamed.

A client that goes away (its connection closed before `[DONE]`) cancels the sample: the worker drops its rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import AsyncGenerator, cast

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Send

from treadle.errors import FutureTimeoutError, TreadleError
from treadle.gateway import openai_render as render
from treadle.gateway.backend import Backend
from treadle.queue.sample_stream import StreamCancelled, StreamedTokens

# How long one read of the token stream waits for an entry before the answer is looked at again.
READ_BLOCK_MS = 200
# How often a stream whose sample has not been answered checks that it still can be (a worker serves its model).
LIVENESS_CHECK_S = 2.0


@dataclass
class _Row:
    """One choice as streamed so far: the tokens received, and what of them has been sent."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""  # the text sent
    sent: int = 0  # tokens whose logprobs were sent


@dataclass
class StreamedCompletion:
    """What a streamed response is rendered from: the request's choices, and how each chunk is shaped."""

    id: str  # the response's id, also the sample's stream id
    tokenizer: object
    model: str
    chat: bool
    n: int
    stops: list[str]
    with_logprobs: bool
    with_top: bool
    include_usage: bool
    prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    rows: list[_Row] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = [_Row() for _ in range(self.n)]

    def start(self) -> list[str]:
        """A chat stream opens with each choice's role."""
        if not self.chat:
            return []
        return [self._chunk([self._choice(i, {"role": "assistant", "content": ""}) for i in range(self.n)])]

    def entries(self, entries: list[StreamedTokens | StreamCancelled]) -> list[str]:
        """The chunks for tokens drawn: one with each choice that has something new to send."""
        changed: set[int] = set()
        for entry in entries:
            if isinstance(entry, StreamedTokens):
                for k, (row, token, lp) in enumerate(zip(entry.rows, entry.tokens, entry.logprobs)):
                    self.rows[row].tokens.append(token)
                    self.rows[row].logprobs.append(lp)
                    if entry.top is not None:
                        self.rows[row].top.append(entry.top[k])
                    changed.add(row)
        choices = [c for i in sorted(changed) if (c := self._advance(i, self.rows[i].tokens[:-1], False))]
        return [self._chunk(choices)] if choices else []

    def finish(self, answer: dict) -> list[str]:
        """The rest of every choice from the sample's answer, their finish reasons, and the usage."""
        sequences = answer["sequences"]
        for row, seq in zip(self.rows, sequences):  # the answer is the authority on every token
            row.tokens, row.logprobs = list(seq["tokens"]), seq.get("logprobs") or []
            row.top = seq.get("topk_logprobs") or []
        choices = [
            c
            for i, seq in enumerate(sequences)
            if (c := self._advance(i, render.answer_tokens(self.tokenizer, seq), True))
        ]
        chunks = [self._chunk(choices)] if choices else []
        ends = [
            {**self._choice(i, {} if self.chat else ""), "finish_reason": render.finish_reason(seq)}
            for i, seq in enumerate(sequences)
        ]
        chunks.append(self._chunk(ends))
        if self.include_usage:
            chunks.append(self._chunk([], render.usage(self.prompt_tokens, sequences)))
        return chunks

    def _advance(self, i: int, tokens: list[int], final: bool) -> dict | None:
        """Choice `i`'s part of a chunk for `tokens` (what of the row is settled), or None when nothing is new."""
        row = self.rows[i]
        text, stopped = render.text_of(self.tokenizer, tokens, self.stops)
        if not (final or stopped):
            text = text[: len(text) - max((len(s) - 1 for s in self.stops), default=0)].rstrip("\ufffd").rstrip()
        delta = text[len(row.text) :] if text.startswith(row.text) else ""
        fresh = tokens[row.sent :]
        if not delta and not (fresh and self.with_logprobs):
            return None
        row.text, row.sent = row.text + delta, len(tokens)
        logprobs = None
        if self.with_logprobs:
            span = slice(len(tokens) - len(fresh), len(tokens))
            top = row.top[span] if self.with_top else None
            if self.chat:
                logprobs = {"content": render.chat_logprobs(self.tokenizer, fresh, row.logprobs[span], top)}
            else:
                logprobs = render.completion_logprobs(self.tokenizer, fresh, row.logprobs[span], top)
        return {**self._choice(i, {"content": delta} if self.chat else delta), "logprobs": logprobs}

    def _choice(self, i: int, delta: dict | str) -> dict:
        part = {"delta": delta} if self.chat else {"text": delta}
        return {"index": i, **part, "logprobs": None, "finish_reason": None}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed the moment the response ends, however it ends: a client that
    goes away cancels its sample then, not whenever the generator is collected."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await cast(AsyncGenerator, self.body_iterator).aclose()


async def events(backend: Backend, future_id: str, out: StreamedCompletion) -> AsyncIterator[str]:
    """The response's events: chunks as tokens come, then the answer's; an error as an `error` event."""
    answered, stream_id = False, out.id
    try:
        for chunk in out.start():
            yield chunk
        after, deadline = "0", time.monotonic() + backend.settings.sample_timeout_seconds
        next_check = time.monotonic() + LIVENESS_CHECK_S
        while not answered:
            after, entries = await run_in_threadpool(backend.read_sample_stream, stream_id, after, READ_BLOCK_MS)
            for chunk in out.entries(entries):
                yield chunk
            try:
                answered, answer = await run_in_threadpool(backend.poll_sample, future_id)
            except TreadleError:
                answered = True  # failed: there is nothing left to cancel
                raise
            if answered:
                for chunk in out.finish(cast(dict, answer)):
                    yield chunk
            elif time.monotonic() >= deadline:
                raise FutureTimeoutError(f"sample: no answer within {backend.settings.sample_timeout_seconds} s")
            elif time.monotonic() >= next_check:
                next_check = time.monotonic() + LIVENESS_CHECK_S
                await run_in_threadpool(backend.check_future, future_id)
        yield "data: [DONE]\n\n"
        await run_in_threadpool(backend.forget_sample_stream, stream_id)
    except TreadleError as exc:
        yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.category, 'code': None}})}\n\n"
    finally:
        if not answered:  # the client went away, or the wait gave up: the worker drops the rows
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(backend.cancel_sample, stream_id)
