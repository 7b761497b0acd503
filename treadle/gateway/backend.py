"""The gateway's one door to treadle: routes reach sessions, ops, samplers and checkpoints only here.

`Backend` holds the three parts a route needs (ownership checks, Tinker's seq rules, gateway-side
futures) and the calls that publish to workers. Everything below the routes raises treadle errors;
the app maps them to HTTP statuses in one handler. `get_backend` is its FastAPI dependency; routes
take it with the caller's owner as one `Call` (caller.py).
"""

from __future__ import annotations

from fastapi import Request

from treadle.gateway.local_futures import LocalFutures
from treadle.gateway.ownership import Ownership
from treadle.gateway.seq_rules import SeqRules
from treadle.gateway.settings import GatewaySettings
from treadle.gateway.store import GatewayStore, RequestRecord
from treadle.gateway.tokens import make_token, read_token
from treadle.metering import Meter
from treadle.queue.ops import CreateSessionRequest, SampleRequest
from treadle.queue import sample_stream
from treadle.queue.ops_client import OpsClient
from treadle.queue.sample_stream import StreamCancelled, StreamedTokens
from treadle.queue.sessions import SessionRecord
from treadle.storage.checkpoint_store import CheckpointStore


class Backend:
    def __init__(self, settings: GatewaySettings, ops: OpsClient, checkpoints: CheckpointStore | None):
        self.settings = settings
        self._ops = ops  # private: routes call the methods below, so this class stays the one door
        self.store = GatewayStore(ops.redis, settings.state_ttl_seconds)
        self.owners = Ownership(ops, self.store, checkpoints)
        self.seqs = SeqRules(ops, self.store, settings.max_seq_ahead)
        self.local = LocalFutures(ops, self.store, self.seqs)

    def close(self) -> None:
        self.local.close()

    def create_model(self, request: CreateSessionRequest) -> None:
        """Create a training model (a treadle session) and wait until a worker has it."""
        self._ops.create_session(request, timeout=self.settings.create_timeout_seconds)

    def session_info(self, session_id: str) -> SessionRecord | None:
        return self._ops.session_info(session_id)

    def model_exists(self, model_id: str) -> bool:
        return self.session_info(model_id) is not None

    def submit_sample(self, owner: str, request: SampleRequest, extra: dict | None = None) -> str:
        fid = self._ops.submit_sample(request.model_copy(update={"owner": owner}))  # metered to the caller
        self.store.put_request(
            RequestRecord(request_id=fid, kind="sample", owner=owner, future_id=fid, extra=extra or {})
        )
        return fid

    def wait(self, future_id: str, timeout: float) -> dict:
        return self._ops.wait(future_id, timeout=timeout)

    def poll_sample(self, future_id: str) -> tuple[bool, dict | None]:
        """(answered, the answer) without waiting; raises the sample's error."""
        return self._ops.results.poll(future_id)

    def read_sample_stream(
        self, stream_id: str, after: str, block_ms: int
    ) -> tuple[str, list[StreamedTokens | StreamCancelled]]:
        """A streamed sample's entries after id `after` (treadle.queue.sample_stream), waiting up to `block_ms`."""
        return sample_stream.read(self._ops.redis, stream_id, after, block_ms)

    def forget_sample_stream(self, stream_id: str) -> None:
        """Drop a streamed sample's entries once its answer is sent (they would expire anyway)."""
        sample_stream.forget(self._ops.redis, stream_id)

    def cancel_sample(self, stream_id: str) -> None:
        """Ask the worker of a streamed sample to drop its rows."""
        sample_stream.cancel(self._ops.redis, stream_id)

    def check_future(self, future_id: str) -> None:
        """Raise if a pending future can never resolve (its session gone, no worker for its model)."""
        self._ops.check_future(future_id)

    def next_seq(self, model_id: str) -> int:
        return self._ops.next_seq(model_id)

    def journal_entry(self, model_id: str, seq: int):
        """The journaled op `seq` of a model (None once trimmed)."""
        return self._ops.journal.get(model_id, seq)

    def meter(self) -> Meter:
        return Meter(self._ops.redis)

    def download_token(self, key: str, expires_at: float) -> str:
        return make_token(self._ops.redis, key, expires_at)

    def download_key(self, token: str) -> str:
        return read_token(self._ops.redis, token)

    def metrics_redis(self):
        """The Redis the /metrics scrape reads queue depths and workers from."""
        return self._ops.redis


def get_backend(request: Request) -> Backend:
    """FastAPI dependency: the app's Backend."""
    return request.app.state.backend
