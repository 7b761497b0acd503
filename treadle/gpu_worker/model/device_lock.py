"""The lock that training ops and sampling steps take turns on: reentrant, granted in arrival order.

A plain `threading.RLock` lets the thread that just released it take it straight back, so a sampling
loop that releases between decode steps could keep a training op waiting for a whole batch. Here a
waiter that queued first is served first: a training op that arrives while a decode step runs gets
the device right after that step, and the sampler's next step queues behind it.
"""

from __future__ import annotations

import threading
from collections import deque


class DeviceLock:
    """Reentrant FIFO lock (a `with` block; the same thread may nest it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._waiting: deque[object] = deque()

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket = object()
            self._waiting.append(ticket)
            # No timeout: the holder is a single model call (one op or one decode step) that always returns.
            self._cond.wait_for(lambda: self._owner is None and self._waiting[0] is ticket)
            self._waiting.popleft()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("DeviceLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> "DeviceLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
