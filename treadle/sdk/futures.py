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
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise FutureTimeoutError(f"{self._id}: no result within {timeout} s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        return self.result()

    def __await__(self):
        return self.result_async().__await__()

    def __repr__(self) -> str:
        return f"APIFuture({self._id!r}, done={self._resolved})"
