"""The gateway's FastAPI application: Tinker's HTTP API under /api/v1, OpenAI's under /v1."""

from __future__ import annotations

import json
import logging
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from treadle.errors import (
    BrokerUnavailableError,
    CapacityError,
    CheckpointNotFoundError,
    ConflictError,
    InvalidRequestError,
    NoWorkerError,
    NotFoundError,
    ServerError,
    SessionExpiredError,
    SessionLostError,
    SessionNotFoundError,
    SessionStoppedError,
    TreadleError,
)
from treadle.gateway import (
    downloads,
    futures,
    metrics,
    openai_api,
    routes_billing,
    routes_checkpoints,
    routes_lifecycle,
    routes_rest,
    routes_sampling,
    routes_session_reports,
    routes_training,
)
from treadle.gateway.auth import KeyRing
from treadle.gateway.backend import Backend
from treadle.gateway.bodies import BodyLimits, error_payload
from treadle.gateway.settings import LOSS_ALIAS_METADATA_KEY, GatewaySettings
from treadle.queue.ops_client import OpsClient
from treadle.storage.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)

# Gone for good (410): the SDK's retry loop must not retry an op on a session that takes no more ops
# (a lost session is a server failure, but no retry brings it back).
_GONE = (SessionStoppedError, SessionExpiredError, SessionLostError)
_NOT_FOUND = (CheckpointNotFoundError, SessionNotFoundError, NotFoundError)
# Worth the SDK's retry loop: a worker or Redis may come back within its five minutes of retries.
_UNAVAILABLE = (BrokerUnavailableError, NoWorkerError)


def create_app(
    settings: GatewaySettings | None = None, *, ops: OpsClient | None = None, checkpoints: CheckpointStore | None = None
) -> FastAPI:
    """Build the app. `ops` and `checkpoints` default to clients of the settings' Redis and store."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ops_client = ops or OpsClient(settings.broker_url, settings.result_url, settings.storage_url)
        store = checkpoints
        if store is None and settings.storage_url:
            store = CheckpointStore.from_url(settings.storage_url)
        app.state.backend = Backend(settings, ops_client, store)
        for name, target in settings.loss_aliases.items():
            log.warning(
                "loss_alias: forward_backward requests for %s train with %s (recorded in each new run's "
                "user_metadata as %s)",
                name,
                target,
                LOSS_ALIAS_METADATA_KEY,
            )
        try:
            yield
        finally:
            app.state.backend.close()

    app = FastAPI(title="treadle gateway", lifespan=lifespan)
    app.state.keyring = KeyRing(settings.api_keys)
    for module in (
        routes_lifecycle,
        routes_training,
        routes_sampling,
        routes_rest,
        routes_billing,
        routes_checkpoints,
        routes_session_reports,
        downloads,
        futures,
    ):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(openai_api.router, prefix="/v1")
    metrics.install(
        app, lambda: app.state.backend.metrics_redis()
    )  # GET /metrics, read at scrape time, after lifespan start

    app.add_middleware(
        BodyLimits, max_body_bytes=settings.max_body_bytes, max_decompressed_bytes=settings.max_decompressed_bytes
    )
    # Every route's errors leave through these handlers, all in one JSON form: {"error", "category", "detail"}.
    app.add_exception_handler(TreadleError, _treadle_error)
    app.add_exception_handler(json.JSONDecodeError, _unparsable)
    app.add_exception_handler(UnicodeDecodeError, _unparsable)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _bug)
    return app


def error_response(request: Request, exc: TreadleError, status: int) -> JSONResponse:
    return JSONResponse(error_payload(request.url.path, exc.message, exc.category), status_code=status)


def status_of(exc: TreadleError) -> int:
    if isinstance(exc, CapacityError):
        return 429
    if isinstance(exc, _GONE):
        return 410
    if isinstance(exc, _NOT_FOUND):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if exc.category == "user":
        return 400
    return 503 if isinstance(exc, _UNAVAILABLE) else 500


async def _treadle_error(request: Request, exc: TreadleError) -> JSONResponse:
    response = error_response(request, exc, status_of(exc))
    if isinstance(exc, CapacityError):  # a queue at its bound: Tinker's SDK retries a 429 after Retry-After
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        response.headers["Retry-After-Ms"] = str(max(1, round(exc.retry_after_s * 1000)))  # the SDK reads it first
    return response


async def _unparsable(request: Request, exc: ValueError) -> JSONResponse:
    """`await request.json()` on a body that is not JSON (or not UTF-8): the client's mistake."""
    return error_response(request, InvalidRequestError(f"body: not valid JSON ({exc})"), 400)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ())) or "request"
    return error_response(request, InvalidRequestError(f"{loc}: {first.get('msg', 'invalid')}"), 400)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """401s from auth, 404/405 for unknown routes: the same form as every other error."""
    error = (InvalidRequestError if exc.status_code < 500 else ServerError)(str(exc.detail))
    response = error_response(request, error, exc.status_code)
    response.headers.update(getattr(exc, "headers", None) or {})
    return response


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("gateway route %s failed", request.url.path)
    return error_response(request, ServerError(f"{type(exc).__name__}: {exc}"), 500)
