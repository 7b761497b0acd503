"""APIFuture: what every SDK op returns at once.

`.result()` blocks until the worker has stored the op's result in Redis; `await future` does the same
without blocking the event loop. A future is just an id (`.id`): any process can resolve it later
with `TrainingClient.future(id)`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Generic, TypeVar

from treadle.errors import FutureTimeoutError

T = TypeVar("T")

# How often an awaited future checks that it can still resolve (`OpsClient.check_future`).
CHECK_EVERY_S = 2.0


class APIFuture(Generic[T]):
    def __init__(self, ops, future_id: str, decode: Callable[[dict], T], *, base_model: str | None = None):
        self._ops = ops
        self._id = future_id
        self._decode = decode
        self._base_model = base_model
        self._value: Any = None
        self._resolved = False

    @property
    def id(self) -> str:
        return self._id

    def done(self) -> bool:
        return self._resolved or self._ops.done(self._id)

    def result(self, timeout: float | None = None) -> T:
        if not self._resolved:
            raw = self._ops.wait(self._id, timeout=timeout, base_model=self._base_model)
            self._value = self._decode(raw)
            self._resolved = True
        return self._value

    async def result_async(self, timeout: float | None = None) -> T:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        # As the blocking wait does: soon, then every CHECK_EVERY_S, ask whether the future can still
        # resolve (its session lost or stopped, its seq or sample id never submitted), or it would wait forever.
        next_check = time.monotonic() + 0.5
        while not self.done():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise FutureTimeoutError(f"{self._id}: no result within {timeout} s")
            if now >= next_check:
                next_check = now + CHECK_EVERY_S
                self._ops.check_future(self._id)
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        return self.result()

    def __await__(self):
        return self.result_async().__await__()

    def __repr__(self) -> str:
        return f"APIFuture({self._id!r}, done={self._resolved})"
