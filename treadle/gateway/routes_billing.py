"""The SDK's usage methods, answered from treadle's meter and checkpoint store, for the caller's own usage.

- `GET /billing/usage/events?starting_on&ending_before` (`get_billing_usage`): hourly buckets of the
  caller's metered ops (treadle.metering), one event per bucket, session, base model and kind:
  `training` (tokens of forward_backward and forward), `sampling_prefill` (prompt tokens of samples;
  never `cached`: treadle has no prefill cache), `sampling_sample` (generated tokens), `checkpoint`
  (save_state, save_weights_for_sampler and external saves). The token figures are exactly what the
  worker metered, no padding. `session_id` is the training session (Tinker's model id) the usage
  belongs to. treadle keeps no rate card, so every cost and rate is null, and it does not bill storage
  by the hour, so there are no `storage` events (the current size is the next route's).
- `GET /billing/usage/checkpoints/current` (`get_current_checkpoint_storage_usage`): the caller's
  unexpired checkpoints, counted and summed from their manifests.

The window follows Tinker's rules: hour-aligned UTC bounds, start not in the future, at most 14 days.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter
from pydantic import TypeAdapter, ValidationError

from treadle.errors import InvalidRequestError
from treadle.gateway.caller import Call
from treadle.metering import OpUsage
from treadle.queue.ops import SampleRequest

router = APIRouter()

MAX_WINDOW = timedelta(days=14)
CHECKPOINT_OPS = ("save_state", "save_weights_for_sampler", "save_weights_external")
_DATETIME = TypeAdapter(datetime)


def _hour(field: str, value: str) -> datetime:
    try:
        at = _DATETIME.validate_python(value)
    except ValidationError:
        raise InvalidRequestError(f"{field}: {value!r} is not an RFC 3339 date-time") from None
    at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
    if (at.minute, at.second, at.microsecond) != (0, 0, 0):
        raise InvalidRequestError(f"{field}: {value!r} must be aligned to a UTC hour boundary (minutes and seconds 0)")
    return at


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def _events(ops: list[OpUsage]) -> list[dict]:
    # (bucket start, session, base model, kind) -> quantity
    buckets: dict[tuple[int, str, str, str], int] = {}
    for op in ops:
        start = int(op.at // 3600 * 3600)
        sampling = op.op == SampleRequest.op
        quantities = {
            "training": 0 if sampling else op.trained_tokens + op.prefill_tokens,
            "sampling_prefill": op.prefill_tokens if sampling else 0,
            "sampling_sample": op.sampled_tokens,
            "checkpoint": 1 if op.op in CHECKPOINT_OPS else 0,
        }
        for kind, quantity in quantities.items():
            if quantity:
                key = (start, op.session_id, op.base_model, kind)
                buckets[key] = buckets.get(key, 0) + quantity
    events = []
    for (start, session_id, base_model, kind), quantity in buckets.items():
        info = {"type": kind, "count": quantity} if kind == "checkpoint" else {"type": kind, "token_count": quantity}
        if kind == "sampling_prefill":
            info["cached"] = False
        events.append(
            {
                "bucket_start": _iso(start),
                "bucket_end": _iso(start + 3600),
                "base_model": base_model or None,
                "session_id": session_id,
                "event_info": info,
                "_order": (start, -quantity),
            }
        )
    events.sort(key=lambda e: e.pop("_order"))  # by bucket, then descending quantity, as Tinker orders them
    return events


@router.get("/billing/usage/events")
async def billing_usage(starting_on: str, ending_before: str, call: Call) -> dict:
    start, end = _hour("starting_on", starting_on), _hour("ending_before", ending_before)
    if start.timestamp() > time.time():
        raise InvalidRequestError(f"starting_on: {starting_on!r} is in the future")
    if not start < end <= start + MAX_WINDOW:
        raise InvalidRequestError(
            f"ending_before: {ending_before!r} must be after starting_on ({starting_on!r}) and at most 14 days after it"
        )

    backend, owner = call.backend, call.owner

    def build() -> dict:
        ops = backend.meter().owner_ops(owner, since=start.timestamp(), until=end.timestamp())
        events = _events(ops)
        sessions = {}
        for session_id in sorted({e["session_id"] for e in events}):
            record = backend.session_info(session_id)
            metadata = record.user_metadata if record is not None and record.owner == owner else None  # only one's own
            sessions[session_id] = {
                "user_metadata": None if metadata is None else {str(k): str(v) for k, v in metadata.items()}
            }
        return {"data": events, "sessions": sessions, "cost_data_through": None}

    return await call.run(build)


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(call: Call, project_id: str | None = None) -> dict:
    # treadle has no projects: every checkpoint of the owner counts, whatever project_id asks for.
    backend, owner = call.backend, call.owner

    def build() -> dict:
        store, now = backend.owners.checkpoints(), time.time()
        count = size = 0
        for run_id in store.list_runs():
            run = store.get_run(run_id)
            if run is None or run.get("owner") != owner:
                continue
            for manifest in store.list_checkpoints(run_id):
                if manifest.expires_at is None or manifest.expires_at > now:
                    count += 1
                    size += manifest.size_bytes or 0
        item = {"user_name": owner, "checkpoint_count": count, "size_bytes": size, "size_gigabytes": size / 1e9}
        return {"effective_rate_usd_per_gigabyte_month": None, "data": [item]}

    return await call.run(build)
