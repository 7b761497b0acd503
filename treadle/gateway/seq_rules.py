"""Tinker's seq rules: a training model's ops run in the order of the client's `seq_id`s.

Every op goes into the same journal and session queue the treadle SDK uses, with the Tinker
`seq_id` as treadle's `seq`: the worker runs a session's ops strictly in seq order, so chunks of one
forward_backward that the SDK sends concurrently (first chunk last) are reordered there. A retried
`(model_id, seq_id)` returns the original request id without publishing again; the same pair with a
different body is a conflict. A seq the gateway cannot translate is still published, as a `noop`,
so the session never waits forever for the gap, and its future fails with the reason.
"""

from __future__ import annotations

import hashlib

from treadle.errors import ConflictError, InvalidRequestError, TreadleError
from treadle.gateway.ownership import not_found
from treadle.gateway.store import GatewayStore, RequestRecord
from treadle.queue.ops import NoopRequest, OpRequest, StopRequest
from treadle.queue.ops_client import OpsClient


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


def require_seq(seq_id: int | None) -> int:
    if seq_id is None or seq_id < 1:
        raise InvalidRequestError(f"seq_id: {seq_id!r} is not a valid op sequence number; training requests need seq_id >= 1")
    return seq_id


class SeqRules:
    def __init__(self, ops: OpsClient, store: GatewayStore):
        self.ops = ops
        self.store = store

    def submit(self, owner: str, model_id: str, seq_id: int | None, request: OpRequest, *,
               kind: str, body: bytes, extra: dict | None = None) -> str:
        """Publish one op at the client's seq; a retry of the same seq returns the original request id."""
        seq = require_seq(seq_id)
        record = RequestRecord(
            request_id=f"{model_id}:{seq}", kind=kind, owner=owner, future_id=f"{model_id}:{seq}",
            model_id=model_id, digest=digest(body), extra=extra or {},
        )
        if self.claimed(record):
            return record.request_id
        try:
            self.ops.submit(model_id, request, seq=seq)
        except BaseException:
            self.store.forget_request(record.request_id)  # never published: let the client's retry publish it
            raise
        self.store.note_seq(model_id, seq)
        return record.request_id

    def refuse(self, owner: str, model_id: str, seq_id: int | None, error: TreadleError, *, body: bytes) -> str:
        """A seq the gateway cannot translate: publish a noop in its place and fail its future with the reason."""
        seq = require_seq(seq_id)
        record = RequestRecord(request_id=f"{model_id}:{seq}", kind="refused", owner=owner, model_id=model_id, digest=digest(body))
        if self.claimed(record):
            return record.request_id
        self.store.set_outcome(record.request_id, error=error.to_dict())
        self.ops.submit(model_id, NoopRequest(), seq=seq)
        self.store.note_seq(model_id, seq)
        return record.request_id

    def stop_model(self, model_id: str) -> None:
        """Stop a training model after the last op its client published (the client numbers the seqs)."""
        self.ops.submit(model_id, StopRequest(), seq=self.store.max_seq(model_id) + 1)

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
