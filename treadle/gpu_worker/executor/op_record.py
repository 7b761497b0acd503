"""The one write that ends an op: its meter record, its result and its applied seq, in one round trip.

In this order (a seq is never marked applied without its result; treadle.gpu_worker.executor.usage for the
meter), and in one MULTI/EXEC when results live in the broker's Redis (the default). Safe to repeat: the meter
counts an op once, the rest are plain sets, so a write retried through a Redis restart changes nothing twice.

The same round trip reads the next seq's journal entry and the lease, which the drain needs next: a
pipelining client has usually journaled that op already. With `handoff` it also sets the idle key
(treadle.gpu_worker.scheduling.linger): the next op, submitted once this result is read, is handed over. With a
`glance` it also writes each waiting session's place in line and reads what the turns need next
(treadle.gpu_worker.scheduling.turns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from celery import Celery

from treadle.errors import TreadleError
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.gpu_worker.scheduling.linger import Linger
from treadle.gpu_worker.scheduling.turns import Glance
from treadle.gpu_worker.sessions.hosting import SessionStores
from treadle.metering import OpUsage
from treadle.queue import names
from treadle.queue.journal import Journal, JournalEntry
from treadle.queue.results import ResultStore


@dataclass(frozen=True)
class NextEntry:
    """A session's next journal entry (None: not journaled yet) and its lease, read in one round trip."""

    entry: JournalEntry | None = None
    lease: bytes | None = None

    @classmethod
    def read(cls, journal: Journal, session_id: str, seq: int) -> NextEntry:
        entry, lease = journal.get_with(session_id, seq, names.lease_key(session_id))
        return cls(entry, lease)


@dataclass(frozen=True)
class FinishedOp:
    """An op that has run (or failed): what its record writes."""

    entry: JournalEntry
    seconds: float  # how long it ran
    payload: dict | None = None  # the encoded response; None when it failed
    error: TreadleError | None = None
    usage: OpUsage | None = None  # None when its request could not be decoded
    step: int | None = None  # the session's optimizer step after a stateful op

    @property
    def tokens(self) -> int:
        usage = self.usage
        return 0 if usage is None else usage.prefill_tokens + usage.trained_tokens + usage.sampled_tokens


class OpRecorder:
    """Writes an op's record (see the module docstring)."""

    def __init__(self, app: Celery, stores: SessionStores, usage: UsageRecorder, linger: Linger):
        self.redis, self.registry = stores.redis, stores.registry
        self.results = ResultStore(app)
        # Results in the broker's Redis (the default): an op's usage, result and applied seq are one write.
        self.one_write = self.results.in_redis(app.conf.broker_url)
        self.usage = usage
        self.linger = linger

    def write(
        self, op: FinishedOp, *, op_cost_s: float | None = None, handoff: bool = False, glance: Glance | None = None
    ) -> NextEntry:
        """Record `op` (with the session's average turn cost, `op_cost_s`, for the visible queue); the session's
        next entry and lease, read in the same round trip."""
        entry = op.entry
        session_id, following = entry.session_id, entry.seq + 1
        with self.redis.pipeline(transaction=True) as pipe:
            if op.usage is not None:
                self.usage.record(op.usage, client=pipe)
            if self.one_write:
                self.results.queue_store(pipe, entry.future_id, op.payload, op.error)
            else:
                pipe.execute()
                self.results.store(entry.future_id, op.payload, op.error)
            self.registry.update(
                session_id,
                client=pipe,
                applied=entry.seq,
                last_activity=time.time(),
                **({} if op.step is None else {"step": op.step}),
                **({} if op_cost_s is None else {"op_cost_s": round(op_cost_s, 6)}),
            )
            if handoff:
                self.linger.mark(pipe)
            if glance is not None:
                glance.queue(pipe, self.registry)
            Journal.read_with(pipe, session_id, following, names.lease_key(session_id))
            *answers, raw, lease = pipe.execute()
        if glance is not None:
            glance.read(answers)
        return NextEntry(Journal.parse(session_id, following, raw), lease)
