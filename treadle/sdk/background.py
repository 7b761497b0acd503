"""Where the SDK's `_async` twins run their blocking calls, so that the event loop never waits on Redis.

Two kinds of call block: publishing an op (a Redis write that rides out an outage for minutes) and
waiting for a result (`OpsClient.wait`, asleep on the result's channel). Twins hand each to a thread
here and await it:

- `submit_in_order`: one thread, first come first served, so ops reach the session in the order their
  twins were started - the order `forward_backward_async(...)` then `optim_step_async()` promises.
- `wait_off_loop`: a thread per concurrent wait, started as needed and kept for the next one, so an
  awaited future never queues behind others and its timeout counts from the await.

The threads are daemons: a wait whose awaiting task was cancelled (Ctrl-C in `asyncio.run`) goes on
until its result lands, and must not keep the interpreter from exiting meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from typing import Any, Callable, TypeVar

R = TypeVar("R")


class _DaemonThreads:
    def __init__(self, name: str, serial: bool):
        self._name, self._serial = name, serial
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads blocked on the queue with no job assigned to them

    async def run(self, fn: Callable[[], R]) -> R:
        loop = asyncio.get_running_loop()
        settled: asyncio.Future = loop.create_future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif not (self._serial and self._threads):
                self._threads += 1
                threading.Thread(target=self._serve, name=f"treadle-{self._name}", daemon=True).start()
        self._jobs.put((loop, settled, fn))
        return await settled

    def _serve(self) -> None:
        while True:
            loop, settled, fn = self._jobs.get()
            try:
                outcome: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # noqa: BLE001 - every outcome, errors included, belongs to the awaiting task
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, settled, *outcome)
            except RuntimeError:  # the awaiting loop has closed: nobody is left to tell
                pass
            if not self._serial:
                with self._lock:
                    self._idle += 1


def _settle(settled: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if settled.cancelled():
        return
    if error is not None:
        settled.set_exception(error)
    else:
        settled.set_result(value)


_SUBMITTER = _DaemonThreads("submit", serial=True)
_WAITERS = _DaemonThreads("wait", serial=False)


async def submit_in_order(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """`fn(*args, **kwargs)` (a call that publishes ops) on the one submitting thread, after those started before."""
    return await _SUBMITTER.run(functools.partial(fn, *args, **kwargs))


async def wait_off_loop(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """`fn(*args, **kwargs)` (a call that waits) on a thread of its own."""
    return await _WAITERS.run(functools.partial(fn, *args, **kwargs))
