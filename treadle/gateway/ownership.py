"""Ownership checks: every id a request names must be the caller's, or it does not exist (404).

Someone else's session, model, sampler, run or checkpoint raises the same NotFoundError as a missing
one, so ids cannot be probed. These checks are the only way the routes reach treadle's records.
"""

from __future__ import annotations

import secrets
from typing import Protocol, TypeVar

from treadle.errors import InvalidRequestError, NotFoundError, TreadleError, UnknownModelError
from treadle.gateway.paths import parse_path
from treadle.gateway.store import ClientSession, GatewayStore, Sampler
from treadle.queue import names
from treadle.queue.ops_client import OpsClient
from treadle.queue.sessions import SessionRecord
from treadle.queue.workers import ServedModel
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.manifest import Manifest
from treadle.storage.paths import CheckpointPath


def not_found(kind: str, ident: str) -> NotFoundError:
    return NotFoundError(f"{kind} {ident!r} not found")


class _Owned(Protocol):
    @property
    def owner(self) -> str | None: ...


OwnedT = TypeVar("OwnedT", bound=_Owned)


def _mine(record: OwnedT | None, owner: str, kind: str, ident: str) -> OwnedT:
    if record is None or record.owner != owner:
        raise not_found(kind, ident)
    return record


class Ownership:
    def __init__(self, ops: OpsClient, store: GatewayStore, checkpoints: CheckpointStore | None):
        self.ops = ops
        self.store = store
        self._checkpoints = checkpoints

    def new_client_session(
        self, owner: str, tags: list[str], user_metadata: dict | None, display_name: str | None = None
    ) -> ClientSession:
        session = ClientSession(
            session_id=names.client_session_id(secrets.token_hex(8)),
            owner=owner,
            tags=tags,
            user_metadata=user_metadata,
            display_name=display_name,
        )
        self.store.put_session(session)
        return session

    def client_session(self, session_id: str, owner: str) -> ClientSession:
        return _mine(self.store.get_session(session_id), owner, "session", session_id)

    def model(self, model_id: str, owner: str) -> SessionRecord:
        return _mine(self.ops.session_info(model_id), owner, "model", model_id)

    def sampler(self, sampler_id: str, owner: str) -> Sampler:
        return _mine(self.store.get_sampler(sampler_id), owner, "sampler", sampler_id)

    def run(self, run_id: str, owner: str) -> dict:
        run = self.checkpoints().get_run(run_id)
        if run is None or run.get("owner") != owner:
            raise not_found("training run", run_id)
        return run

    def checkpoint(self, path: str, owner: str) -> tuple[CheckpointPath, Manifest]:
        """An existing checkpoint of one of the owner's runs; 404 otherwise (another owner's looks absent)."""
        parsed = parse_path(path)
        self.run(parsed.run_id, owner)
        try:
            return parsed, self.checkpoints().manifest(parsed)
        except TreadleError as exc:
            if exc.category == "user":
                raise not_found("checkpoint", path) from None
            raise

    def readable_checkpoint(self, path: str, owner: str) -> tuple[CheckpointPath, Manifest]:
        """One of the owner's checkpoints, or anyone's published one; 404 otherwise. Writes use `checkpoint`."""
        parsed = parse_path(path)
        try:
            manifest = self.checkpoints().manifest(parsed)
        except TreadleError as exc:
            if exc.category == "user":
                raise not_found("checkpoint", path) from None
            raise
        if manifest.public:
            return parsed, manifest
        return self.checkpoint(path, owner)

    def checkpoints(self) -> CheckpointStore:
        if self._checkpoints is None:
            raise InvalidRequestError("storage_url: this gateway has none, so it cannot list or read checkpoints")
        return self._checkpoints

    def served_models(self) -> list[ServedModel]:
        return self.ops.served_models()

    def served_model(self, base_model: str) -> ServedModel:
        served = self.ops.served_models()
        for model in served:
            if model.name == base_model:
                return model
        raise UnknownModelError(
            f"base_model: {base_model!r} is not served; served models: {', '.join(m.name for m in served) or 'none'}"
        )

    def tokenizer_source(self, base_model: str) -> str:
        """Where the base model's tokenizer loads from: the served model's directory or HF id (names may be aliases)."""
        for served in self.ops.served_models():
            if served.name == base_model:
                return served.path
        return base_model

    def sampling_target(self, owner: str, base_model: str | None, model_path: str | None) -> tuple[str, str | None]:
        """(base model, treadle sampler path) of a sampling target: a checkpoint of the owner's, or a served base model."""
        if model_path is not None:
            path, manifest = self.readable_checkpoint(model_path, owner)
            return manifest.base_model, path.uri()
        if base_model is None:
            raise InvalidRequestError("base_model: give base_model or model_path to sample from")
        self.served_model(base_model)
        return base_model, None
