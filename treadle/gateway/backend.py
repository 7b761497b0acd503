"""The gateway's one door to treadle: routes reach sessions, ops, samplers and checkpoints only here.

`Backend` holds the three parts a route needs (ownership checks, Tinker's seq rules, gateway-side
futures) and the calls that publish to workers. Everything below the routes raises treadle errors;
the app maps them to HTTP statuses in one handler. `get_backend` is the one FastAPI dependency.
"""

from __future__ import annotations

from fastapi import Request

from treadle.gateway.local_futures import LocalFutures
from treadle.gateway.ownership import Ownership
from treadle.gateway.seq_rules import SeqRules
from treadle.gateway.settings import GatewaySettings
from treadle.gateway.store import GatewayStore, RequestRecord
from treadle.queue.ops import CreateSessionRequest, SampleRequest
from treadle.queue.ops_client import OpsClient
from treadle.queue.sessions import SessionRecord
from treadle.storage.checkpoint_store import CheckpointStore


def model_session_id(model_id: str) -> str:
    """The Tinker client session a model id (`<session>:train:<n>`) belongs to."""
    return model_id.rsplit(":train:", 1)[0]


class Backend:
    def __init__(self, settings: GatewaySettings, ops: OpsClient, checkpoints: CheckpointStore | None):
        self.settings = settings
        self.ops = ops
        self.store = GatewayStore(ops.redis, settings.state_ttl_seconds)
        self.owners = Ownership(ops, self.store, checkpoints)
        self.seqs = SeqRules(ops, self.store, settings.max_seq_ahead)
        self.local = LocalFutures(ops, self.store, self.seqs)

    def close(self) -> None:
        self.local.close()

    def create_model(self, request: CreateSessionRequest) -> None:
        """Create a training model (a treadle session) and wait until a worker has it."""
        self.ops.create_session(request, timeout=self.settings.create_timeout_seconds)

    def session_info(self, session_id: str) -> SessionRecord | None:
        return self.ops.session_info(session_id)

    def model_exists(self, model_id: str) -> bool:
        return self.session_info(model_id) is not None

    def submit_sample(self, owner: str, request: SampleRequest, extra: dict | None = None) -> str:
        fid = self.ops.submit_sample(request.model_copy(update={"owner": owner}))  # metered to the caller
        self.store.put_request(RequestRecord(request_id=fid, kind="sample", owner=owner, future_id=fid, extra=extra or {}))
        return fid

    def wait(self, future_id: str, timeout: float) -> dict:
        return self.ops.wait(future_id, timeout=timeout)


def get_backend(request: Request) -> Backend:
    """FastAPI dependency: the app's Backend."""
    return request.app.state.backend
