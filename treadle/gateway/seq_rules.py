"""Tinker's seq rules: a training model's ops run in the order of the client's `seq_id`s.

Every op goes into the same journal and session queue the treadle SDK uses, with the Tinker
`seq_id` as treadle's `seq`: the worker runs a session's ops strictly in seq order, so chunks of one
forward_backward that the SDK sends concurrently (first chunk last) are reordered there. A retried
`(model_id, seq_id)` returns the original request id without publishing again; the same pair with a
different body is a conflict. A seq the gateway cannot translate is still published, as a `noop`,
so the session never waits forever for the gap, and its future fails with the reason. A seq_id more
than `max_seq_ahead` past the model's last applied op is refused and takes nothing (it would open a
gap no client fills). The gateway's own stop (a finished client session) takes the seq after every
seq taken so far, never one a client names, and no seq at or after it is accepted.
"""

from __future__ import annotations

import hashlib

from treadle.errors import (
    ConflictError,
    InvalidRequestError,
    SessionExpiredError,
    SessionLostError,
    SessionNotFoundError,
    TreadleError,
)
from treadle.gateway.ownership import not_found
from treadle.gateway.store import GatewayStore, RequestRecord
from treadle.queue import names
from treadle.queue.ops import NoopRequest, OpRequest, StopRequest
from treadle.queue.ops_client import OpsClient


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


def require_seq(seq_id: int | None) -> int:
    if seq_id is None or seq_id < 1:
        raise InvalidRequestError(
            f"seq_id: {seq_id!r} is not a valid op sequence number; training requests need seq_id >= 1"
        )
    return seq_id


class SeqRules:
    def __init__(self, ops: OpsClient, store: GatewayStore, max_seq_ahead: int):
        self.ops = ops
        self.store = store
        self.max_seq_ahead = max_seq_ahead

    def check_window(self, model_id: str, seq: int) -> None:
        """Refuse a seq so far ahead that it waits for a gap no client is about to fill."""
        info = self.ops.session_info(model_id)
        applied = info.applied if info is not None else 0
        if seq > applied + self.max_seq_ahead:
            raise InvalidRequestError(
                f"seq_id: {seq} is more than max_seq_ahead = {self.max_seq_ahead} past model {model_id}'s last "
                f"applied op ({applied}); number a model's ops 1, 2, 3, ..."
            )

    def submit(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        request: OpRequest,
        *,
        kind: str,
        body: bytes,
        extra: dict | None = None,
    ) -> str:
        """Publish one op at the client's seq; a retry of the same seq returns the original request id."""
        seq = require_seq(seq_id)
        self.check_window(model_id, seq)
        record = RequestRecord(
            request_id=names.future_id(model_id, seq),
            kind=kind,
            owner=owner,
            future_id=names.future_id(model_id, seq),
            model_id=model_id,
            digest=digest(body),
            extra=extra or {},
        )
        if self.claimed(record):
            return record.request_id
        try:
            self.ops.submit(model_id, request, seq=seq)
        except BaseException:
            self.store.forget_request(record.request_id)  # never published: let the client's retry publish it
            raise
        return record.request_id

    def refuse(self, owner: str, model_id: str, seq_id: int | None, error: TreadleError, *, body: bytes) -> str:
        """A seq the gateway cannot translate: publish a noop in its place and fail its future with the reason."""
        seq = require_seq(seq_id)
        self.check_window(model_id, seq)
        record = RequestRecord(
            request_id=names.future_id(model_id, seq),
            kind="refused",
            owner=owner,
            model_id=model_id,
            digest=digest(body),
        )
        if self.claimed(record):
            return record.request_id
        self.store.set_outcome(record.request_id, error=error.to_dict())
        try:
            self.ops.submit(model_id, NoopRequest(), seq=seq)
        except BaseException:
            self.store.forget_request(
                record.request_id
            )  # never published (a queue at its bound): the retry publishes it
            raise
        return record.request_id

    def stop_model(self, model_id: str) -> None:
        """Stop a training model after every op published so far; a model already stopped (or gone) stays so."""
        try:
            self.ops.submit(model_id, StopRequest())
        except (SessionNotFoundError, SessionExpiredError, SessionLostError):
            pass

    def claimed(self, record: RequestRecord) -> bool:
        """True if this request id was already taken with the same body; a conflict if with another."""
        existing = self.store.claim_request(record)
        if existing is None:
            return False
        if existing.owner != record.owner:
            raise not_found("model", record.model_id or "")
        if existing.digest != record.digest:
            raise ConflictError(
                f"seq_id: {record.request_id.rsplit(':', 1)[1]} of model {record.model_id} was already used by a different request"
            )
        return True
