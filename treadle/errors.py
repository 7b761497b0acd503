"""Every error treadle raises on purpose.

Each error has a category: `user` (the request was wrong; fix the input, the session is fine) or
`server` (treadle or its infrastructure failed). Errors cross process boundaries as plain JSON
(`to_dict` / `from_dict`), so a worker's error is re-raised in the client as the same class.
Messages name the field, the value and the limit.
"""

from __future__ import annotations

from typing import Literal

Category = Literal["user", "server"]


class TreadleError(Exception):
    category: Category = "server"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        return {"type": type(self).__name__, "category": self.category, "message": self.message}

    @staticmethod
    def from_dict(data: dict) -> "TreadleError":
        cls = _REGISTRY.get(data.get("type", ""), None)
        if cls is None:
            cls = UserError if data.get("category") == "user" else ServerError
        if cls is CapacityError:
            return CapacityError(
                data.get("message", "unknown error"), float(data.get("retry_after_s", 1.0)), data.get("bound", "")
            )
        return cls(data.get("message", "unknown error"))


class UserError(TreadleError):
    """The request was invalid. The session and the worker are unaffected."""

    category: Category = "user"


class ServerError(TreadleError):
    category: Category = "server"


class InvalidRequestError(UserError):
    """A field of a request is out of its limits (names the field, the value and the limit)."""


class SampleCancelledError(UserError):
    """A streamed sample's client went away; its rows left the sampler's batch unfinished. `sampled_tokens`, on the
    worker only: the tokens its rows drew before they left, metered with its prompt (None: it left the queue before
    its prefill, and costs nothing)."""

    def __init__(self, message: str, sampled_tokens: int | None = None):
        super().__init__(message)
        self.sampled_tokens = sampled_tokens


class UnknownModelError(UserError):
    """No worker serves the requested base model."""


class CheckpointNotFoundError(UserError):
    pass


class CheckpointExistsError(UserError):
    """A checkpoint of that name exists and overwrite=False."""


class InvalidCheckpointNameError(UserError):
    pass


class SessionNotFoundError(UserError):
    pass


class NotFoundError(UserError):
    """Not there, or not the caller's: the gateway answers both alike (404), so ids cannot be probed."""


class ConflictError(UserError):
    """The request reuses an id (a Tinker seq_id) that an earlier, different request took (409)."""


class QuotaExceededError(UserError):
    """The owner already runs as many training sessions as its quota allows (the create's future fails with it; a
    429 would make the official SDK retry for minutes)."""


class CapacityError(UserError):
    """A queue is at its bound (a session's or an owner's queued ops, an owner's queued sample rows): nothing was
    queued; submit again after `retry_after_s` (the gateway answers 429 with Retry-After, which Tinker's SDK retries;
    the treadle SDK waits likewise, see `treadle.sdk.capacity`). `bound` is the workers' flag that sets the limit."""

    def __init__(self, message: str, retry_after_s: float = 1.0, bound: str = ""):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.bound = bound

    def to_dict(self) -> dict:
        return {**super().to_dict(), "retry_after_s": self.retry_after_s, "bound": self.bound}


class InsufficientMemoryError(UserError):
    """A full fine-tuning session does not fit the worker's memory: the message gives the bytes it needs and the
    bytes free. Nothing was created, and no other session was touched."""


class SessionStoppedError(SessionNotFoundError):
    """The session was stopped (or a stop is queued): nothing can run on it after the stop."""


class SessionExpiredError(UserError):
    """The session sat idle past the workers' TTL: it was checkpointed and stopped; the message names the path."""


class IntegrityError(ServerError):
    """A stored file does not match the sha256 recorded in its manifest."""


class StorageError(ServerError):
    """The checkpoint store cannot be reached or refused the credentials."""


class BrokerUnavailableError(ServerError):
    """Redis (broker / result backend) cannot be reached."""


class NoWorkerError(ServerError):
    """No live worker serves the model, so nothing would run the request."""


class SessionLostError(ServerError):
    """The session cannot be recovered (no checkpoint and no journal to rebuild it from)."""


class FutureTimeoutError(ServerError, TimeoutError):
    """`.result(timeout=...)` ran out before the operation finished."""


class RequestExpiredError(ServerError):
    """A request went unanswered past its lifetime (`sample_ttl_s`): its wait ends, as nothing will answer it."""


class CrashingRequestError(ServerError):
    """Every worker that ran the request died running it (`max_request_crashes` of them): it is answered with this
    instead of being run again, so that one request cannot take down each worker of its model in turn."""

    @classmethod
    def after(cls, op: str, request_id: str, crashes: int, limit: int) -> "CrashingRequestError":
        """The answer to request `request_id` (its future id) whose workers died running it `crashes` times."""
        return cls(
            f"{op} request {request_id} was not run again: {crashes} workers died while running it "
            f"(max_request_crashes={limit}, the workers' --max_request_crashes); it likely crashes any worker (out of "
            "memory, a kernel fault): change the request, or raise the limit once the cause is fixed"
        )


_REGISTRY: dict[str, type[TreadleError]] = {
    cls.__name__: cls
    for cls in [
        TreadleError,
        UserError,
        ServerError,
        InvalidRequestError,
        SampleCancelledError,
        UnknownModelError,
        CheckpointNotFoundError,
        CheckpointExistsError,
        InvalidCheckpointNameError,
        SessionNotFoundError,
        SessionStoppedError,
        NotFoundError,
        ConflictError,
        QuotaExceededError,
        CapacityError,
        InsufficientMemoryError,
        SessionExpiredError,
        IntegrityError,
        StorageError,
        BrokerUnavailableError,
        NoWorkerError,
        SessionLostError,
        FutureTimeoutError,
        RequestExpiredError,
        CrashingRequestError,
    ]
}
