"""Turns between the sessions a worker owns: whose op runs next, how far a pass reads ahead, when it waits
for a session's next op, and what a Celery task takes after its drain.

Sessions take turns, one op each, by fair share (treadle.gpu_worker.scheduling.turns): each op's record
also asks which other owned sessions have their next op journaled and whether a control message waits,
which ends the pass (the next op's doorbell is rung and the Celery task returns); so does a pass that has
run `READ_AHEAD_OPS` ops past the doorbells it has seen. Each session's own order, the fencing and
recovery are the sequencer's, the same whoever's turn it is (treadle.gpu_worker.executor.sequencer).

When the session that just ran has no next op yet while others wait, and it is still owed the device, the
pass waits a moment for its next op (anticipation, treadle.gpu_worker.scheduling.linger), holding the
device for it, and charges the wait to it. When the drain has nothing left, the same Celery task waits a
few milliseconds for the next op of any session this worker owns (the hand-off, `handed`): a loop that
submits its next step right after reading a result then costs no Celery message at all.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, cast

from treadle.gpu_worker.executor.op_record import FinishedOp, NextEntry
from treadle.gpu_worker.scheduling.fair import FairShare
from treadle.gpu_worker.scheduling.linger import Arrival, Linger
from treadle.gpu_worker.scheduling.turns import Glance, HeldDevice, line, ready_elsewhere
from treadle.gpu_worker.sessions.hosting import OwnedSession, SessionHost
from treadle.metering import SDK_OWNER
from treadle.queue import names
from treadle.queue.journal import JournalEntry

READ_AHEAD_OPS = 8  # ops a pass runs past the doorbells it has seen before its Celery task looks at its shutdown


@dataclass(frozen=True)
class TurnMetrics:
    """Where the turns report (treadle.observability.metrics in a worker; nowhere when None)."""

    queue_wait: Callable[[str, str, float], None] | None = None  # (owner, base_model, seconds from submit to start)
    anticipation: Callable[[str, str, float], None] | None = None  # (base_model, Arrival's label, seconds waited)


@dataclass(frozen=True)
class Due:
    """A session whose turn has come, with its next entry when the previous op's record read it."""

    owned: OwnedSession
    ahead: NextEntry | None


@dataclass(frozen=True)
class Turn:
    """What a session's turn (one op) leaves for the next decision."""

    past_doorbell: bool  # the op ran ahead of the doorbells heard: it counts against READ_AHEAD_OPS
    following: NextEntry  # the session's next entry and lease, read with the op's record
    glance: Glance  # the other sessions with an op ready, and whether a control message waits


class TurnScheduler:
    def __init__(
        self, host: SessionHost, linger: Linger, *, fair: FairShare | None = None, metrics: TurnMetrics = TurnMetrics()
    ):
        self.host = host  # the owned sessions and their engines
        self.redis = host.stores.redis
        self.linger = linger
        self.fair = fair or FairShare()
        self.metrics = metrics
        self._waiting: dict[str, NextEntry | None] = {}  # the pass's sessions with an op ready, besides the one running
        self._rotation = 0

    # ------------------------------------------------------------ between Celery tasks
    def handed(self) -> tuple[str, int] | None:
        """The next op (session_id, seq) to run after a drain: one handed to this worker directly, or one journaled
        (treadle.gpu_worker.scheduling.linger); None when none came or a control message waits."""
        return self.linger.next(self._control_queues(), self._next_ops())

    def abandon(self) -> tuple[str, int] | None:
        """After a failure: end the hand-off wait; what was handed over meanwhile (its doorbell must be rung)."""
        return self.linger.abandon()

    def _next_ops(self) -> list[tuple[str, int]]:
        """(session_id, next seq) of every owned session, starting at a turning point: a session that keeps
        submitting does not keep the others waiting."""
        pending = [(sid, owned.applied + 1) for sid, owned in list(self.host.owned.items())]
        self._rotation += 1
        cut = self._rotation % len(pending) if pending else 0
        return pending[cut:] + pending[:cut]

    def _control_queues(self) -> list[str]:
        return [names.model_queue(m) for m in self.host.engines]

    # ------------------------------------------------------------ a pass
    @contextmanager
    def pass_from(self, first: str) -> Iterator[TurnPass]:
        """A pass of turns among the owned sessions with an op ready (`first` has one, or had); the device it holds
        is released when it ends."""
        ready: dict[str, NextEntry | None] = {first: None}
        owned = self.host.owned
        if len(owned) > 1:
            others = [(sid, o.applied + 1) for sid, o in list(owned.items()) if sid != first]
            ready.update(dict.fromkeys(ready_elsewhere(self.redis, others)))
        self.fair.forget(set(owned))
        self._waiting = ready
        turns = TurnPass(self, ready)
        try:
            yield turns
        finally:
            turns.held.release()

    def owner_of(self, session_id: str) -> str:
        session = self.host.owned.get(session_id)
        return (session.record.owner if session is not None else None) or SDK_OWNER

    def started(self, owned: OwnedSession, entry: JournalEntry) -> None:
        """The session's op starts: how long it waited since its submit goes to the queue-wait metric."""
        if self.metrics.queue_wait is not None:
            waited = max(0.0, time.time() - entry.submitted_at)
            self.metrics.queue_wait(self.owner_of(owned.session_id), owned.record.base_model, waited)

    def charge(self, op: FinishedOp) -> None:
        """The op's device time, at its kind's measured rate (treadle.gpu_worker.scheduling.fair)."""
        session_id = op.entry.session_id
        self.fair.charge(session_id, self.owner_of(session_id), op.seconds, kind=op.entry.op, units=op.tokens)

    def cost(self, session_id: str) -> float | None:
        """The session's average turn cost (seconds), which its record shows."""
        return self.fair.cost.get(session_id)

    def glance(self, session_id: str) -> Glance:
        """What the record of `session_id`'s op also writes (the waiting sessions' places in line) and reads (which
        other sessions have an op ready, whether a control message waits) for the turns."""
        owned = self.host.owned
        waiting = [sid for sid in [session_id, *self._waiting] if sid in owned]
        return Glance(
            sessions=[(sid, o.applied + 1) for sid, o in list(owned.items()) if sid != session_id],
            queues=self._control_queues(),
            line=line(self.fair, {sid: self.owner_of(sid) for sid in waiting}),
        )

    def anticipate(self, owned: OwnedSession, ready: dict, held: HeldDevice) -> Arrival:
        """The session has just run its last journaled op while `ready` wait: if it is still owed the device, wait a
        moment for its next op (treadle.gpu_worker.scheduling.linger), holding the device for it unless a forward
        waiting for the device is owed more, and charge the wait to it. A session whose last wait found nothing is
        not waited for at its next chance (a client that thinks long would cost the device a window per op)."""
        sid = owned.session_id
        if self.linger.anticipate_s <= 0 or not owned.anticipate:
            owned.anticipate = True
            return Arrival.NOTHING
        owners = {key: self.owner_of(key) for key in (sid, *ready)}
        if self.fair.order(owners)[0] != sid:
            return Arrival.NOTHING
        held.keep_for(sid)
        started = time.monotonic()
        came = self.linger.expect(self._control_queues(), sid, owned.applied + 1)
        waited = time.monotonic() - started
        self.fair.hold(sid, owners[sid], waited)
        if self.metrics.anticipation is not None:
            self.metrics.anticipation(owned.record.base_model, came.value, waited)
        owned.anticipate = came is not Arrival.NOTHING
        return came


class TurnPass:
    """One pass of turns, one op each: `next` says whose turn it is (taking its engine's device), `ran` takes what
    the turn left. The pass ends when no session has an op ready, or with `hand_back` set: a control message waits
    (a sample request reaches the sampler after at most the op that is running), or the pass has run
    `READ_AHEAD_OPS` ops past its doorbells."""

    def __init__(self, scheduler: TurnScheduler, ready: dict[str, NextEntry | None]):
        self.scheduler = scheduler
        self.ready = ready  # session -> its next entry, read with the previous op's record; None: read it at its turn
        self.held = HeldDevice()
        self.past_doorbells = 0
        self.hand_back: str | None = None  # the session whose next op goes back to Celery (its doorbell is rung)

    def next(self) -> Due | None:
        scheduler, ready = self.scheduler, self.ready
        while ready and self.hand_back is None:
            session_id = cast(str, scheduler.fair.pick({sid: scheduler.owner_of(sid) for sid in ready}))
            if (owned := scheduler.host.owned.get(session_id)) is None:  # released meanwhile (a stop, a lost lease)
                del ready[session_id]
                continue
            if (
                self.past_doorbells >= READ_AHEAD_OPS
            ):  # back to Celery for a moment: its turn comes back by the doorbell
                self.hand_back = session_id
                return None
            self.held.take(scheduler.host.engine(owned.record.base_model).device, session_id)
            return Due(owned, ready.pop(session_id))
        return None

    def ran(self, owned: OwnedSession, turn: Turn | None) -> None:
        """Take what the session's turn left (None: it had no op, or lost its lease)."""
        if turn is None:
            return
        ready, session_id = self.ready, owned.session_id
        self.past_doorbells += turn.past_doorbell
        for other in turn.glance.ready:
            ready.setdefault(other, None)
        control_waiting = turn.glance.control_waiting
        if turn.following.entry is not None:
            ready[session_id] = turn.following
        elif ready and not control_waiting:  # its last op so far, while others wait
            came = self.scheduler.anticipate(owned, ready, self.held)
            if came is Arrival.OP:  # as if handed over (linger): not a read-ahead past the doorbells
                owned.max_seen = max(owned.max_seen, owned.applied + 1)
                ready[session_id] = None
                return
            control_waiting = came is Arrival.CONTROL
        if control_waiting and ready:  # a sample request or a create waits: let Celery deliver it
            self.hand_back = next(iter(ready))
