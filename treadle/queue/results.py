"""Op results in the Celery result backend, keyed by future id (`<session_id>:<seq>`).

The worker stores results itself (tasks run with ignore_result) because an op may run under a
different message than its own: an early arrival is parked in the journal and run later, when its
predecessor arrives. Errors are stored as Celery FAILURE with a `treadle.errors` class, so the
client re-raises the same typed error. Any process that knows the id can read the result.
"""

from __future__ import annotations

from celery import Celery, states

from treadle.errors import ServerError, TreadleError


class ResultStore:
    def __init__(self, app: Celery):
        self.backend = app.backend

    def store_ok(self, future_id: str, value: dict) -> None:
        self.backend.store_result(future_id, value, states.SUCCESS)

    def store_error(self, future_id: str, error: TreadleError) -> None:
        self.backend.store_result(future_id, error, states.FAILURE)

    def poll(self, future_id: str) -> tuple[bool, dict | None]:
        """(done, value). Raises the stored TreadleError if the op failed."""
        meta = self.backend.get_task_meta(future_id)
        status = meta.get("status")
        if status == states.SUCCESS:
            return True, meta.get("result")
        if status == states.FAILURE:
            error = meta.get("result")
            if isinstance(error, TreadleError):
                raise error
            raise ServerError(f"operation {future_id} failed: {error!r}")
        return False, None

    def is_done(self, future_id: str) -> bool:
        return self.backend.get_task_meta(future_id).get("status") in (states.SUCCESS, states.FAILURE)
