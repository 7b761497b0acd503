"""The worker's side of streamed samples (treadle.queue.sample_stream): their rows' tokens out to Redis, their
clients' cancels in.

The decode thread must not wait on Redis (it holds the device for every row of the batch), so a streamed request's
`TokenStream` only hands each token to `SampleStreams`, whose own thread writes what has gathered, for every stream
at once, in one pipelined round trip, and reads the cancel records of the open streams in the same trip. While it
writes, the decode thread goes on: tokens drawn meanwhile go out together in the next trip, so the number of writes
follows Redis's pace, not the decode steps'. With nothing to write, it still reads the cancel records every
`POLL_S` while any stream is open, so a request that waits for the batch, or a row between slow steps, is cancelled
too; with none open, it sleeps until one opens.
"""

from __future__ import annotations

import logging
import threading

from redis import Redis

from treadle.queue import sample_stream
from treadle.queue.sample_stream import StreamCancelled, StreamedTokens

log = logging.getLogger("treadle.sample_stream")

# How often the open streams' cancel records are read when there is nothing to write.
POLL_S = 0.2


class _Stream:
    """One streamed request's `TokenStream` (treadle.gpu_worker.sampling.backend)."""

    def __init__(self, streams: SampleStreams, stream_id: str, topk: bool):
        self._streams = streams
        self.stream_id = stream_id
        self.pending = StreamedTokens(rows=[], tokens=[], logprobs=[], top=[] if topk else None)
        self.end: StreamCancelled | None = None
        self.closed = False
        self.cancelled = False  # set by the publisher's thread when it reads the cancel record

    def drew(self, row: int, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        with self._streams.cond:
            self.pending.rows.append(row)
            self.pending.tokens.append(token)
            self.pending.logprobs.append(logprob)
            if self.pending.top is not None and top is not None:
                self.pending.top.append(top)
            self._streams.cond.notify()

    def dropped(self, tokens: list[int], rows_left: int) -> None:
        with self._streams.cond:
            self.end = StreamCancelled(tokens=tokens, rows_left=rows_left)
            self._streams.cond.notify()

    def close(self) -> None:
        """The request is answered: what is pending goes out, and its cancel record is no longer read."""
        with self._streams.cond:
            self.closed = True
            self._streams.cond.notify()

    def take(self) -> list[StreamedTokens | StreamCancelled]:
        """What is to be written now (under the publisher's lock)."""
        entries: list[StreamedTokens | StreamCancelled] = []
        if self.pending.tokens:
            entries.append(self.pending)
            top = [] if self.pending.top is not None else None
            self.pending = StreamedTokens(rows=[], tokens=[], logprobs=[], top=top)
        if self.end is not None:
            entries.append(self.end)
            self.end = None
        return entries


class SampleStreams:
    """The open streams of one worker and the thread that publishes them."""

    def __init__(self, redis: Redis):
        self._redis = redis
        self.cond = threading.Condition()
        self._open: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="treadle-sample-streams", daemon=True)
        self._thread.start()

    def open(self, stream_id: str, topk: bool) -> _Stream:
        """The stream of a request that names `stream_id`; `topk`: whether its tokens carry their top-k."""
        stream = _Stream(self, stream_id, topk)
        with self.cond:
            self._open[stream_id] = stream
            self.cond.notify()  # the publisher sleeps while no stream is open
        return stream

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self._open))
                self.cond.wait_for(self._ready, timeout=POLL_S)
                streams = list(self._open.values())
                writes = [(s.stream_id, s.take()) for s in streams]
                for s in streams:
                    if s.closed:
                        del self._open[s.stream_id]
            try:
                self._publish(writes, [s for s in streams if not (s.closed or s.cancelled)])
            except Exception as exc:  # Redis away: these entries are lost, and the answer still carries every token
                log.warning("publishing %d sample streams failed: %s", len(writes), exc)

    def _ready(self) -> bool:
        return any(s.pending.tokens or s.end is not None or s.closed for s in self._open.values())

    def _publish(self, writes: list[tuple[str, list[StreamedTokens | StreamCancelled]]], reading: list[_Stream]):
        with self._redis.pipeline(transaction=False) as pipe:
            for stream_id, entries in writes:
                for entry in entries:
                    sample_stream.append(pipe, stream_id, entry)
            for stream in reading:
                sample_stream.check_cancelled(pipe, stream.stream_id)
            if not len(pipe):
                return
            replies = pipe.execute()
        for stream, cancelled in zip(reading, replies[len(replies) - len(reading) :]):
            stream.cancelled = bool(cancelled)
