"""The gateway's FastAPI application: Tinker's HTTP API under /api/v1, OpenAI's under /v1."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from treadle.errors import (
    BrokerUnavailableError,
    CheckpointNotFoundError,
    ConflictError,
    NoWorkerError,
    NotFoundError,
    SessionNotFoundError,
    TreadleError,
)
from treadle.gateway import (
    downloads,
    futures,
    metrics,
    openai_api,
    routes_billing,
    routes_checkpoints,
    routes_rest,
    routes_sampling,
    routes_session,
    routes_sessions,
    routes_training,
)
from treadle.gateway.auth import KeyRing
from treadle.gateway.backend import Backend
from treadle.gateway.settings import GatewaySettings
from treadle.queue.ops_client import OpsClient
from treadle.storage.checkpoint_store import CheckpointStore

_NOT_FOUND = (CheckpointNotFoundError, SessionNotFoundError, NotFoundError)
# Worth the SDK's retry loop: a worker or Redis may come back within its five minutes of retries.
_UNAVAILABLE = (BrokerUnavailableError, NoWorkerError)


def create_app(settings: GatewaySettings | None = None, *, ops: OpsClient | None = None,
               checkpoints: CheckpointStore | None = None) -> FastAPI:
    """Build the app. `ops` and `checkpoints` default to clients of the settings' Redis and store."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ops_client = ops or OpsClient(settings.broker_url, settings.result_url, settings.storage_url)
        store = checkpoints
        if store is None and settings.storage_url:
            store = CheckpointStore.from_url(settings.storage_url)
        app.state.backend = Backend(settings, ops_client, store)
        try:
            yield
        finally:
            app.state.backend.close()

    app = FastAPI(title="treadle gateway", lifespan=lifespan)
    app.state.keyring = KeyRing(settings.api_keys)
    for module in (routes_session, routes_training, routes_sampling, routes_rest, routes_billing, routes_checkpoints, routes_sessions,
                   downloads, futures):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(openai_api.router, prefix="/v1")
    metrics.install(app, lambda: app.state.backend.ops.redis)  # GET /metrics, read at scrape time, after lifespan start

    @app.exception_handler(TreadleError)
    async def treadle_error(request: Request, exc: TreadleError) -> JSONResponse:
        if isinstance(exc, _NOT_FOUND):
            status = 404
        elif isinstance(exc, ConflictError):
            status = 409
        elif exc.category == "user":
            status = 400
        else:
            status = 503 if isinstance(exc, _UNAVAILABLE) else 500
        return JSONResponse({"error": exc.message, "category": exc.category, "detail": exc.message}, status_code=status)

    return app
