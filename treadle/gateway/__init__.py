"""HTTP gateway: Tinker's REST API (so the official `tinker` SDK runs unchanged) and OpenAI-compatible /v1."""

from treadle.gateway.app import create_app
from treadle.gateway.server import run_gateway
from treadle.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app", "run_gateway"]
