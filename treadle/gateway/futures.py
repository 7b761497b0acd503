"""`retrieve_future`: hold the poll until the result is in, then answer in the form the SDK expects.

The SDK re-polls immediately after `try_again`, so the gateway must hold each poll (long-poll) instead
of answering at once, or the client would spin. Results of forward_backward and sample are protobuf
(the SDK rejects JSON for them); the rest are small JSON objects. A failed op is a 200 JSON
`{"error", "category"}`, which the SDK raises as `RequestFailedError` with that category.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from tinker import types as tt

from treadle.errors import ServerError, TreadleError
from treadle.gateway.auth import not_found, require_owner
from treadle.gateway.backend import Backend
from treadle.gateway.paths import to_tinker
from treadle.gateway.proto_codec import PROTO_MEDIA_TYPE, encode_forward_backward_output, encode_sample_response
from treadle.gateway.store import RequestRecord, Sampler
from treadle.queue.ops import parse_request

router = APIRouter()

POLL_START_S = 0.002
POLL_MAX_S = 0.05


@router.post("/retrieve_future")
async def retrieve_future(request: Request, owner: str = Depends(require_owner)) -> Response:
    backend: Backend = request.app.state.backend
    req = parse_request(tt.FutureRetrieveRequest, await request.json())
    record = await run_in_threadpool(backend.store.get_request, req.request_id)
    if record is None or record.owner != owner:
        raise not_found("request", req.request_id)
    deadline = time.monotonic() + backend.settings.long_poll_seconds
    delay = POLL_START_S
    while True:
        try:
            value = await run_in_threadpool(backend.poll, record)
            if value is not None:
                return await run_in_threadpool(render, backend, record, value)
        except TreadleError as exc:
            return JSONResponse({"error": exc.message, "category": exc.category})
        except Exception as exc:  # a result the gateway cannot render is a server error, not a hung client
            return JSONResponse({"error": ServerError(f"{type(exc).__name__}: {exc}").message, "category": "server"})
        if time.monotonic() >= deadline:
            return JSONResponse({"type": "try_again", "request_id": record.request_id, "queue_state": "active"})
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


def render(backend: Backend, record: RequestRecord, value: dict) -> Response:
    """Turn treadle's result of a request into Tinker's response of that request type."""
    kind = record.kind
    if kind == "forward_backward":
        return Response(encode_forward_backward_output(value), media_type=PROTO_MEDIA_TYPE)
    if kind == "sample":
        return Response(encode_sample_response(_last_n(value, record.extra.get("prompt_logprobs_last_n"))), media_type=PROTO_MEDIA_TYPE)
    if kind == "optim_step":
        return JSONResponse({"metrics": value.get("metrics") or {}, "type": "optim_step"})
    if kind == "save_weights":
        return JSONResponse({"path": to_tinker(value["path"]), "type": "save_weights"})
    if kind == "load_weights":
        return JSONResponse({"path": to_tinker(value["path"]), "type": "load_weights"})
    if kind == "save_weights_for_sampler":
        sampler_id = record.extra.get("sampler_id")
        if sampler_id is None:
            return JSONResponse({"path": to_tinker(value["path"]), "type": "save_weights_for_sampler"})
        # The ephemeral form: the snapshot becomes a sampling session the client samples from directly.
        backend.store.put_sampler(Sampler(
            sampler_id=sampler_id, owner=record.owner, base_model=record.extra["base_model"], model_path=value["path"],
        ))
        backend.store.add_member(record.extra["session_id"], "samplers", sampler_id)
        return JSONResponse({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
    # gateway-side futures (create_model, load_weights into a new model) store the final JSON
    return JSONResponse(value)


def _last_n(value: dict, last_n: int | None) -> dict:
    """Honour prompt_logprobs_last_n by blanking the earlier entries, as the SDK checks."""
    prompt_logprobs = value.get("prompt_logprobs")
    if last_n is None or prompt_logprobs is None:
        return value
    keep_from = max(0, len(prompt_logprobs) - last_n)
    blanked = [None] * keep_from + prompt_logprobs[keep_from:]
    topk = value.get("topk_prompt_logprobs")
    if topk is not None:
        topk = [None] * keep_from + topk[keep_from:]
    return {**value, "prompt_logprobs": blanked, "topk_prompt_logprobs": topk}
