"""Where the SDK's `_async` twins run their blocking calls, so that the event loop never waits on Redis.

Two kinds of call block: publishing an op (a Redis write that rides out an outage for minutes, and waits while a queue is full) and
waiting for a result (`OpsClient.wait`, asleep on the result's channel). Twins hand each to a thread
here and await it:

- `submit_in_order`: one thread per lane (a training session, a sampling client), first come first
  served, so ops reach the session in the order their twins were started - the order
  `forward_backward_async(...)` then `optim_step_async()` promises. A submit that waits for room in a
  full queue (`treadle.sdk.capacity`) holds up its own lane only; a lane's thread ends when it runs dry.
- `wait_off_loop`: a thread per concurrent wait, started as needed and kept for the next one, so an
  awaited future never queues behind others and its timeout counts from the await.

The threads are daemons: a wait whose awaiting task was cancelled (Ctrl-C in `asyncio.run`) goes on
until its result lands, and must not keep the interpreter from exiting meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import queue
import threading
from typing import Any, Callable, Hashable, TypeVar

R = TypeVar("R")


class _Waiters:
    """A thread per concurrent call, kept for the next one."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads blocked on the queue with no job assigned to them

    async def run(self, fn: Callable[[], R]) -> R:
        loop = asyncio.get_running_loop()
        settled: asyncio.Future = loop.create_future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._serve, name="treadle-wait", daemon=True).start()
        self._jobs.put((loop, settled, fn))
        return await settled

    def _serve(self) -> None:
        while True:
            _run(*self._jobs.get())
            with self._lock:
                self._idle += 1


class _Lanes:
    """Calls in lanes: a lane's calls run one at a time in the order they were started, on a thread that lives
    while the lane has calls queued; lanes run side by side."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lanes: dict[Hashable, collections.deque] = {}

    async def run(self, lane: Hashable, fn: Callable[[], R]) -> R:
        loop = asyncio.get_running_loop()
        settled: asyncio.Future = loop.create_future()
        with self._lock:
            jobs = self._lanes.get(lane)
            idle = jobs is None
            if idle:
                jobs = self._lanes[lane] = collections.deque()
            jobs.append((loop, settled, fn))
        if idle:
            threading.Thread(target=self._serve, args=(lane, jobs), name="treadle-submit", daemon=True).start()
        return await settled

    def _serve(self, lane: Hashable, jobs: collections.deque) -> None:
        while True:
            with self._lock:
                if not jobs:
                    del self._lanes[lane]
                    return
                job = jobs.popleft()
            _run(*job)


def _run(loop: asyncio.AbstractEventLoop, settled: asyncio.Future, fn: Callable[[], Any]) -> None:
    try:
        outcome: tuple[Any, BaseException | None] = (fn(), None)
    except BaseException as exc:  # noqa: BLE001 - every outcome, errors included, belongs to the awaiting task
        outcome = (None, exc)
    try:
        loop.call_soon_threadsafe(_settle, settled, *outcome)
    except RuntimeError:  # the awaiting loop has closed: nobody is left to tell
        pass


def _settle(settled: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if settled.cancelled():
        return
    if error is not None:
        settled.set_exception(error)
    else:
        settled.set_result(value)


_SUBMITTERS = _Lanes()
_WAITERS = _Waiters()


async def submit_in_order(lane: Hashable, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """`fn(*args, **kwargs)` (a call that publishes ops) on `lane`'s submitting thread, after those started before."""
    return await _SUBMITTERS.run(lane, functools.partial(fn, *args, **kwargs))


async def wait_off_loop(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """`fn(*args, **kwargs)` (a call that waits) on a thread of its own."""
    return await _WAITERS.run(functools.partial(fn, *args, **kwargs))
