"""The lock that training ops and sampling forwards take turns on: reentrant, granted fairly between tenants.

Two threads want an engine's device: the op thread (one training op at a time, in the sessions' fair
turns, treadle.gpu_worker.scheduling.turns) and the sampler's decode loop (one forward at a time: a
prefill, a decode step, a logprob batch). A plain lock, or a first-come one, alternates them one for one,
so a tenant's 8-token sample waited for another tenant's heavy training op before each of its decode steps,
eight of them per sample.

So each hold says whom it serves (its tenants: a training op's session; a decode step's sessions, each
weighted by its rows), the lock measures how long it was held and charges those seconds to them, and
when it is released it goes to the waiter serving the tenant with the least device time so far (start-
time fair tags, treadle.gpu_worker.scheduling.fair; a tenant that was idle rejoins at the clock). A decode
step that carries one row of a light tenant goes before the heavy tenant's next op; a decode step of the
heavy tenant's own rows waits its turn like its ops. Ties, and waiters that name no tenant, go in arrival order.

A tenant is a session id (a sample's: the session its snapshot came from), without owners' weights: the
weighted shares between owners are the op turns' (treadle.gpu_worker.scheduling.fair); here only which of
two ready forwards runs first is decided. The op thread names its tenant for the engine calls of one op with
`serving` (the engine's methods take the lock without knowing whom they serve).

On CPU the holder computes through `run`, on the process's one compute thread (why:
treadle.gpu_worker.scheduling.compute_thread); while that thread runs a holder's call, it counts as the
holder, so the call may take the lock again.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, TypeVar

import torch

from treadle.gpu_worker.scheduling.compute_thread import ComputeThread, compute_thread
from treadle.gpu_worker.scheduling.fair import ServiceTags

T = TypeVar("T")

_serving = threading.local()


@contextmanager
def serving(tenant: str) -> Iterator[None]:
    """Within the block, this thread's holds of any `DeviceLock` that name no tenants serve `tenant`."""
    previous = getattr(_serving, "tenant", None)
    _serving.tenant = tenant
    try:
        yield
    finally:
        _serving.tenant = previous


def on_device(method: Callable[..., T]) -> Callable[..., T]:
    """A method of an object whose `device` is its `DeviceLock`: the call holds the lock and computes where the
    device does (`DeviceLock.run`)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.device:
            return self.device.run(method, self, *args, **kwargs)

    return call


@dataclass
class _Waiter:
    arrival: int
    tenants: Mapping[str, float]


class DeviceLock:
    """Reentrant lock (a `with` block, or `hold(tenants)`; the same thread may nest it), granted fairly."""

    def __init__(self, compute: ComputeThread | None = None) -> None:
        self._compute = compute
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._arrivals = 0
        self._waiting: list[_Waiter] = []
        self._holding: Mapping[str, float] = {}
        self._held_since = 0.0
        self._turns = 0
        self.tags = ServiceTags()  # device seconds per tenant, as fair tags (relative to the clock)
        self.seconds: dict[str, float] = {}  # device seconds charged to each tenant so far (`forget` drops one)

    def acquire(self, tenants: Mapping[str, float] | None = None) -> None:
        """Wait for the device. `tenants`: whom the hold serves, with their shares of it (rows); None: this thread's
        `serving` tenant, if any."""
        me = self._me()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            if tenants is None:
                tenant = getattr(_serving, "tenant", None)
                tenants = {} if tenant is None else {tenant: 1.0}
            self._arrivals += 1
            waiter = _Waiter(self._arrivals, tenants)
            self._waiting.append(waiter)
            # No timeout: the holder is a single model call (one op or one forward) that always returns.
            self._cond.wait_for(lambda: self._owner is None and self._next() is waiter)
            self._waiting.remove(waiter)
            best = min(waiter.tenants, key=self.tags.tag, default=None)
            if best is not None:
                self.tags.advance(best)
            self._owner, self._depth = me, 1
            self._holding, self._held_since = waiter.tenants, time.monotonic()

    def release(self) -> None:
        with self._cond:
            if self._owner != self._me():
                raise RuntimeError("DeviceLock released by a thread that does not hold it")
            self._depth -= 1
            # Charged at every release, a nested one too: an op run inside a hold kept across ops (the sequencer's
            # `HeldDevice`) has its time counted before its result is stored, not when the hold ends.
            now = time.monotonic()
            self._charge(now - self._held_since)
            self._held_since = now
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def keep(self, tenants: Mapping[str, float]) -> bool:
        """Between two forwards of the thread holding the lock (not nested): True when it may go on holding it, now
        serving `tenants`, because no waiter serves a tenant with less device time than they have; False when it
        should release (a waiter is owed more, or as much: equals take turns). A thread that released and took the
        lock again would lose it to whoever was already waiting, owed or not; this is how the sampler keeps the
        device for a light tenant's decode steps while the heavy tenant's next op waits."""
        with self._cond:
            if self._owner != self._me() or self._depth != 1:
                raise RuntimeError("DeviceLock.keep needs the lock held once by this thread")
            now = time.monotonic()
            self._charge(now - self._held_since)
            self._held_since = now
            ours = min((self.tags.tag(t) for t in tenants), default=self.tags.clock)
            if self._waiting and self._priority(self._next()) <= ours:
                self._holding = {}  # charged up to now; the release that follows charges nobody
                return False
            if tenants:
                self.tags.advance(min(tenants, key=self.tags.tag))
            self._holding = tenants
            return True

    def forget(self, tenant: str) -> None:
        """Drop a tenant's total (a session this worker released)."""
        with self._cond:
            self.seconds.pop(tenant, None)

    def run(self, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """`fn(*args, **kwargs)`, computed on the compute thread if there is one; the caller holds the lock."""
        if self._compute is None:
            return fn(*args, **kwargs)
        if self._owner != self._me():
            raise RuntimeError("DeviceLock.run needs the lock held by this thread")
        return self._compute.run(fn, *args, **kwargs)

    def _me(self) -> int:
        """This thread, or the thread whose call the compute thread is running."""
        me = threading.get_ident()
        if self._compute is not None and me == self._compute.ident and self._compute.acting_for is not None:
            return self._compute.acting_for
        return me

    @contextmanager
    def hold(self, tenants: Mapping[str, float]) -> Iterator["DeviceLock"]:
        self.acquire(tenants)
        try:
            yield self
        finally:
            self.release()

    def __enter__(self) -> "DeviceLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _next(self) -> _Waiter:
        """The waiter whose turn it is: the one serving the least-served tenant (one naming none counts as at the
        clock), the earliest to arrive among equals."""
        return min(self._waiting, key=lambda w: (self._priority(w), w.arrival))

    def _priority(self, waiter: _Waiter) -> float:
        return min((self.tags.tag(t) for t in waiter.tenants), default=self.tags.clock)

    def _charge(self, seconds: float) -> None:
        total = sum(self._holding.values())
        if total <= 0:
            return
        self._turns += 1
        for tenant, share in self._holding.items():
            cost = seconds * share / total
            self.tags.charge(tenant, cost, self._turns)
            self.seconds[tenant] = self.seconds.get(tenant, 0.0) + cost


_group_lock: DeviceLock | None = None
_group_lock_made = threading.Lock()


def engine_lock(device: torch.device, *, shared: bool = False) -> DeviceLock:
    """A new engine's lock: its own, or with `shared` the process's one. The engines of a sharded group share it:
    every forward of theirs is a sequence of collectives that all ranks must run in one order
    (treadle.gpu_worker.parallel.lockstep), so no two may run at once, whichever models they serve."""
    global _group_lock
    if not shared:
        return DeviceLock(compute_thread(device))
    with _group_lock_made:
        if _group_lock is None:
            _group_lock = DeviceLock(compute_thread(device))
        return _group_lock
