"""The ordered sequencer: runs each session's ops strictly in seq order, from the journal.

Celery delivers at least once and, after a crash, out of order. So the sequencer never trusts
delivery order: a doorbell (`session_id`, `seq`) only says "the journal has ops up to seq"; the
sequencer then runs `applied+1, applied+2, ...` for as long as the journal has them. An op that
arrives early waits in the journal for its predecessor; a redelivered doorbell finds its seq applied
and its result already stored. Before each op it checks that this worker still holds the session's
lease (fencing), and results are stored under the op's future id, whichever doorbell ran it.

The sequencer also reads ahead: the write that marks an op applied also reads the next seq's entry
(treadle.gpu_worker.executor.op_record), and the drain runs it. An op journaled before its predecessor was
marked applied rings no doorbell at all (treadle.queue.journal): this read is what runs it, so a pipelining
client (`forward_backward` then `optim_step`) costs one Celery message per burst. Should a doorbell ever be
missing (a drain that died with an op next in line), the caretaker's `nudge_stalled` rings it.

Before an op runs, its seq is marked running in the session's record (one write): a worker that adopts the
session after its owner died finds there the op that was running, and counts the death against it
(treadle.gpu_worker.executor.failover). An op that killed `max_request_crashes` workers is answered with
CrashingRequestError instead of running, like an op that raised: it changes nothing, and a rebuild skips it.

Which owned session's op runs next, how far a pass reads ahead and what a Celery task takes after its drain
are the turn scheduler's (treadle.gpu_worker.executor.turn_scheduler); this module runs what it is given.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from celery import Celery

from treadle.errors import CrashingRequestError, ServerError, TreadleError
from treadle.gpu_worker.executor.op_record import FinishedOp, NextEntry, OpRecorder
from treadle.gpu_worker.executor.turn_scheduler import Due, Turn, TurnScheduler
from treadle.gpu_worker.scheduling.device_lock import serving
from treadle.gpu_worker.scheduling.turns import Glance
from treadle.gpu_worker.sessions.autosave import Autosaver
from treadle.gpu_worker.sessions.hosting import LeaseLost, OwnedSession, SessionHost, SessionStores
from treadle.gpu_worker.sessions.op_handlers import handler_for
from treadle.queue import names
from treadle.queue.connections import ring
from treadle.queue.journal import JournalEntry
from treadle.queue.ops import OpRequest, StopRequest, encode_result
from treadle.queue.outages import through_outages
from treadle.queue.sessions import inactive_error

log = logging.getLogger("treadle.worker")


class Sequencer:
    def __init__(
        self,
        sessions: SessionHost,
        app: Celery,
        *,
        stores: SessionStores,
        turns: TurnScheduler,
        recorder: OpRecorder,
        autosaver: Autosaver,
        max_crashes: int = 2,
    ):
        """`max_crashes`: the worker's `max_request_crashes` (see the module docstring)."""
        self.sessions = sessions  # the owned sessions and their life (release, finish)
        self.app = app
        self.registry, self.journal, self.lease = stores.registry, stores.journal, stores.lease
        self.op_lock = sessions.op_lock
        self.turns = turns
        self.recorder = recorder
        self.results = recorder.results
        self.autosaver = autosaver  # checkpoints after an op; an idle-unloaded session comes back before its next op
        self.max_crashes = max_crashes

    def on_doorbell(self, session_id: str, seq: int) -> None:
        """A Celery task: run the session's ops up to `seq` (and what follows), then take the ops handed to
        this worker directly for as long as they come (treadle.gpu_worker.scheduling.linger)."""
        handed: tuple[str, int] | None = (session_id, seq)
        try:
            while handed is not None:
                self._serve(*handed)
                handed = self.turns.handed()
        except BaseException:
            with contextlib.suppress(Exception):  # ringing needs Redis too, which may be what failed
                if (left := self.turns.abandon()) is not None:
                    self._ring_on(*left)
            raise

    def _serve(self, session_id: str, seq: int) -> None:
        with self.op_lock:
            owned = self.sessions.owned.get(session_id)
            if owned is None:
                self._not_ours(session_id, seq)
                return
            owned.max_seen = max(owned.max_seen, seq)
            self._turns(session_id)

    def drain(self, session_id: str, *, handoff: bool = False) -> None:
        """Run every op of the session that is next in line, in seq order, each in its turn with the other owned
        sessions' (see the module docstring). `handoff`: the caller waits for hand-offs afterwards (a Celery task
        does; a failover does not)."""
        with self.op_lock:
            self._turns(session_id, handoff=handoff)

    def _turns(self, first: str, *, handoff: bool = True) -> None:
        """Run the ops of a pass of turns (`first` has one, or had), one op a turn. Holds the op lock (the
        caller's); the pass holds the device's."""
        with self.turns.pass_from(first) as turns:
            while (due := turns.next()) is not None:
                turns.ran(due.owned, self._turn(due, handoff))
            if turns.hand_back is not None:
                self._ring_on(turns.hand_back)

    def _turn(self, due: Due, handoff: bool) -> Turn | None:
        """Run the session's next op, if it has one; None when it had none or lost its lease."""
        owned = due.owned
        ahead = due.ahead if due.ahead is not None else self._next_entry(owned)
        entry = ahead.entry
        if entry is None:
            return None
        past_doorbell = entry.seq > owned.max_seen
        owned.max_seen = max(owned.max_seen, entry.seq)
        if not self.lease.is_ours(ahead.lease, owned.epoch):
            self._hand_over(owned, entry.seq)
            return None
        if owned.unloaded:
            self.autosaver.reload(owned)
        self.turns.started(owned, entry)
        try:
            done = self._run(owned, entry)
        except LeaseLost:  # the op ran, but only its next owner may write its effects and result: it runs it again
            self._hand_over(owned, entry.seq)
            return None
        self.turns.charge(done)
        glance = self.turns.glance(owned.session_id)
        return Turn(past_doorbell=past_doorbell, following=self._record(owned, done, handoff, glance), glance=glance)

    def _hand_over(self, owned: OwnedSession, seq: int) -> None:
        """The session's lease is gone: drop it from this worker, unapplied ops stay in the journal for its next
        owner (the caretaker of any worker serving the model adopts it once the lease is free)."""
        log.warning("lost the lease of session %s; handing it over", owned.session_id)
        self.registry.clear_running(owned.session_id, seq)  # alive: its next owner counts no crash against the op
        self.sessions.release(owned.session_id, drop_lease=False)
        self._not_ours(owned.session_id, seq)

    def _run(self, owned: OwnedSession, entry: JournalEntry) -> FinishedOp:
        """Run one op and meter it."""
        started, request, response, payload, error = time.monotonic(), None, None, None, None
        crashed = owned.crashed is not None and owned.crashed[0] == entry.seq
        if not crashed:
            mark = functools.partial(self.registry.update, entry.session_id, running=entry.seq)
            through_outages(mark, what="marking an op running")
        try:
            handler = handler_for(entry.op)
            request: OpRequest = entry.request()
            if crashed:
                raise self._crashing(owned, entry)
            with serving(entry.session_id):  # the device's turns count this op's time for its session
                response = handler(request, self.sessions.context(owned, entry.seq))
            payload = encode_result(entry.op, response)
        except LeaseLost:
            raise
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
        seconds = time.monotonic() - started
        usage = None
        if request is not None:
            usage = self.recorder.usage.observe(
                session_id=entry.session_id,
                op_id=str(entry.seq),
                request=request,
                response=response,
                owner=owned.record.owner,
                base_model=owned.record.base_model,
                seconds=seconds,
                outcome="ok" if error is None else f"{error.category}_error",
                memory_bytes=owned.record.memory_bytes,
            )
        return FinishedOp(entry, seconds, payload=payload, error=error, usage=usage, step=step)

    def _crashing(self, owned: OwnedSession, entry: JournalEntry) -> CrashingRequestError:
        """The answer to the op that killed `max_crashes` workers, recorded first among the ops a rebuild skips."""
        _, deaths = owned.crashed or (entry.seq, 0)
        owned.crashed = None
        owned.record.crashed_ops = [*owned.record.crashed_ops, entry.seq]
        through_outages(
            lambda: self.registry.update(entry.session_id, crashed_ops=owned.record.crashed_ops),
            what="recording an op that crashes its workers",
        )
        log.error(
            "not running op %d (%s) of session %s: %d workers died running it (--max_request_crashes %d); answered "
            "with CrashingRequestError",
            entry.seq,
            entry.op,
            entry.session_id,
            deaths,
            self.max_crashes,
        )
        return CrashingRequestError.after(
            entry.op, names.future_id(entry.session_id, entry.seq), deaths, self.max_crashes
        )

    def _step(self, owned: OwnedSession) -> int | None:
        engine, session_id = self.sessions.engine(owned.record.base_model), owned.record.session_id
        return engine.step(session_id) if engine.has_session(session_id) else None

    def _record(self, owned: OwnedSession, done: FinishedOp, handoff: bool, glance: Glance) -> NextEntry:
        """Write the op's record (treadle.gpu_worker.executor.op_record), retrying through a Redis restart, then
        checkpoint the session if one is due; the session's next entry and lease."""
        session_id = owned.session_id
        following = through_outages(
            lambda: self.recorder.write(done, op_cost_s=self.turns.cost(session_id), handoff=handoff, glance=glance),
            what="storing a result",
        )
        checkpointed = self.autosaver.after_op(owned, done.entry.op)
        if done.entry.op == StopRequest.op:
            self.sessions.finish(session_id)
            return NextEntry()
        if checkpointed:  # which takes a while: what the record read may be stale by now
            return self._next_entry(owned)
        return following

    def _next_entry(self, owned: OwnedSession) -> NextEntry:
        return NextEntry.read(self.journal, owned.session_id, owned.applied + 1)

    def nudge_stalled(self) -> None:
        """Ring the next op of every owned session that has one journaled but is not running it, and was
        found so on the previous call too (a doorbell normally arrives within milliseconds). A backstop:
        every path that leaves an op behind rings it; this makes a path that fails to a delay, not a stall."""
        for session_id, owned in list(self.sessions.owned.items()):
            if self.registry.next_seq(session_id) <= owned.applied:
                owned.stalled_at = None
                continue
            if not self.op_lock.acquire(blocking=False):
                continue  # an op is running (or a recovery): not stalled
            try:
                stalled, owned.stalled_at = owned.stalled_at == owned.applied, owned.applied
                entry = self.journal.get(session_id, owned.applied + 1) if stalled else None
            finally:
                self.op_lock.release()
            if entry is not None:
                log.warning(
                    "session %s: op %d was journaled with no doorbell coming; ringing it", session_id, entry.seq
                )
                ring(self.app, session_id, entry.seq, entry.op)

    def _ring_on(self, session_id: str, seq: int | None = None) -> None:
        """Ring the doorbell of a journaled op (None: the owned session's next): it goes through Celery to whoever
        owns the session."""
        if seq is None:
            owned = self.sessions.owned.get(session_id)
            if owned is None:
                return
            seq = owned.applied + 1
        entry = self.journal.get(session_id, seq)
        if entry is not None:
            ring(self.app, session_id, seq, entry.op)

    def _not_ours(self, session_id: str, seq: int) -> None:
        """A doorbell for a session this worker does not own: answer if the session is gone, else pass it on."""
        record = self.registry.get(session_id)
        fid = names.future_id(session_id, seq)
        if record is None or record.status != "active":
            if not self.results.is_done(fid):
                self.results.store_error(fid, inactive_error(session_id, record))
            return
        self._ring_on(session_id, seq)  # a fresh doorbell reaches whoever owns (or will own) it
