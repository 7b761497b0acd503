"""Signed download URLs: per-file GET links that need no API key and stop working at a set time.

On S3 (MinIO, AWS) a link is a boto3 presigned GET straight to the object store. A local-directory
store has no URLs of its own, so the gateway serves the file itself at `/api/v1/downloads/<token>`,
where the token carries the blob key and the expiry, signed with HMAC-SHA256 under a secret kept in
Redis (created once, shared by every gateway replica). A token cannot be altered to name another key
or a later expiry without the secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from treadle.errors import InvalidRequestError, NotFoundError
from treadle.gateway.backend import Backend, get_backend
from treadle.gateway.store import PREFIX

router = APIRouter()
SECRET_KEY = f"{PREFIX}:download-secret"
# boto3's presigned URLs (SigV4) are valid at most 7 days.
MAX_EXPIRES_S = 7 * 24 * 3600


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


def signed_url(backend: Backend, base_url: str, key: str, expires_s: int) -> str:
    """A GET link to blob `key` valid for `expires_s` seconds (1 s to 7 days)."""
    if not 1 <= expires_s <= MAX_EXPIRES_S:
        raise InvalidRequestError(f"expires_s: {expires_s}; must be between 1 and {MAX_EXPIRES_S} seconds")
    blobs = backend.owners.checkpoints().blobs
    presign = getattr(blobs, "presigned_get", None)
    if presign is not None:
        return presign(key, expires_s)
    token = make_token(backend.ops.redis, key, time.time() + expires_s)
    return f"{base_url.rstrip('/')}/api/v1/downloads/{token}"


@router.get("/downloads/{token}")
async def download(token: str, request: Request, backend: Backend = Depends(get_backend)) -> Response:
    """The file a signed link names; no API key, as with an S3 presigned URL."""
    key = read_token(backend.ops.redis, token)
    blobs = backend.owners.checkpoints().blobs
    try:
        data = await run_in_threadpool(blobs.get_bytes, key)
    except FileNotFoundError:
        raise NotFoundError("the file of this download link no longer exists") from None
    return Response(data, media_type="application/octet-stream")
