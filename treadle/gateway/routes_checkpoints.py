"""Changes to checkpoints after their save: TTL, publishing, copies, and signed download URLs.

A checkpoint id is `<kind>/<name>`, sent unescaped, so every route here takes it as two path segments.
Writes (TTL, publish) need the owner; reads (download URLs, the source of a copy) also accept anyone's
published checkpoint, which is readable by every owner and writable by none.
"""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timezone

from fastapi import APIRouter
from tinker import types as tt

from treadle.errors import InvalidRequestError
from treadle.gateway import downloads
from treadle.gateway.caller import Call, Caller
from treadle.queue.ops import MAX_TTL_SECONDS
from treadle.storage.paths import CheckpointPath

router = APIRouter()

# The SDK documents these bounds for every TTL it sends (copies, external weights).
MIN_TTL_S, MAX_TTL_S = 3600, MAX_TTL_SECONDS
# Download links last an hour (as Tinker's do), never past the checkpoint's own expiry.
URL_LIFETIME_S = 3600
# The SDK retries a copy with the same X-Idempotency-Key; the first copy's path answers the retries.
IDEMPOTENCY_TTL_S = 24 * 3600


def _tinker_path(run_id: str, kind: str, name: str) -> str:
    return f"tinker://{run_id}/{kind}/{name}"


def _check_ttl(ttl_seconds, field: str = "ttl_seconds") -> int | None:
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidRequestError(
            f"{field}: {ttl_seconds!r}; must be whole seconds from {MIN_TTL_S} (1 hour) to {MAX_TTL_S} (10 years), or null"
        )
    return ttl_seconds


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
async def set_ttl(run_id: str, kind: str, name: str, call: Call) -> None:
    """The checkpoint now expires `ttl_seconds` from this call (null: never)."""
    body = await call.json()
    if not isinstance(body, dict) or "ttl_seconds" not in body:
        raise InvalidRequestError('ttl_seconds: missing; send {"ttl_seconds": seconds or null}')
    ttl = _check_ttl(body["ttl_seconds"])

    def change() -> None:
        path, _ = call.backend.owners.checkpoint(_tinker_path(run_id, kind, name), call.owner)
        call.backend.owners.checkpoints().set_ttl(path, ttl)

    await call.run(change)


async def _set_public(call: Caller, run_id: str, kind: str, name: str, public: bool) -> None:
    def change() -> None:
        path, _ = call.backend.owners.checkpoint(_tinker_path(run_id, kind, name), call.owner)
        call.backend.owners.checkpoints().set_public(path, public)

    await call.run(change)


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def publish(run_id: str, kind: str, name: str, call: Call) -> None:
    await _set_public(call, run_id, kind, name, True)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def unpublish(run_id: str, kind: str, name: str, call: Call) -> None:
    await _set_public(call, run_id, kind, name, False)


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(run_id: str, kind: str, name: str, call: Call) -> dict:
    """One signed GET link per file, keyed by its path in the checkpoint (`.age` files when encrypted)."""
    if kind != "external_weights":
        raise InvalidRequestError(
            f"checkpoint kind: {kind!r}; download URLs are for external_weights checkpoints (save_weights_external)"
        )

    backend = call.backend

    def build() -> dict:
        path, manifest = backend.owners.readable_checkpoint(_tinker_path(run_id, kind, name), call.owner)
        now = time.time()
        lifetime = (
            URL_LIFETIME_S if manifest.expires_at is None else int(min(URL_LIFETIME_S, manifest.expires_at - now))
        )
        if lifetime < 1:
            raise InvalidRequestError(f"checkpoint {path.uri('tinker')} has expired; there is nothing to download")
        store = backend.owners.checkpoints()
        urls = {
            f: downloads.signed_url(backend, str(call.request.base_url), store.file_key(path, f), lifetime)
            for f in sorted(manifest.files)
        }
        return {"urls": urls, "expires": datetime.fromtimestamp(now + lifetime, tz=timezone.utc).isoformat()}

    return await call.run(build)


@router.post("/copy_weights")
async def copy_weights(call: Call) -> dict:
    """A copy of a readable checkpoint, of the same kind and name, in a new run of the caller that cannot be
    trained on. treadle has no projects: `destination_project_id` is recorded on the new run, nothing more.
    The store duplicates the files (verified on the way), so the copy outlives a deleted source."""
    req = await call.parse(tt.CopyWeightsRequest)
    ttl = _check_ttl(req.ttl_seconds)
    idempotency = call.request.headers.get("x-idempotency-key")
    backend, owner = call.backend, call.owner

    def copy() -> dict:
        if idempotency and (done := backend.store.copy_done(owner, idempotency)) is not None:
            return {"tinker_path": done}
        source, manifest = backend.owners.readable_checkpoint(req.source_path, owner)
        store = backend.owners.checkpoints()
        run_id = f"copy-{secrets.token_hex(8)}"
        store.put_run(
            run_id,
            {
                "base_model": manifest.base_model,
                "lora_config": manifest.lora_config,
                "owner": owner,
                "created_at": time.time(),
                "copied_from": source.uri("tinker"),
                "trainable": False,
                "project_id": req.destination_project_id,
                "user_metadata": {"copied_from": source.uri("tinker")},
            },
        )
        dest = CheckpointPath(run_id=run_id, kind=source.kind, name=source.name)
        store.copy(source, dest, ttl_seconds=ttl)
        path = dest.uri("tinker")
        if idempotency:
            backend.store.remember_copy(owner, idempotency, path, IDEMPOTENCY_TTL_S)
        return {"tinker_path": path}

    return await call.run(copy)
