"""APIFuture: what every SDK op returns at once.

`.result()` blocks until the worker has stored the op's result in Redis; `await future` does the same
without blocking the event loop. Without a timeout the wait still ends, with an error naming the request
and the reason, once nothing will answer it: no live worker for its model past a grace, a sample past its
lifetime (`treadle.queue.wait_bounds`). A future is just an id (`.id`): any process can resolve it later
with `TrainingClient.future(id)`.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Generic, TypeVar

from treadle.sdk.background import wait_off_loop

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
        """`result()` without blocking the event loop: the same wait (asleep on the result's channel, the same
        liveness checks and outage tolerance), run on a thread of its own (see `treadle.sdk.background`)."""
        if self._resolved:
            return self._value
        return await wait_off_loop(self.result, timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def __repr__(self) -> str:
        return f"APIFuture({self._id!r}, done={self._resolved})"
