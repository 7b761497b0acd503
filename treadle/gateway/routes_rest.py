"""RestClient endpoints: training runs, checkpoints, weights info, sessions. Only the caller's own are visible.

A Tinker training run is a treadle run (id = the model id); its checkpoints are the store's manifests,
served with `tinker://` paths. Changes to checkpoints (TTL, publishing, copies, download URLs) are in
`routes_checkpoints.py`; usage in `routes_billing.py`; session search, queues and traces in
`routes_session_reports.py`; creating, heartbeating and finishing sessions in `routes_lifecycle.py`.
Endpoints treadle has no counterpart for (projects, audit log, identity) are left undefined, so the SDK
gets a plain 404.
"""

from __future__ import annotations

from datetime import datetime, timezone

from typing import Callable, TypeVar

from fastapi import APIRouter

from treadle.gateway.backend import Backend
from treadle.gateway.caller import Call
from treadle.gateway.ownership import not_found
from treadle.storage.manifest import Manifest

router = APIRouter()

T = TypeVar("T")


def _time(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def _strings(metadata: dict | None) -> dict[str, str] | None:
    return None if metadata is None else {str(k): str(v) for k, v in metadata.items()}


def checkpoint_json(manifest: Manifest) -> dict:
    return {
        "checkpoint_id": f"{manifest.kind}/{manifest.name}",
        "checkpoint_type": {"weights": "training", "sampler_weights": "sampler"}.get(manifest.kind, "external"),
        "time": _time(manifest.created_at),
        "tinker_path": manifest.path.uri("tinker"),
        "size_bytes": manifest.size_bytes,
        "public": manifest.public,
        "user_metadata": _strings(manifest.user_metadata) or None,
        "expires_at": _time(manifest.expires_at),
    }


def _run_json(backend: Backend, run_id: str, run: dict) -> dict:
    manifests = backend.owners.checkpoints().list_checkpoints(run_id)
    last = {
        kind: next((m for m in reversed(manifests) if m.kind == kind), None) for kind in ("weights", "sampler_weights")
    }
    session = backend.session_info(run_id)
    last_request = session.last_activity if session is not None else run.get("created_at")
    return {
        "training_run_id": run_id,
        "base_model": run["base_model"],
        "model_owner": run.get("owner") or "",
        "is_lora": not run.get("full_config"),
        "corrupted": False,
        "lora_rank": run.get("lora_rank"),
        "last_request_time": _time(last_request or 0.0),
        "last_checkpoint": checkpoint_json(last["weights"]) if last["weights"] else None,
        "last_sampler_checkpoint": checkpoint_json(last["sampler_weights"]) if last["sampler_weights"] else None,
        "user_metadata": _strings(run.get("user_metadata")),
    }


def _owned_runs(backend: Backend, owner: str) -> list[tuple[str, dict]]:
    store = backend.owners.checkpoints()
    runs = []
    for run_id in store.list_runs():
        run = store.get_run(run_id)
        if run is not None and run.get("owner") == owner:
            runs.append((run_id, run))
    return sorted(runs, key=lambda item: item[1].get("created_at") or 0.0)


def _page(field: str, items: list[T], offset: int, limit: int, render: Callable[[T], dict]) -> dict:
    """One page of `items`, rendered, and the cursor the SDK pages with."""
    return {
        field: [render(item) for item in items[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(items)},
    }


@router.get("/training_runs")
async def list_training_runs(call: Call, limit: int = 20, offset: int = 0) -> dict:
    backend = call.backend

    def build() -> dict:
        runs = _owned_runs(backend, call.owner)
        return _page("training_runs", runs, offset, limit, lambda item: _run_json(backend, *item))

    return await call.run(build)


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, call: Call) -> dict:
    return await call.run(lambda: _run_json(call.backend, run_id, call.backend.owners.run(run_id, call.owner)))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, call: Call) -> dict:
    owners = call.backend.owners

    def build() -> dict:
        owners.run(run_id, call.owner)
        return {"checkpoints": [checkpoint_json(m) for m in owners.checkpoints().list_checkpoints(run_id)]}

    return await call.run(build)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(run_id: str, kind: str, name: str, call: Call) -> None:
    """The checkpoint id is `<kind>/<name>`, sent unescaped, hence two path segments."""
    path = f"tinker://{run_id}/{kind}/{name}"
    owners = call.backend.owners

    def delete() -> None:
        parsed, _ = owners.checkpoint(path, call.owner)
        owners.checkpoints().delete(parsed)

    await call.run(delete)


@router.get("/checkpoints")
async def list_user_checkpoints(call: Call, limit: int = 100, offset: int = 0) -> dict:
    backend = call.backend

    def build() -> dict:
        manifests = [
            m
            for run_id, _ in _owned_runs(backend, call.owner)
            for m in backend.owners.checkpoints().list_checkpoints(run_id)
        ]
        manifests.sort(key=lambda m: m.created_at, reverse=True)
        return _page("checkpoints", manifests, offset, limit, checkpoint_json)

    return await call.run(build)


@router.post("/weights_info")
async def weights_info(call: Call) -> dict:
    body = await call.json()
    tinker_path = body.get("tinker_path") if isinstance(body, dict) else None
    if not isinstance(tinker_path, str):
        raise not_found("checkpoint", str(tinker_path))
    _, manifest = await call.run(call.backend.owners.readable_checkpoint, tinker_path, call.owner)
    lora = manifest.lora_config or {}
    return {
        "base_model": manifest.base_model,
        "is_lora": manifest.lora_config is not None,
        "lora_rank": lora.get("rank"),
        "train_unembed": lora.get("train_unembed"),
        "train_mlp": lora.get("train_mlp"),
        "train_attn": lora.get("train_attn"),
        "optimizer_config": {"type": "adamw"},
    }


@router.get("/sessions")
async def list_sessions(call: Call, limit: int = 20, offset: int = 0) -> dict:
    sessions = await call.run(call.backend.store.sessions_of, call.owner)
    return {"sessions": [s.session_id for s in sessions[offset : offset + limit]]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, call: Call) -> dict:
    session = await call.session(session_id)
    return {
        "training_run_ids": await call.run(call.backend.store.members, session_id, "models"),
        "sampler_ids": await call.run(call.backend.store.members, session_id, "samplers"),
        "user_metadata": _strings(session.user_metadata),
    }
