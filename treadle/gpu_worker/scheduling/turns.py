"""Turns between the sessions a worker owns: who has an op ready, whose turn it is, each one's place in line.

When several owned sessions have ops ready, each turn is one op, and it goes to the owner, then the
session of that owner, with the least service so far (its ops' tokens at the measured device time per
token of their kind of op, treadle.gpu_worker.scheduling.fair) over the owner's weight. So a session reads ahead
only while no other session waits, and a tenant that pipelines heavy ops delays another's next op by at
most the op that is running. A waiting control message (a sample request, a session to create) ends
the sequencer's pass at once, so a sample request reaches the sampler after at most the op that is
running, not after a backlog of training ops. Each op's record also writes, per waiting session, its
place in line and its estimated wait (the average costs of the ops ahead of it), which `treadle status`,
the gateway and the metrics show; and it reads what the next decision needs (`Glance`), in the same
round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from redis import Redis

from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.gpu_worker.scheduling.fair import FairShare
from treadle.queue import names


def ready_elsewhere(redis: Redis, next_ops: list[tuple[str, int]]) -> list[str]:
    """The sessions of `next_ops` ((session id, its next seq)) whose next op is journaled (one round trip)."""
    with redis.pipeline(transaction=False) as pipe:
        for sid, seq in next_ops:
            pipe.hexists(names.journal_key(sid), str(seq))
        found = pipe.execute()
    return [sid for (sid, _), there in zip(next_ops, found) if there]


def line(fair: FairShare, owners: dict[str, str]) -> dict[str, tuple[int, float]]:
    """Sessions (session -> owner: the running one and those waiting) by their place in line: (position, estimated
    wait s)."""
    view, wait = {}, 0.0
    for position, sid in enumerate(fair.order(owners), start=1):
        view[sid] = (position, wait)
        wait += fair.cost.get(sid, 0.0)
    return view


@dataclass
class Glance:
    """What an op's record also writes and reads for the turns, in the same round trip: each waiting session's
    place in line (`line`: session -> (position, estimated wait s)); which of `sessions` ((id, next seq)) have that
    op journaled, and whether one of the control `queues` holds a message."""

    sessions: list[tuple[str, int]]
    queues: list[str]
    line: dict[str, tuple[int, float]]
    ready: list[str] = field(default_factory=list)
    control_waiting: bool = False

    def queue(self, pipe, registry) -> None:
        for sid, (position, wait_s) in self.line.items():
            registry.update(sid, client=pipe, queue_position=position, queue_wait_s=round(wait_s, 6))
        for sid, seq in self.sessions:
            pipe.hexists(names.journal_key(sid), str(seq))
        for queue in self.queues:
            pipe.llen(queue)

    def read(self, answers: list) -> None:
        """`answers`: the pipeline's answers up to the ones `queue` added, which end them."""
        counts = answers[len(answers) - len(self.queues) :]
        found = answers[len(answers) - len(self.queues) - len(self.sessions) : len(answers) - len(self.queues)]
        self.ready = [sid for (sid, _), there in zip(self.sessions, found) if there]
        self.control_waiting = any(counts)


class HeldDevice:
    """The device lock of the engine a pass's ops run on, kept from one op to the next while the next op's session
    is owed the device at least as much as whoever waits (`DeviceLock.keep`). Released between two ops, it went to
    the sampler's next round, which was waiting: a light session's `optim_step` then waited for a heavy session's
    prefill after its own `forward_backward`."""

    def __init__(self) -> None:
        self.lock: DeviceLock | None = None

    def take(self, lock: DeviceLock, session_id: str) -> None:
        tenants = {session_id: 1.0}
        if self.lock is not None and (self.lock is not lock or not self.lock.keep(tenants)):
            self.release()
        if self.lock is None:
            lock.acquire(tenants)
            self.lock = lock

    def keep_for(self, session_id: str) -> None:
        """Go on holding the device for the session while the sequencer waits for its next op (else a decode step of
        another tenant starts meanwhile, and the op waits for it), unless a waiter is owed it more; the hold is
        charged to the session."""
        if self.lock is not None and not self.lock.keep({session_id: 1.0}):
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
