"""The gateway's one door to treadle: ownership checks, op submission with Tinker's seq rules, local futures.

Every op goes into the same Celery session queue the treadle SDK uses (`OpsClient.submit`), with the
Tinker `seq_id` as treadle's `seq`: the worker runs a session's ops strictly in seq order, so chunks
of one forward_backward that the SDK sends concurrently (first chunk last) are reordered there. A
retried `(model_id, seq_id)` returns the original request id without publishing again; the same pair
with a different body is a conflict. A seq the gateway cannot translate is still published as a
`noop`, so the session never waits forever for the gap, and its future fails with the reason.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import HTTPException

from treadle.errors import InvalidRequestError, ServerError, TreadleError, UnknownModelError
from treadle.gateway.auth import not_found
from treadle.gateway.paths import parse_path
from treadle.gateway.settings import GatewaySettings
from treadle.gateway.store import ClientSession, GatewayStore, RequestRecord, Sampler
from treadle.queue.ops_client import OpsClient, SessionInfo
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.manifest import Manifest
from treadle.storage.paths import CheckpointPath

log = logging.getLogger(__name__)


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


def model_session_id(model_id: str) -> str:
    """The Tinker client session a model id (`<session>:train:<n>`) belongs to."""
    return model_id.rsplit(":train:", 1)[0]


class Backend:
    def __init__(self, settings: GatewaySettings, ops: OpsClient, checkpoints: CheckpointStore | None):
        self.settings = settings
        self.ops = ops
        self.checkpoints = checkpoints
        self.store = GatewayStore(ops.redis, settings.state_ttl_seconds)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gateway-local")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ ownership (404 for anything not yours)
    def new_client_session(self, owner: str, tags: list[str], user_metadata: dict | None) -> ClientSession:
        session = ClientSession(session_id=f"s-{secrets.token_hex(8)}", owner=owner, tags=tags, user_metadata=user_metadata)
        self.store.put_session(session)
        return session

    def client_session(self, session_id: str, owner: str) -> ClientSession:
        session = self.store.get_session(session_id)
        if session is None or session.owner != owner:
            raise not_found("session", session_id)
        return session

    def model(self, model_id: str, owner: str) -> SessionInfo:
        info = self.ops.session_info(model_id)
        if info is None or info.owner != owner:
            raise not_found("model", model_id)
        return info

    def sampler(self, sampler_id: str, owner: str) -> Sampler:
        sampler = self.store.get_sampler(sampler_id)
        if sampler is None or sampler.owner != owner:
            raise not_found("sampler", sampler_id)
        return sampler

    def run(self, run_id: str, owner: str) -> dict:
        run = self.checkpoint_store().get_run(run_id)
        if run is None or run.get("owner") != owner:
            raise not_found("training run", run_id)
        return run

    def checkpoint(self, path: str, owner: str) -> tuple[CheckpointPath, Manifest]:
        """An existing checkpoint of one of the owner's runs; 404 otherwise (another owner's looks absent)."""
        parsed = parse_path(path)
        self.run(parsed.run_id, owner)
        try:
            return parsed, self.checkpoint_store().manifest(parsed)
        except TreadleError as exc:
            if exc.category == "user":
                raise not_found("checkpoint", path) from None
            raise

    def checkpoint_store(self) -> CheckpointStore:
        if self.checkpoints is None:
            raise HTTPException(status_code=400, detail="storage_url: this gateway has none, so it cannot list or read checkpoints")
        return self.checkpoints

    def served_model(self, base_model: str):
        for served in self.ops.served_models():
            if served.name == base_model:
                return served
        raise UnknownModelError(
            f"base_model: {base_model!r} is not served; served models: {', '.join(m.name for m in self.ops.served_models()) or 'none'}"
        )

    def tokenizer_source(self, base_model: str) -> str:
        """Where the base model's tokenizer loads from: the served model's directory or HF id (names may be aliases)."""
        for served in self.ops.served_models():
            if served.name == base_model:
                return served.path
        return base_model

    # ------------------------------------------------------------ ops of a training model
    def submit_op(
        self, owner: str, model_id: str, seq_id: int | None, op: str, payload: dict, *,
        kind: str, body: bytes, extra: dict | None = None,
    ) -> str:
        """Publish one op at the client's seq; a retry of the same seq returns the original request id."""
        seq = _require_seq(seq_id)
        record = RequestRecord(
            request_id=f"{model_id}:{seq}", kind=kind, owner=owner, future_id=f"{model_id}:{seq}",
            model_id=model_id, digest=digest(body), extra=extra or {},
        )
        if self._claimed(record):
            return record.request_id
        try:
            self.ops.submit(model_id, op, payload, seq=seq)
        except BaseException:
            self.store.forget_request(record.request_id)  # never published: let the client's retry publish it
            raise
        self.store.note_seq(model_id, seq)
        return record.request_id

    def refuse_op(self, owner: str, model_id: str, seq_id: int | None, error: TreadleError, *, body: bytes) -> str:
        """A seq the gateway cannot translate: publish a noop in its place and fail its future with the reason."""
        seq = _require_seq(seq_id)
        record = RequestRecord(request_id=f"{model_id}:{seq}", kind="refused", owner=owner, model_id=model_id, digest=digest(body))
        if self._claimed(record):
            return record.request_id
        self.store.set_outcome(record.request_id, error=error.to_dict())
        self.ops.submit(model_id, "noop", {}, seq=seq)
        self.store.note_seq(model_id, seq)
        return record.request_id

    def stop_model(self, model_id: str) -> None:
        """Stop a training model after the last op its client published (the client numbers the seqs)."""
        self.ops.submit(model_id, "stop", {}, seq=self.store.max_seq(model_id) + 1)

    def _claimed(self, record: RequestRecord) -> bool:
        """True if this (model_id, seq_id) was already submitted with the same body; 409 if with another."""
        existing = self.store.claim_request(record)
        if existing is None:
            return False
        if existing.owner != record.owner:
            raise not_found("model", record.model_id or "")
        if existing.digest != record.digest:
            raise HTTPException(
                status_code=409,
                detail=f"seq_id: {record.request_id.rsplit(':', 1)[1]} of model {record.model_id} was already used by a different request",
            )
        return True

    # ------------------------------------------------------------ sampling
    def submit_sample(self, owner: str, base_model: str, payload: dict, extra: dict | None = None) -> str:
        fid = self.ops.submit_sample(base_model, payload)
        self.store.put_request(RequestRecord(request_id=fid, kind="sample", owner=owner, future_id=fid, extra=extra or {}))
        return fid

    # ------------------------------------------------------------ futures the gateway runs itself
    def run_local(self, owner: str, kind: str, request_id: str, fn: Callable[[], dict], *, body: bytes) -> str:
        """Run `fn` (a blocking call such as session creation) in a thread; retrieve_future reads its outcome."""
        record = RequestRecord(request_id=request_id, kind=kind, owner=owner, digest=digest(body))
        if self._claimed(record):
            return request_id
        self._pool.submit(self._settle, request_id, fn)
        return request_id

    def fail_local(self, owner: str, kind: str, error: TreadleError) -> str:
        request_id = f"failed:{secrets.token_hex(8)}"
        self.store.put_request(RequestRecord(request_id=request_id, kind=kind, owner=owner))
        self.store.set_outcome(request_id, error=error.to_dict())
        return request_id

    def _settle(self, request_id: str, fn: Callable[[], dict]) -> None:
        try:
            self.store.set_outcome(request_id, result=fn())
        except TreadleError as exc:
            self.store.set_outcome(request_id, error=exc.to_dict())
        except Exception as exc:  # a bug must still answer the client rather than leave it polling
            log.exception("gateway-side request %s failed", request_id)
            self.store.set_outcome(request_id, error=ServerError(f"{type(exc).__name__}: {exc}").to_dict())

    def poll(self, record: RequestRecord) -> Any:
        """The raw result of a request, None while pending; raises the TreadleError it failed with."""
        if record.future_id is not None:
            return self.ops.poll(record.future_id)
        outcome = self.store.get_outcome(record.request_id)
        if outcome is None:
            return None
        if "error" in outcome:
            raise TreadleError.from_dict(outcome["error"])
        return outcome["result"]


def _require_seq(seq_id: int | None) -> int:
    if seq_id is None or seq_id < 1:
        raise InvalidRequestError(f"seq_id: {seq_id!r} is not a valid op sequence number; training requests need seq_id >= 1")
    return seq_id
