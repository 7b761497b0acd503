"""`treadle gateway`: serve the app with uvicorn, in the foreground or on a background thread."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from treadle.gateway.app import create_app
from treadle.gateway.settings import GatewaySettings


def run_gateway(settings: GatewaySettings | None = None, **overrides) -> None:
    """Serve until interrupted: `run_gateway(settings)` or `run_gateway(host=..., port=...)`.

    Keyword overrides apply on top of `settings`, or of the settings read from the environment
    (`TREADLE_GATEWAY_*`, `TREADLE_BROKER_URL`, ...) when none are given.
    """
    fields = {k: v for k, v in overrides.items() if v is not None}
    settings = settings.model_copy(update=fields) if settings is not None else GatewaySettings(**fields)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


class BackgroundGateway:
    """The gateway on a daemon thread of this process (the demo and the tests): `with BackgroundGateway(s) as gw: gw.url`."""

    def __init__(self, settings: GatewaySettings, start_timeout: float = 60.0):
        if settings.port == 0:
            settings = settings.model_copy(update={"port": _free_port(settings.host)})
        self.settings = settings
        self.url = f"http://{settings.host}:{settings.port}"
        self.start_timeout = start_timeout
        config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="treadle-gateway", daemon=True)

    def start(self) -> "BackgroundGateway":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the gateway did not start on {self.url}; see the log above")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start on {self.url} within {self.start_timeout:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> "BackgroundGateway":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
