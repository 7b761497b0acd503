"""`treadle gateway`: serve the app with uvicorn."""

from __future__ import annotations

import uvicorn

from treadle.gateway.app import create_app
from treadle.gateway.settings import GatewaySettings


def run_gateway(host: str | None = None, port: int | None = None, **overrides) -> None:
    """Serve until interrupted. Arguments override the settings read from the environment (`TREADLE_GATEWAY_*`)."""
    fields = {k: v for k, v in {"host": host, "port": port, **overrides}.items() if v is not None}
    settings = GatewaySettings(**fields)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
