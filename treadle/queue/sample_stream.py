"""A streamed sample's partial answer in Redis: the tokens its rows draw, as they draw them, and its client's cancel.

A sample request that names a `stream_id` (`SampleRequest.stream_id`; the gateway's OpenAI endpoint sets one for
`stream=true`) still gets its whole answer as its future's result. Besides, its worker appends what its rows drew
since the last entry to a Redis stream (`names.sample_stream_key`) from a thread of its own
(treadle.gpu_worker.executor.sample_stream), so a reader follows the rows token by token. The answer stays the
one authority: a reader that sees the result stored takes the rest from it, so an entry that comes late loses
nothing.

The reader cancels by setting `names.sample_cancel_key`; the worker checks it with each write (and a few times a
second while a request waits for the batch), drops the request's rows at the next step boundary, answers its future
with `SampleCancelledError`, and appends a `StreamCancelled` entry, the record that its rows left the batch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter

from treadle.queue import names

# A stream outlives its last write by this long; a reader that has not read it by then has gone.
STREAM_TTL_S = 600
# A cancel record lives as long as a request may wait for its batch and run.
CANCEL_TTL_S = 24 * 3600


class StreamedTokens(BaseModel):
    """Tokens drawn since the previous entry, one per position of the lists, in the order drawn."""

    kind: Literal["tokens"] = "tokens"
    rows: list[int] = Field(description="Which of the request's samples drew each token.")
    tokens: list[int] = Field(description="The tokens drawn.")
    logprobs: list[float] = Field(description="Each token's logprob under the distribution it was drawn from.")
    top: list[list[tuple[int, float]]] | None = Field(
        default=None, description="Per token, the top-k (token, logprob) asked for by `topk_sample_logprobs`."
    )


class StreamCancelled(BaseModel):
    """The worker dropped the request's rows because its client cancelled."""

    kind: Literal["cancelled"] = "cancelled"
    tokens: list[int] = Field(description="Per sample, the tokens it had drawn when it was dropped.")
    rows_left: int = Field(description="Rows still in the worker's decode batch once these were dropped.")


StreamEntry = Annotated[StreamedTokens | StreamCancelled, Field(discriminator="kind")]
_ENTRY: TypeAdapter[StreamedTokens | StreamCancelled] = TypeAdapter(StreamEntry)


def append(pipe, stream_id: str, entry: StreamedTokens | StreamCancelled) -> None:
    """Queue the entry's write on a pipeline (the worker's publisher sends several streams' entries at once)."""
    key = names.sample_stream_key(stream_id)
    pipe.xadd(key, {"e": entry.model_dump_json()})
    pipe.expire(key, STREAM_TTL_S)


def read(redis, stream_id: str, after: str, block_ms: int) -> tuple[str, list[StreamedTokens | StreamCancelled]]:
    """The entries after id `after` ("0": from the start), waiting up to `block_ms` for one; and the last id read."""
    answer = redis.xread({names.sample_stream_key(stream_id): after}, block=block_ms)
    entries = []
    for _, items in answer or []:
        for entry_id, fields in items:
            after = entry_id.decode()  # (treadle's Redis clients answer bytes)
            entries.append(_ENTRY.validate_json(fields[b"e"]))
    return after, entries


def started(redis, stream_id: str) -> bool:
    """Whether the stream has had an entry written (a re-run of its request would write its tokens again)."""
    return bool(redis.exists(names.sample_stream_key(stream_id)))


def forget(redis, stream_id: str) -> None:
    """Delete the stream (its reader is done with it)."""
    redis.delete(names.sample_stream_key(stream_id))


def cancel(redis, stream_id: str) -> None:
    """Ask the worker to drop the request's rows (a no-op once it is answered)."""
    redis.set(names.sample_cancel_key(stream_id), 1, ex=CANCEL_TTL_S)


def check_cancelled(pipe, stream_id: str) -> None:
    """Queue the read of the request's cancel record on a pipeline; its reply is 1 when cancelled."""
    pipe.exists(names.sample_cancel_key(stream_id))
