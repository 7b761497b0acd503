"""The signed tokens of gateway-served download links: the blob key and the expiry, signed with HMAC-SHA256
under a secret kept in Redis (created once, shared by every gateway replica). See `downloads`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from treadle.errors import NotFoundError
from treadle.queue import names

SECRET_KEY = names.gateway_key("download-secret")


def _secret(redis) -> bytes:
    redis.set(SECRET_KEY, secrets.token_hex(32), nx=True)
    value = redis.get(SECRET_KEY)
    return bytes.fromhex(value.decode() if isinstance(value, bytes) else value)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def make_token(redis, key: str, expires_at: float) -> str:
    body = json.dumps({"key": key, "exp": int(expires_at)}, separators=(",", ":")).encode()
    return f"{_b64(body)}.{_b64(hmac.new(_secret(redis), body, hashlib.sha256).digest())}"


def read_token(redis, token: str, now: float | None = None) -> str:
    """The blob key a token names; NotFoundError if it is forged, malformed or expired (nothing to probe)."""
    try:
        body_text, sig_text = token.split(".", 1)
        body, signature = _unb64(body_text), _unb64(sig_text)
        claims = json.loads(body)
    except (ValueError, json.JSONDecodeError):
        raise NotFoundError("download link is malformed") from None
    if not hmac.compare_digest(signature, hmac.new(_secret(redis), body, hashlib.sha256).digest()):
        raise NotFoundError("download link is not valid")
    if (time.time() if now is None else now) >= claims["exp"]:
        raise NotFoundError("download link has expired; ask for fresh URLs")
    return claims["key"]
