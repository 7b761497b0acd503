"""Futures the gateway settles itself: blocking work (session creation) and requests refused up front.

Tinker's SDK gets a request id for everything and polls `retrieve_future`; when the work is the
gateway's own (creating a model waits for a worker), it runs on a small thread pool and its outcome
is kept in the gateway store, where `retrieve_future` reads it like any worker's result.
"""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from treadle.errors import ServerError, TreadleError
from treadle.gateway.seq_rules import SeqRules, digest
from treadle.gateway.store import GatewayStore, RequestRecord
from treadle.queue import names
from treadle.queue.ops_client import OpsClient

log = logging.getLogger(__name__)


class LocalFutures:
    def __init__(self, ops: OpsClient, store: GatewayStore, seqs: SeqRules):
        self.ops = ops
        self.store = store
        self._seqs = seqs
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gateway-local")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, owner: str, kind: str, model_id: str, fn: Callable[[], dict], *, body: bytes) -> str:
        """Run `fn`, the `kind` request of model `model_id`, in a thread; retrieve_future reads its outcome under
        the id this returns. A retry with the same body is the same request."""
        request_id = names.gateway_request_id(kind, model_id)
        record = RequestRecord(request_id=request_id, kind=kind, owner=owner, digest=digest(body))
        if self._seqs.claimed(record):
            return request_id
        self._pool.submit(self._settle, request_id, fn)
        return request_id

    def fail(self, owner: str, kind: str, error: TreadleError) -> str:
        request_id = names.gateway_request_id("failed", secrets.token_hex(8))
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
