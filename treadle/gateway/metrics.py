"""GET /metrics of the gateway (Prometheus text format): its requests and the deployment it fronts.

Per request: `treadle_gateway_requests_total{route, method, status}` and
`treadle_gateway_request_seconds{route}`, labelled by the route's template (`/api/v1/sessions/{session_id}`),
never by a concrete id. Read from Redis at each scrape (`DeploymentCollector`): queue depth per served
model, live workers, active sessions per base model. Each app has its own registry, so several apps in
one process (tests, the demo) never collide. The route needs no API key and exposes no ids or owners.
"""

from __future__ import annotations

import re
import time

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from treadle.observability.metrics import DeploymentCollector

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def route_template(scope: dict) -> str:
    """The matched route's path template with its router's prefix (`/api/v1/sessions/{session_id}`).

    FastAPI leaves the included router's own route in the scope, whose path lacks the prefix the router
    was mounted under (`/v1` and `/api/v1` both have short paths): the prefix is what the concrete path
    has before the route's part, with the path parameters filled in."""
    route = scope.get("route")
    suffix = getattr(route, "path", None)
    if suffix is None:
        return "unmatched"  # a 404 for an unknown path has no route
    params = scope.get("path_params") or {}
    concrete = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: str(params.get(m[1], m[0])), suffix)
    path = scope.get("path", "")
    return path[: len(path) - len(concrete)] + suffix if path.endswith(concrete) else suffix


def install(app: FastAPI, redis_fn) -> CollectorRegistry:
    """Measure every request of `app` and serve GET /metrics; `redis_fn()` gives the deployment's Redis."""
    registry = CollectorRegistry()
    requests = Counter(
        "treadle_gateway_requests", "HTTP requests answered.", ["route", "method", "status"], registry=registry
    )
    seconds = Histogram(
        "treadle_gateway_request_seconds",
        "Seconds to answer an HTTP request.",
        ["route"],
        buckets=_BUCKETS,
        registry=registry,
    )
    registry.register(DeploymentCollector(redis_fn))

    @app.middleware("http")
    async def measure(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        template = route_template(request.scope)
        requests.labels(template, request.method, str(response.status_code)).inc()
        seconds.labels(template).observe(time.perf_counter() - started)
        return response

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        # The deployment gauges read Redis: off the event loop.
        return Response(await run_in_threadpool(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    return registry
