"""The ordered sequencer: runs each session's ops strictly in seq order, from the journal.

Celery delivers at least once and, after a crash, out of order. So the sequencer never trusts
delivery order: a doorbell (`session_id`, `seq`) only says "the journal has ops up to seq"; the
sequencer then runs `applied+1, applied+2, ...` for as long as the journal has them. An op that
arrives early waits in the journal for its predecessor; a redelivered doorbell finds its seq applied
and its result already stored. Before each op it checks that this worker still holds the session's
lease (fencing), and results are stored under the op's future id, whichever doorbell ran it.

The sequencer also reads ahead: the write that marks an op applied also reads the next seq's entry,
and the drain runs it. An op journaled before its predecessor was marked applied rings no doorbell
at all (treadle.queue.journal): this read is what runs it, so a pipelining client (`forward_backward`
then `optim_step`) costs one Celery message per burst. After `READ_AHEAD_OPS` ops past the doorbells
it has seen, a drain rings the next op's doorbell itself and returns, so that other sessions' doorbells
get their turn. Should a doorbell ever be missing (a drain that died with an op next in line), the
caretaker's `nudge_stalled` rings it.

When the drain has nothing left, the same Celery task waits a few milliseconds for the next op of any
session this worker owns (treadle.gpu_worker.executor.linger): a loop that submits its next step right after
reading a result then costs no Celery message at all.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import redis as redis_lib
from celery import Celery
from kombu import exceptions as kombu_errors

from treadle.errors import ServerError, TreadleError
from treadle.gpu_worker.sessions.hosting import OwnedSession, SessionHost
from treadle.gpu_worker.executor.linger import Linger
from treadle.gpu_worker.sessions.op_handlers import handler_for
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.metering import OpUsage
from treadle.queue import names
from treadle.queue.journal import Journal, JournalEntry
from treadle.queue.ops import OpRequest, encode_result
from treadle.queue.connections import ring
from treadle.queue.results import ResultStore
from treadle.queue.sessions import inactive_error

log = logging.getLogger("treadle.worker")


class Sequencer:
    def __init__(self, host: SessionHost, app: Celery, *, after_op: Callable[[OwnedSession, str], bool],
                 reload: Callable[[OwnedSession], None], usage: UsageRecorder, linger: Linger):
        self.host = host
        self.linger = linger
        self._rotation = 0
        self.app = app
        self.results = ResultStore(app)
        # Results in the broker's Redis (the default): an op's usage, result and applied seq are one write.
        self._one_write = self.results.in_redis(app.conf.broker_url)
        self.usage = usage
        self._after_op = after_op  # automatic checkpoints; True when it saved one (which takes a while)
        self._reload = reload  # an idle-unloaded session comes back before its next op

    def on_doorbell(self, session_id: str, seq: int) -> None:
        """A Celery task: run the session's ops up to `seq` (and what follows), then take the ops handed to
        this worker directly for as long as they come (treadle.gpu_worker.executor.linger)."""
        handed: tuple[str, int] | None = (session_id, seq)
        try:
            while handed is not None:
                self._serve(*handed)
                handed = self.linger.next([names.model_queue(m) for m in self.host.engines], self._next_ops())
        except BaseException:
            with contextlib.suppress(Exception):  # ringing needs Redis too, which may be what failed
                if (left := self.linger.abandon()) is not None:
                    self._ring_on(*left)
            raise

    def _serve(self, session_id: str, seq: int) -> None:
        with self.host.device_lock:
            owned = self.host.owned.get(session_id)
            if owned is None:
                self._not_ours(session_id, seq)
                return
            owned.max_seen = max(owned.max_seen, seq)
            self.drain(session_id, handoff=True)

    def _next_ops(self) -> list[tuple[str, int]]:
        """(session_id, next seq) of every owned session, starting at a turning point: a session that keeps
        submitting does not keep the others waiting."""
        pending = [(sid, owned.applied + 1) for sid, owned in list(self.host.owned.items())]
        self._rotation += 1
        cut = self._rotation % len(pending) if pending else 0
        return pending[cut:] + pending[:cut]

    def drain(self, session_id: str, *, handoff: bool = False) -> None:
        """Run every op of the session that is next in line, in seq order (and a few journaled after it).
        `handoff`: the caller waits for hand-offs afterwards (a Celery task does; a failover does not)."""
        owned = self.host.owned[session_id]
        ahead, next_read = 0, None
        while True:
            entry, lease = next_read or self.host.journal.get_with(session_id, owned.applied + 1, names.lease_key(session_id))
            if entry is None:
                return
            if entry.seq > owned.max_seen:
                if ahead >= READ_AHEAD_OPS:  # its turn comes back through the queue, after other sessions' doorbells
                    ring(self.app, session_id, entry.seq, entry.op)
                    return
                ahead += 1
            owned.max_seen = max(owned.max_seen, entry.seq)
            if not self.host.lease.is_ours(lease, owned.epoch):
                log.warning("lost the lease of session %s; handing it over", session_id)
                self.host.release(session_id, drop_lease=False)
                self._not_ours(session_id, entry.seq)
                return
            if owned.unloaded:
                self._reload(owned)
            next_read = self._run(owned, entry, handoff)
            if entry.op == "stop":
                self.host.finish(session_id)
                return

    def _run(self, owned: OwnedSession, entry: JournalEntry, handoff: bool) -> tuple[JournalEntry | None, bytes | None] | None:
        """Run one op and record it; returns the next seq's journal entry and the lease, read with the record
        (None after an automatic checkpoint: the lease read before it may be stale by now)."""
        started, request, response, payload, error = time.monotonic(), None, None, None, None
        try:
            handler = handler_for(entry.op)
            request: OpRequest = entry.request()
            response = handler(request, self.host.context(owned, entry.seq))
            payload = encode_result(entry.op, response)
        except TreadleError as exc:
            error = exc
        except Exception as exc:
            log.exception("op %s of session %s failed", entry.op, entry.session_id)
            error = ServerError(f"{entry.op} failed on the worker: {type(exc).__name__}: {exc}")
        # The op has changed the engine: it counts as applied now, whatever Redis does next. Were Redis
        # down while the result is stored, a redelivered doorbell must find the seq applied, or the op
        # would run twice (gradients added twice).
        owned.applied = entry.seq
        step = self._step(owned) if entry.stateful else None
        usage = None
        if request is not None:
            usage = self.usage.observe(
                session_id=entry.session_id, op_id=str(entry.seq), request=request, response=response,
                owner=owned.record.owner, base_model=owned.record.base_model, seconds=time.monotonic() - started,
                outcome="ok" if error is None else f"{error.category}_error")
        next_read = _through_outages(lambda: self._record(entry, usage, payload, error, step, handoff))
        return None if self._after_op(owned, entry.op) else next_read

    def _step(self, owned: OwnedSession) -> int | None:
        engine, session_id = self.host.engine(owned.record.base_model), owned.record.session_id
        return engine.step(session_id) if engine.has_session(session_id) else None

    def _record(self, entry: JournalEntry, usage: OpUsage | None, payload: dict | None, error: TreadleError | None,
                step: int | None, handoff: bool = False) -> tuple[JournalEntry | None, bytes | None]:
        """Meter the op, store its result, mark its seq applied: in this order (a seq is never marked applied
        without its result, see treadle.gpu_worker.executor.usage for the meter), and in one MULTI/EXEC when results
        live in the broker's Redis. Safe to repeat: the meter counts an op once, the rest are plain sets.

        The same round trip reads the next seq's journal entry and the lease, which the drain needs next:
        a pipelining client has usually journaled that op already. With `handoff` it also sets the idle key
        (treadle.gpu_worker.executor.linger): the next op, submitted once this result is read, is handed over."""
        session_id, following = entry.session_id, entry.seq + 1
        with self.host.registry.redis.pipeline(transaction=True) as pipe:
            if usage is not None:
                self.usage.record(usage, client=pipe)
            if self._one_write:
                self.results.queue_store(pipe, entry.future_id, payload, error)
            else:
                pipe.execute()
                if error is None:
                    self.results.store_ok(entry.future_id, payload)
                else:
                    self.results.store_error(entry.future_id, error)
            stepped = {} if step is None else {"step": step}
            self.host.registry.update(session_id, client=pipe, applied=entry.seq, last_activity=time.time(), **stepped)
            if handoff:
                self.linger.mark(pipe)
            Journal.read_with(pipe, session_id, following, names.lease_key(session_id))
            *_, raw, lease = pipe.execute()
        return Journal.parse(session_id, following, raw), lease

    def nudge_stalled(self) -> None:
        """Ring the next op of every owned session that has one journaled but is not running it, and was
        found so on the previous call too (a doorbell normally arrives within milliseconds). A backstop:
        every path that leaves an op behind rings it; this makes a path that fails to a delay, not a stall."""
        for session_id, owned in list(self.host.owned.items()):
            if self.host.registry.next_seq(session_id) <= owned.applied:
                owned.stalled_at = None
                continue
            if not self.host.device_lock.acquire(blocking=False):
                continue  # an op is running (or a recovery): not stalled
            try:
                stalled, owned.stalled_at = owned.stalled_at == owned.applied, owned.applied
                entry = self.host.journal.get(session_id, owned.applied + 1) if stalled else None
            finally:
                self.host.device_lock.release()
            if entry is not None:
                log.warning("session %s: op %d was journaled with no doorbell coming; ringing it", session_id, entry.seq)
                ring(self.app, session_id, entry.seq, entry.op)

    def _ring_on(self, session_id: str, seq: int) -> None:
        """Ring the doorbell of a journaled op: it goes through Celery to whoever owns the session."""
        entry = self.host.journal.get(session_id, seq)
        if entry is not None:
            ring(self.app, session_id, seq, entry.op)

    def _not_ours(self, session_id: str, seq: int) -> None:
        """A doorbell for a session this worker does not own: answer if the session is gone, else pass it on."""
        record = self.host.registry.get(session_id)
        fid = names.future_id(session_id, seq)
        if record is None or record.status != "active":
            if not self.results.is_done(fid):
                self.results.store_error(fid, inactive_error(session_id, record))
            return
        self._ring_on(session_id, seq)  # a fresh doorbell reaches whoever owns (or will own) it


REDIS_OUTAGE_TOLERANCE_S = 300.0
# Journaled ops a drain runs past the last doorbell seen (see the module docstring).
READ_AHEAD_OPS = 8


def _through_outages(write) -> None:
    """Run a Redis write, retrying through a Redis restart (bounded backoff, then give up loudly)."""
    delay, since = 0.1, time.monotonic()
    while True:
        try:
            return write()
        except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError, kombu_errors.OperationalError):
            if time.monotonic() - since > REDIS_OUTAGE_TOLERANCE_S:
                raise
            log.warning("Redis unavailable while storing a result; retrying in %.1f s", delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
