"""Reports on sessions: search, queues and traces, for the caller's own sessions only (creating, heartbeating
and finishing them is `routes_lifecycle.py`).

treadle has no organisations or projects: every search is over the caller's sessions (an `accessible`
or `user` owner filter searches the same set), and every session's project id is `default`.

A trace is built from what treadle records anyway: the worker's metering record of each op (its
name, seq, tokens, seconds of compute and when it finished) and, for ops not yet trimmed from the
journal by a checkpoint, when the client submitted it. It is a Chrome trace (JSON), which Perfetto
opens; it is stored beside the checkpoints and handed out as a signed link, like a download.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter
from tinker import types as tt

from treadle.gateway import downloads
from treadle.gateway.backend import Backend
from treadle.gateway.caller import Call
from treadle.gateway.store import ClientSession

router = APIRouter()
PROJECT_ID = "default"
TRACE_URL_LIFETIME_S = 3600


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def _micros(moment: datetime) -> int:
    """Whole microseconds since the epoch (a time without a zone is taken as UTC, as the gateway writes them)."""
    return (moment.replace(tzinfo=moment.tzinfo or timezone.utc) - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _status(backend: Backend, session: ClientSession) -> dict | None:
    """`active` while one of its models is; None otherwise (treadle does not record why a client finished)."""
    for model_id in backend.store.members(session.session_id, "models"):
        record = backend.session_info(model_id)
        if record is not None and record.status == "active":
            return {"type": "active"}
    return None


def _matches(backend: Backend, session: ClientSession, req: tt.SessionSearchRequest) -> bool:
    metadata = {str(k): str(v) for k, v in (session.user_metadata or {}).items()}
    if any(metadata.get(k) != v for k, v in req.user_metadata.items()):
        return False
    if req.session_id is not None or req.display_name is not None:
        words = (req.display_name or "").lower().split()
        by_name = req.display_name is not None and all(w in (session.display_name or "").lower() for w in words)
        if not (session.session_id == req.session_id or by_name):
            return False
    if req.project_ids is not None and PROJECT_ID not in req.project_ids:
        return False
    if req.statuses is not None:
        status = _status(backend, session)
        return status is not None and any(q.type == status["type"] for q in req.statuses)
    return True


def _summary(backend: Backend, session: ClientSession) -> dict:
    store = backend.owners.checkpoints()
    runs = [run for run in backend.store.members(session.session_id, "models") if store.get_run(run) is not None]
    manifests = [m for run in runs for m in store.list_checkpoints(run)]
    return {
        "session_id": session.session_id,
        "created_at": _utc(session.created_at).isoformat(),
        "owner": session.owner,
        "project_id": PROJECT_ID,
        "status": _status(backend, session),
        "checkpoints_count": len(manifests),
        "display_name": session.display_name,
        "user_metadata": {str(k): str(v) for k, v in (session.user_metadata or {}).items()} or None,
        "checkpoint_storage_bytes": sum(m.size_bytes for m in manifests),
    }


@router.post("/sessions/search")
async def search_sessions(call: Call) -> dict:
    """The caller's matching sessions, newest first, a page at a time (cursor: the last one's time and id)."""
    req = await call.parse(tt.SessionSearchRequest)
    backend = call.backend

    def search() -> dict:
        # Ordered and compared in whole microseconds: the cursor carries the time as an ISO string, and a
        # float compared with its rounded copy could let the last session of a page back into the next.
        sessions = sorted(
            backend.store.sessions_of(call.owner),
            key=lambda s: (_micros(_utc(s.created_at)), s.session_id),
            reverse=True,
        )
        if req.cursor is not None:
            after = (_micros(req.cursor.last_created_at), req.cursor.last_session_id)
            sessions = [s for s in sessions if (_micros(_utc(s.created_at)), s.session_id) < after]
        page, more = [], False
        for session in sessions:
            if _matches(backend, session, req):
                if len(page) == req.limit:
                    more = True
                    break
                page.append(session)
        cursor = (
            {"last_created_at": _utc(page[-1].created_at).isoformat(), "last_session_id": page[-1].session_id}
            if more
            else None
        )
        return {"sessions": [_summary(backend, s) for s in page], "next_cursor": cursor}

    return await call.run(search)


def session_trace(backend: Backend, session_id: str) -> dict:
    """The session's ops as Chrome trace events: one track per model, `queued` then the op itself."""
    meter = backend.meter()
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"treadle session {session_id}"}}
    ]
    for tid, model_id in enumerate(backend.store.members(session_id, "models"), start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": model_id}})
        for op in meter.session_ops(model_id):
            started = op.at - op.compute_s
            args = {
                "seq": int(op.op_id) if op.op_id.isdigit() else op.op_id,
                "prefill_tokens": op.prefill_tokens,
                "sampled_tokens": op.sampled_tokens,
                "trained_tokens": op.trained_tokens,
                "finished_at": op.at,
            }
            entry = backend.journal_entry(model_id, int(op.op_id)) if op.op_id.isdigit() else None
            if entry is not None and entry.submitted_at <= started:
                args["queued_at"] = entry.submitted_at
                events.append(
                    {
                        "name": "queued",
                        "cat": "queue",
                        "ph": "X",
                        "pid": 1,
                        "tid": tid,
                        "ts": entry.submitted_at * 1e6,
                        "dur": (started - entry.submitted_at) * 1e6,
                        "args": {"op": op.op},
                    }
                )
            events.append(
                {
                    "name": op.op,
                    "cat": "op",
                    "ph": "X",
                    "pid": 1,
                    "tid": tid,
                    "ts": started * 1e6,
                    "dur": op.compute_s * 1e6,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@router.get("/sessions/{session_id}/queue")
async def session_queue(session_id: str, call: Call) -> dict:
    """Each training model of the client session: ops queued, its next op's place in its worker's line and the
    estimated wait (from the measured costs of the ops ahead of it), as the worker last decided."""

    backend = call.backend

    def read() -> dict:
        backend.owners.client_session(session_id, call.owner)
        models = []
        for model_id in backend.store.members(session_id, "models"):
            record = backend.session_info(model_id)
            if record is None or record.status != "active":
                continue
            queued = max(0, backend.next_seq(model_id) - record.applied)
            models.append(
                {
                    "model_id": model_id,
                    "worker": record.worker,
                    "applied": record.applied,
                    "queued_ops": queued,
                    "queue_position": record.queue_position if queued else None,
                    "est_wait_s": record.queue_wait_s if queued else None,
                    "op_cost_s": record.op_cost_s,
                }
            )
        return {"session_id": session_id, "models": models}

    return await call.run(read)


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, call: Call) -> dict:
    """Built at once (the SDK polls until `ready`): the trace as of this call, behind a signed link."""

    backend = call.backend

    def export() -> dict:
        backend.owners.client_session(session_id, call.owner)
        key = f"traces/{session_id}.json"  # each export replaces the last: a trace only grows
        backend.owners.checkpoints().blobs.put_bytes(key, json.dumps(session_trace(backend, session_id)).encode())
        return {
            "status": "ready",
            "url": downloads.signed_url(backend, str(call.request.base_url), key, TRACE_URL_LIFETIME_S),
        }

    return await call.run(export)
