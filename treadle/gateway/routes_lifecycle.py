"""The lifecycle of a client and its sessions: client/config, create_session, heartbeat, finish, health, telemetry.

These routes change what exists; reading about existing sessions (search, queues, traces) is in
`routes_session_reports.py`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from tinker import types as tt

from treadle.gateway.auth import require_owner
from treadle.gateway.caller import Call

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(call: Call) -> dict:
    """Feature flags of this server. Required: the SDK aborts if this endpoint is missing."""
    settings = call.backend.settings
    return {
        "pjwt_auth_enabled": False,
        "parallel_fwdbwd_chunks": True,
        "proto_compress_fwdbwd": False,
        "fwdbwd_max_chunk_len": settings.fwdbwd_max_chunk_len,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
        "custom_loss_server_side": False,
    }


@router.post("/client/dynamic_config")
async def client_dynamic_config(owner: str = Depends(require_owner)) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.post("/create_session")
async def create_session(call: Call) -> dict:
    req = await call.parse(tt.CreateSessionRequest)
    session = await call.run(
        call.backend.owners.new_client_session, call.owner, req.tags, req.user_metadata, req.display_name
    )
    return {"session_id": session.session_id, "type": "create_session"}


@router.post("/session_heartbeat")
async def session_heartbeat(call: Call) -> dict:
    req = await call.parse(tt.SessionHeartbeatRequest)
    await call.session(req.session_id)
    await call.run(call.backend.store.touch_session, req.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, call: Call) -> dict:
    """The client closed: stop its training models so their workers free the adapters. Checkpoints stay."""
    await call.session(session_id)
    for model_id in await call.run(call.backend.store.members, session_id, "models"):
        if await call.run(call.backend.model_exists, model_id):
            await call.run(call.backend.seqs.stop_model, model_id)
    return {"status": "finished"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(call: Call) -> dict:
    served = await call.run(call.backend.owners.served_models)
    return {
        "supported_models": [
            {
                "model_name": m.name,
                "max_context_length": m.max_seq_len,
                "trainable": True,
                "sampleable": True,
                "family": m.family,
                "sampler": m.sampler,
                "inputs": m.inputs,
            }
            for m in served
        ]
    }


@router.post("/telemetry")
async def telemetry(owner: str = Depends(require_owner)) -> dict:
    """Accepted and discarded: treadle sends nothing anywhere."""
    return {"status": "accepted"}
