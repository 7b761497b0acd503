"""Waiting for room in a full queue, as Tinker's SDK retries the gateway's 429.

Workers bound what is queued (`--max_queued_ops_per_session`, `--max_queued_ops_per_owner`,
`--max_queued_sample_rows_per_owner`); a submit past a bound is refused with `CapacityError` and queues
nothing. A pipelining loop meets a bound as a matter of course, so an SDK submit waits its turn: it sleeps
the refusal's retry hint (when the queue's next op should have run: it grows as the queue slows) and
submits again, for at most `capacity_wait_s` in all (`ServiceClient(capacity_wait_s=...)` or
`TREADLE_CAPACITY_WAIT_S`), then raises.
The first wait on each bound is logged once per `ServiceClient`, naming the bound and how to change both.

A training client holds its session's submit lock while one of its submits waits, so no later op of the
session overtakes it; its `_async` twins wait on the session's submitting thread (`treadle.sdk.background`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from treadle.errors import CapacityError
from treadle.settings import SubmitSettings

R = TypeVar("R")

log = logging.getLogger("treadle.sdk")


class CapacityWait:
    """How long a submit waits for room; one per ServiceClient, shared by its training and sampling clients."""

    def __init__(self, max_wait_s: float | None = None):
        settings = SubmitSettings() if max_wait_s is None else SubmitSettings(capacity_wait_s=max_wait_s)
        self.max_wait_s = settings.capacity_wait_s
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, publish: Callable[[], R]) -> R:
        """`publish()`, called again after each CapacityError's retry hint until it is taken; past `max_wait_s`
        of waiting the last refusal is raised (at once when `max_wait_s` is 0)."""
        deadline = None
        while True:
            try:
                return publish()
            except CapacityError as refused:
                if self.max_wait_s <= 0:
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.max_wait_s
                    self._log_first(refused)
                elif now >= deadline:
                    raise CapacityError(
                        f"{refused.message}; the SDK waited {self.max_wait_s:g} s for room (capacity_wait_s)",
                        refused.retry_after_s,
                        refused.bound,
                    ) from None
                time.sleep(min(refused.retry_after_s, deadline - now))

    def _log_first(self, refused: CapacityError) -> None:
        with self._lock:
            if refused.bound in self._logged:
                return
            self._logged.add(refused.bound)
        log.warning(
            "%s. Waiting for room: a submit past a queue bound waits up to %g s, then raises CapacityError "
            "(ServiceClient(capacity_wait_s=...) or TREADLE_CAPACITY_WAIT_S; 0 raises at once); the bound is the "
            "workers' --%s. Logged once.",
            refused.message,
            self.max_wait_s,
            refused.bound,
        )
