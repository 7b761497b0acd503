"""The bounds of a wait with no timeout: when a pending request can no longer be answered.

Every wait on a future (`OpsClient.wait`, which the SDK's `APIFuture.result()` runs, and the gateway's
`retrieve_future`, which the official tinker SDK polls) asks every `CHECK_EVERY_S` whether its request can
still be answered (`OpsClient.check_future`). Besides what ends a wait at once (an id never submitted, a
session stopped, expired or lost), two bounds end it with an error that names the request and the reason:

- **No worker for its model**: `NoWorkerError` once no live worker has announced the request's model for
  `no_worker_grace_s` (`TREADLE_NO_WORKER_GRACE_S`, 120 s). While a live worker serves its model, this bound
  never ends the wait: that worker can still run the request (a queued sample; a session's op, which the
  journal holds for the worker that adopts the session). A worker's announcement (`treadle.queue.workers`) outlives it by at most `HEARTBEAT_TTL_S`,
  so a wait whose only worker died ends within `HEARTBEAT_TTL_S + no_worker_grace_s + CHECK_EVERY_S` of the
  death. The grace lets a supervisor restart a lone worker; the request stays queued, so a later wait on the
  same future, once a worker serves the model again, still gets its answer.
- **A sample past its lifetime**: `RequestExpiredError` once a sample or compute_logprobs request has gone
  unanswered for `sample_ttl_s` (`TREADLE_SAMPLE_TTL_S`, a day) after its submit, whatever the workers: its
  wait gives up on it.

When a model was first found unserved is kept per process (`WaitBounds`), so the gateway's separate polls of
one future, and the waits on every future of one model, share one grace.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Callable

from treadle.errors import NoWorkerError, RequestExpiredError, TreadleError
from treadle.queue.outages import REDIS_ERRORS
from treadle.queue.workers import HEARTBEAT_TTL_S, WorkerRegistry
from treadle.settings import WaitSettings

# How often a wait asks whether its request can still be answered (the first time after CHECK_FIRST_S).
CHECK_EVERY_S = 2.0
CHECK_FIRST_S = 0.5
# One look at the worker registry answers every wait of the process for this long (a gateway holds many).
_SERVED_FRESH_S = 1.0
# A model no wait has looked at for this long starts its grace afresh: it may have been served in between.
_FORGET_AFTER_S = 5 * CHECK_EVERY_S


@dataclass(frozen=True)
class PendingRequest:
    """What a wait waits for, as far as its bounds go."""

    future_id: str
    base_model: str | None  # None: not known here, so the no-worker bound does not apply
    submitted_at: float | None = None  # Unix seconds; with ttl_s, the lifetime of a sample request
    ttl_s: float | None = None


def sample_marker(base_model: str, ttl_s: float) -> str:
    """The value of a sample's submitted marker (`names.submitted_key`): its model and lifetime, for its waits."""
    return json.dumps({"base_model": base_model, "submitted_at": time.time(), "ttl_s": ttl_s})


def pending_sample(future_id: str, marker: bytes | str) -> PendingRequest:
    """The sample request `future_id` from its submitted marker (a bare marker carries nothing to bound)."""
    try:
        fields = json.loads(marker)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        return PendingRequest(future_id, None)
    return PendingRequest(future_id, fields.get("base_model"), fields.get("submitted_at"), fields.get("ttl_s"))


class WaitBounds:
    """The two bounds, checked by `past`; one per OpsClient, shared by all its waits."""

    def __init__(self, workers: WorkerRegistry, settings: WaitSettings | None = None):
        self.workers = workers
        self.settings = settings or WaitSettings()
        self._lock = threading.Lock()
        self._served: tuple[float, frozenset[str]] | None = None  # (looked at, model names) of the last look
        self._unserved: dict[str, tuple[float, float]] = {}  # model -> (first found unserved, last looked)

    def past(self, request: PendingRequest, describe: Callable[[], str]) -> TreadleError | None:
        """The error to end a wait on `request` with, if it is past a bound; `describe()` names it (called only then)."""
        if request.submitted_at is not None and request.ttl_s is not None:
            age = time.time() - request.submitted_at
            if age > request.ttl_s:
                return RequestExpiredError(
                    f"{describe()}: expired, unanswered {age:.0f} s after its submit, past its lifetime of "
                    f"{request.ttl_s:g} s (sample_ttl_s, TREADLE_SAMPLE_TTL_S): submit it again"
                )
        if request.base_model is None:
            return None
        unserved_s = self.unserved_for(request.base_model)
        grace = self.settings.no_worker_grace_s
        if unserved_s <= grace:
            return None
        return NoWorkerError(
            f"{describe()}: cannot be answered: no live worker has served {request.base_model!r} for "
            f"{unserved_s:.1f} s (a worker counts as gone {HEARTBEAT_TTL_S} s after its last heartbeat), past the "
            f"grace of {grace:g} s (no_worker_grace_s, TREADLE_NO_WORKER_GRACE_S). The request stays queued: "
            f"start a worker with `treadle worker --model {request.base_model}` and wait on {request.future_id} again"
        )

    def unserved_for(self, model: str) -> float:
        """Seconds since this process found no live worker serving `model`; 0 while one does (or Redis is out of
        reach: the result poll reports outages)."""
        served = self._served_models()
        now = time.monotonic()
        with self._lock:
            if served is None:
                return 0.0
            if model in served:
                self._unserved.pop(model, None)
                return 0.0
            since, looked = self._unserved.get(model, (now, now))
            if now - looked > _FORGET_AFTER_S:
                since = now
            self._unserved[model] = (since, now)
            return now - since

    def _served_models(self) -> frozenset[str] | None:
        now = time.monotonic()
        last = self._served
        if last is not None and now - last[0] < _SERVED_FRESH_S:
            return last[1]
        try:
            served = frozenset(m.name for m in self.workers.served_models())
        except REDIS_ERRORS:
            return None
        self._served = (now, served)
        return served
