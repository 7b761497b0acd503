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
then `optim_step`) costs one Celery message per burst. Should a doorbell ever be missing (a drain that
died with an op next in line), the caretaker's `nudge_stalled` rings it.

Sessions take turns, one op each, by fair share (treadle.gpu_worker.scheduling.turns): the same write also asks
which other owned sessions have their next op journaled and whether a control message waits, which
ends the pass (the next op's doorbell is rung and the Celery task returns); so does a pass that has
run `READ_AHEAD_OPS` ops past the doorbells it has seen. Each session's own order, the fencing, the
hand-off and recovery are the same whoever's turn it is.

When the drain has nothing left, the same Celery task waits a few milliseconds for the next op of any
session this worker owns (treadle.gpu_worker.scheduling.linger): a loop that submits its next step right after
reading a result then costs no Celery message at all.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Mapping

from celery import Celery

from treadle.errors import ServerError, TreadleError
from treadle.gpu_worker.scheduling import turns
from treadle.gpu_worker.scheduling.device_lock import serving
from treadle.gpu_worker.scheduling.fair import FairShare
from treadle.gpu_worker.sessions.hosting import OwnedSession, SessionHost, SessionStores
from treadle.gpu_worker.scheduling.linger import Linger
from treadle.gpu_worker.sessions.op_handlers import handler_for
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.metering import SDK_OWNER, OpUsage
from treadle.queue import names
from treadle.queue.journal import Journal, JournalEntry
from treadle.queue.ops import OpRequest, StopRequest, encode_result
from treadle.queue.connections import ring
from treadle.queue.outages import through_outages
from treadle.queue.results import ResultStore
from treadle.queue.sessions import inactive_error

log = logging.getLogger("treadle.worker")


class Sequencer:
    def __init__(
        self,
        sessions: SessionHost,
        app: Celery,
        *,
        stores: SessionStores,
        after_op: Callable[[OwnedSession, str], bool],
        reload: Callable[[OwnedSession], None],
        usage: UsageRecorder,
        linger: Linger,
        fair: FairShare | None = None,
        observe_wait: Callable[[str, str, float], None] | None = None,
        observe_anticipation: Callable[[str, str | None, float], None] | None = None,
    ):
        self.sessions = sessions  # the owned sessions and their life (release, finish)
        self.redis, self.registry, self.journal, self.lease = (
            stores.redis,
            stores.registry,
            stores.journal,
            stores.lease,
        )
        self.op_lock = sessions.op_lock
        self.linger = linger
        self.fair = fair or FairShare()
        self._observe_wait = observe_wait  # (owner, base_model, seconds from submit to start): the queue-wait histogram
        self._observe_anticipation = observe_anticipation  # (base_model, outcome, seconds): the anticipation counters
        self._waiting: dict = {}  # the sessions with an op ready, besides the one running (see _turns)
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
        this worker directly for as long as they come (treadle.gpu_worker.scheduling.linger)."""
        handed: tuple[str, int] | None = (session_id, seq)
        try:
            while handed is not None:
                self._serve(*handed)
                handed = self.linger.next([names.model_queue(m) for m in self.sessions.engines], self._next_ops())
        except BaseException:
            with contextlib.suppress(Exception):  # ringing needs Redis too, which may be what failed
                if (left := self.linger.abandon()) is not None:
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

    def _next_ops(self) -> list[tuple[str, int]]:
        """(session_id, next seq) of every owned session, starting at a turning point: a session that keeps
        submitting does not keep the others waiting."""
        pending = [(sid, owned.applied + 1) for sid, owned in list(self.sessions.owned.items())]
        self._rotation += 1
        cut = self._rotation % len(pending) if pending else 0
        return pending[cut:] + pending[:cut]

    def drain(self, session_id: str, *, handoff: bool = False) -> None:
        """Run every op of the session that is next in line, in seq order, each in its turn with the other owned
        sessions' (see the module docstring). `handoff`: the caller waits for hand-offs afterwards (a Celery task
        does; a failover does not)."""
        with self.op_lock:
            self._turns(session_id, handoff=handoff)

    def _turns(self, first: str, *, handoff: bool = True) -> None:
        """Give turns, one op each, to the owned sessions with an op ready (`first` has one, or had), until none has
        one, a control message waits, or the pass has run `READ_AHEAD_OPS` ops past its doorbells. Holds the
        device lock (the caller's)."""
        # session -> its next entry and lease, read with the previous op's record; None: read it at its turn
        ready: dict[str, tuple[JournalEntry | None, bytes | None] | None] = {first: None}
        if len(self.sessions.owned) > 1:
            others = [(sid, o.applied + 1) for sid, o in list(self.sessions.owned.items()) if sid != first]
            ready.update(dict.fromkeys(turns.ready_elsewhere(self.redis, others)))
        self.fair.forget(set(self.sessions.owned))
        self._waiting = ready
        held = turns.HeldDevice()
        try:
            self._give_turns(ready, handoff, held)
        finally:
            held.release()

    def _give_turns(self, ready: dict, handoff: bool, held: turns.HeldDevice) -> None:
        past_doorbells = 0
        while ready:
            session_id = self.fair.pick({sid: _owner_of(self.sessions.owned, sid) for sid in ready})
            if (owned := self.sessions.owned.get(session_id)) is None:  # released meanwhile (a stop, a lost lease)
                del ready[session_id]
                continue
            if past_doorbells >= READ_AHEAD_OPS:  # back to Celery for a moment: its turn comes back by the doorbell
                self._ring_on(session_id, owned.applied + 1)
                return
            held.take(self.sessions.engine(owned.record.base_model).device, session_id)
            turn = self._turn(owned, ready.pop(session_id), handoff)
            if turn is None:
                continue
            past_doorbell, following, others, control_waiting = turn
            past_doorbells += past_doorbell
            for other in others:
                ready.setdefault(other, None)
            if following is None:  # a checkpoint ran, which takes a while: what the record read may be stale by now
                following = self.journal.get_with(session_id, owned.applied + 1, names.lease_key(session_id))
            if following[0] is not None:
                ready[session_id] = following
            elif ready and not control_waiting:  # its last op so far, while others wait
                came = self._anticipate(owned, ready, held)
                if came == "op":  # as if handed over (linger): not a read-ahead past the doorbells
                    owned.max_seen = max(owned.max_seen, owned.applied + 1)
                    ready[session_id] = None
                    continue
                control_waiting = came == "control"
            if control_waiting and ready:  # a sample request or a create waits: let Celery deliver it
                self._ring_on(next(iter(ready)), None)
                return

    def _anticipate(self, owned: OwnedSession, ready: dict, held: turns.HeldDevice) -> str | None:
        """The session has just run its last journaled op while `ready` wait: if it is still owed the device, wait a
        moment for its next op (treadle.gpu_worker.scheduling.linger), holding the device for it unless a forward
        waiting for the device is owed more, and charge the wait to it. "op" when its next op came, "control" when a
        control message ended the wait, else None. A session whose last wait found nothing is not waited for at its
        next chance (a client that thinks long would cost the device a window per op)."""
        sid = owned.session_id
        if self.linger.anticipate_s <= 0 or not owned.anticipate:
            owned.anticipate = True
            return None
        owners = {key: _owner_of(self.sessions.owned, key) for key in (sid, *ready)}
        if self.fair.order(owners)[0] != sid:
            return None
        held.keep_for(sid)
        started = time.monotonic()
        came = self.linger.expect([names.model_queue(m) for m in self.sessions.engines], sid, owned.applied + 1)
        waited = time.monotonic() - started
        self.fair.hold(sid, owners[sid], waited)
        if self._observe_anticipation is not None:
            self._observe_anticipation(owned.record.base_model, came, waited)
        owned.anticipate = came is not None
        return came

    def _turn(self, owned: OwnedSession, prefetched, handoff: bool):
        """Run the session's next op, if it has one. Returns (1 if it ran past the doorbells seen, else 0; the next
        entry and lease, read with its record, or None after a checkpoint; the other sessions with an op ready;
        whether a control message waits), or None when it had no op or lost its lease."""
        session_id = owned.session_id
        entry, lease = prefetched or self.journal.get_with(session_id, owned.applied + 1, names.lease_key(session_id))
        if entry is None:
            return None
        past_doorbell = int(entry.seq > owned.max_seen)
        owned.max_seen = max(owned.max_seen, entry.seq)
        if not self.lease.is_ours(lease, owned.epoch):
            log.warning("lost the lease of session %s; handing it over", session_id)
            self.sessions.release(session_id, drop_lease=False)
            self._not_ours(session_id, entry.seq)
            return None
        if owned.unloaded:
            self._reload(owned)
        if self._observe_wait is not None:
            self._observe_wait(
                _owner_of(self.sessions.owned, session_id),
                owned.record.base_model,
                max(0.0, time.time() - entry.submitted_at),
            )
        following, others, control_waiting = self._run(owned, entry, handoff)
        if entry.op == StopRequest.op:
            self.sessions.finish(session_id)
            following = (None, None)
        return past_doorbell, following, others, control_waiting

    def _run(self, owned: OwnedSession, entry: JournalEntry, handoff: bool):
        """Run one op and record it; returns what the record read with it: the next seq's journal entry and the
        lease (None after an automatic checkpoint: the lease read before it may be stale by now), the other owned
        sessions with an op ready, and whether a control message waits."""
        started, request, response, payload, error = time.monotonic(), None, None, None, None
        try:
            handler = handler_for(entry.op)
            request: OpRequest = entry.request()
            with serving(entry.session_id):  # the device's turns count this op's time for its session
                response = handler(request, self.sessions.context(owned, entry.seq))
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
        seconds = time.monotonic() - started
        if request is not None:
            usage = self.usage.observe(
                session_id=entry.session_id,
                op_id=str(entry.seq),
                request=request,
                response=response,
                owner=owned.record.owner,
                base_model=owned.record.base_model,
                seconds=seconds,
                outcome="ok" if error is None else f"{error.category}_error",
            )
        tokens = 0 if usage is None else usage.prefill_tokens + usage.trained_tokens + usage.sampled_tokens
        self.fair.charge(
            entry.session_id,
            _owner_of(self.sessions.owned, entry.session_id),
            seconds,
            kind=entry.op,
            units=tokens,
        )
        glance = turns.Glance(
            sessions=[(sid, o.applied + 1) for sid, o in list(self.sessions.owned.items()) if sid != entry.session_id],
            queues=[names.model_queue(m) for m in self.sessions.engines],
            line=turns.line(
                self.fair,
                {
                    s: _owner_of(self.sessions.owned, s)
                    for s in [entry.session_id, *self._waiting]
                    if s in self.sessions.owned
                },
            ),
        )
        following = _through_outages(lambda: self._record(entry, usage, payload, error, step, handoff, glance))
        return (None if self._after_op(owned, entry.op) else following), glance.ready, glance.control_waiting

    def _step(self, owned: OwnedSession) -> int | None:
        engine, session_id = self.sessions.engine(owned.record.base_model), owned.record.session_id
        return engine.step(session_id) if engine.has_session(session_id) else None

    def _record(
        self,
        entry: JournalEntry,
        usage: OpUsage | None,
        payload: dict | None,
        error: TreadleError | None,
        step: int | None,
        handoff: bool = False,
        glance: turns.Glance | None = None,
    ) -> tuple[JournalEntry | None, bytes | None]:
        """Meter the op, store its result, mark its seq applied: in this order (a seq is never marked applied
        without its result, see treadle.gpu_worker.executor.usage for the meter), and in one MULTI/EXEC when results
        live in the broker's Redis. Safe to repeat: the meter counts an op once, the rest are plain sets.

        The same round trip reads the next seq's journal entry and the lease, which the drain needs next:
        a pipelining client has usually journaled that op already. With `handoff` it also sets the idle key
        (treadle.gpu_worker.scheduling.linger): the next op, submitted once this result is read, is handed over. With a
        `glance` it also writes each waiting session's place in line and reads what the turns need next."""
        session_id, following = entry.session_id, entry.seq + 1
        with self.redis.pipeline(transaction=True) as pipe:
            if usage is not None:
                self.usage.record(usage, client=pipe)
            if self._one_write:
                self.results.queue_store(pipe, entry.future_id, payload, error)
            else:
                pipe.execute()
                self.results.store(entry.future_id, payload, error)
            stepped = {} if step is None else {"step": step}
            cost = self.fair.cost.get(session_id)
            self.registry.update(
                session_id,
                client=pipe,
                applied=entry.seq,
                last_activity=time.time(),
                **stepped,
                **({} if cost is None else {"op_cost_s": round(cost, 6)}),
            )
            if handoff:
                self.linger.mark(pipe)
            if glance is not None:
                glance.queue(pipe, self.registry)
            Journal.read_with(pipe, session_id, following, names.lease_key(session_id))
            *answers, raw, lease = pipe.execute()
        if glance is not None:
            glance.read(answers)
        return Journal.parse(session_id, following, raw), lease

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

    def _ring_on(self, session_id: str, seq: int | None) -> None:
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


READ_AHEAD_OPS = 8  # ops a pass runs past the doorbells it has seen before its Celery task looks at its shutdown


def _owner_of(owned: Mapping[str, OwnedSession], session_id: str) -> str:
    session = owned.get(session_id)
    return (session.record.owner if session is not None else None) or SDK_OWNER


def _through_outages(write):
    """Run a Redis write, retrying through a Redis restart (treadle.queue.outages), then give up loudly."""
    return through_outages(write, what="storing a result")
