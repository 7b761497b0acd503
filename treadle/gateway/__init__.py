"""HTTP gateway: Tinker's REST API (so the official `tinker` SDK runs unchanged) and OpenAI-compatible /v1."""

__all__ = ["GatewaySettings", "create_app", "run_gateway"]


def __getattr__(name: str):
    # Lazy: `treadle --help` and the settings should not pay for FastAPI, tinker and protobuf.
    if name == "create_app":
        from treadle.gateway.app import create_app

        return create_app
    if name == "run_gateway":
        from treadle.gateway.server import run_gateway

        return run_gateway
    if name == "GatewaySettings":
        from treadle.gateway.settings import GatewaySettings

        return GatewaySettings
    raise AttributeError(name)
