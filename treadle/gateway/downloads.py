"""Signed download URLs: per-file GET links that need no API key and stop working at a set time.

On S3 (MinIO, AWS) a link is a boto3 presigned GET straight to the object store. A local-directory
store has no URLs of its own, so the gateway serves the file itself at `/api/v1/downloads/<token>`,
where the token carries the blob key and the expiry, signed with HMAC-SHA256 under a secret kept in
Redis (created once, shared by every gateway replica). A token cannot be altered to name another key
or a later expiry without the secret.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from treadle.errors import InvalidRequestError, NotFoundError
from treadle.gateway.backend import Backend, get_backend

router = APIRouter()
# boto3's presigned URLs (SigV4) are valid at most 7 days.
MAX_EXPIRES_S = 7 * 24 * 3600


def signed_url(backend: Backend, base_url: str, key: str, expires_s: int) -> str:
    """A GET link to blob `key` valid for `expires_s` seconds (1 s to 7 days)."""
    if not 1 <= expires_s <= MAX_EXPIRES_S:
        raise InvalidRequestError(f"expires_s: {expires_s}; must be between 1 and {MAX_EXPIRES_S} seconds")
    blobs = backend.owners.checkpoints().blobs
    presign = getattr(blobs, "presigned_get", None)
    if presign is not None:
        return presign(key, expires_s)
    token = backend.download_token(key, time.time() + expires_s)
    return f"{base_url.rstrip('/')}/api/v1/downloads/{token}"


@router.get("/downloads/{token}")
async def download(token: str, request: Request, backend: Backend = Depends(get_backend)) -> Response:
    """The file a signed link names; no API key, as with an S3 presigned URL."""
    key = backend.download_key(token)
    blobs = backend.owners.checkpoints().blobs
    try:
        data = await run_in_threadpool(blobs.get_bytes, key)
    except FileNotFoundError:
        raise NotFoundError("the file of this download link no longer exists") from None
    return Response(data, media_type="application/octet-stream")
