"""`retrieve_future`: hold the poll until the result is in, then answer in the form the SDK expects.

The SDK re-polls immediately after `try_again`, so the gateway must hold each poll (long-poll) instead
of answering at once, or the client would spin. A worker's result records the op that produced it,
and is rendered from that op's response type in the op table: forward_backward and sample outputs as
protobuf (the SDK rejects JSON for them), every other response as the Tinker type of the same name.
A failed op is a 200 JSON `{"error", "category"}`, which the SDK raises as `RequestFailedError`.
A held poll also asks, every couple of seconds per future, whether the future can still be answered
(`OpsClient.check_future`, the bounds of `treadle.queue.wait_bounds`: a sample past its lifetime, no live
worker for the model past the grace), so a client whose request nothing will answer gets that error, not
try_again forever.
"""

from __future__ import annotations

import asyncio
import time
import typing
from collections import OrderedDict

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from tinker import types as tt

from treadle.errors import ServerError, TreadleError
from treadle.gateway.backend import Backend
from treadle.gateway.caller import Call
from treadle.gateway.ownership import not_found
from treadle.gateway.paths import to_tinker
from treadle.gateway.proto_codec import PROTO_MEDIA_TYPE, encode_forward_backward_output, encode_sample_response
from treadle.gateway.store import RequestRecord, Sampler
from treadle.queue.ops import decode_result
from treadle.queue.wait_bounds import CHECK_EVERY_S, CHECK_FIRST_S
from treadle.types import ForwardBackwardOutput, SampleResponse

router = APIRouter()

POLL_START_S = 0.002
POLL_MAX_S = 0.05


class _CheckClock:
    """When each future is next due a check, as often as the SDK's own waits check (the SDK polls again at once
    after try_again, so the clock outlives each poll); bounded (the oldest entries go), used on the event loop only."""

    def __init__(self, capacity: int = 100_000):
        self._due: OrderedDict[str, float] = OrderedDict()
        self._capacity = capacity

    def due(self, future_id: str) -> bool:
        now = time.monotonic()
        at = self._due.setdefault(future_id, now + CHECK_FIRST_S)
        self._due.move_to_end(future_id)
        while len(self._due) > self._capacity:
            self._due.popitem(last=False)
        if now < at:
            return False
        self._due[future_id] = now + CHECK_EVERY_S
        return True


_CHECKS = _CheckClock()


@router.post("/retrieve_future")
async def retrieve_future(call: Call) -> Response:
    req = await call.parse(tt.FutureRetrieveRequest)
    backend = call.backend
    record = await call.run(backend.store.get_request, req.request_id)
    if record is None or record.owner != call.owner:
        raise not_found("request", req.request_id)
    deadline = time.monotonic() + backend.settings.long_poll_seconds
    delay = POLL_START_S
    while True:
        try:
            value = await call.run(backend.local.poll, record)
            if value is not None:
                return await call.run(render_result, backend, record, value)
            if record.future_id is not None and _CHECKS.due(record.future_id):
                await call.run(backend.check_future, record.future_id)
        except TreadleError as exc:
            return JSONResponse({"error": exc.message, "category": exc.category})
        except Exception as exc:  # a result the gateway cannot render is a server error, not a hung client
            return JSONResponse({"error": ServerError(f"{type(exc).__name__}: {exc}").message, "category": "server"})
        if time.monotonic() >= deadline:
            return JSONResponse({"type": "try_again", "request_id": record.request_id, "queue_state": "active"})
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


def render_result(backend: Backend, record: RequestRecord, value: dict) -> Response:
    """A stored result as Tinker's response: worker results by their op's response type, the gateway's own as is."""
    if "op" not in value:  # gateway-side futures (create_model, load_weights into a new model) store the final JSON
        return JSONResponse(value)
    response = decode_result(value)
    if record.extra.get("sampler_id") is not None:
        # The ephemeral save_weights_for_sampler: the snapshot becomes a sampling session the client samples from.
        inflight_of = record.extra.get("inflight_of")
        backend.store.put_sampler(
            Sampler(
                sampler_id=record.extra["sampler_id"],
                owner=record.owner,
                base_model=record.extra["base_model"],
                model_path=response.path,
                inflight_of=inflight_of,
            )
        )
        if inflight_of is not None:  # the model's inflight samplers, old and new, now sample this snapshot
            backend.store.add_inflight_target(inflight_of, record.extra["sampler_seq"], response.path)
        backend.store.add_member(record.extra["session_id"], "samplers", record.extra["sampler_id"])
        return JSONResponse({"sampling_session_id": record.extra["sampler_id"], "type": "save_weights_for_sampler"})
    if isinstance(response, SampleResponse):  # as the request asked: the prompt's last n, a sparse target's cells
        response = _last_n(response, record.extra.get("prompt_logprobs_last_n"))
        return Response(
            encode_sample_response(response, record.extra.get("target_layout")), media_type=PROTO_MEDIA_TYPE
        )
    return render(response)


def render(response: BaseModel) -> Response:
    """Any op's typed response in Tinker's form: protobuf for the two the SDK reads as protobuf, else the
    Tinker type of the same name (with its `type` tag and tinker:// paths), else the response's own JSON."""
    if isinstance(response, ForwardBackwardOutput):
        return Response(encode_forward_backward_output(response), media_type=PROTO_MEDIA_TYPE)
    if isinstance(response, SampleResponse):
        return Response(encode_sample_response(response), media_type=PROTO_MEDIA_TYPE)
    body = response.model_dump(mode="json")
    if isinstance(body.get("path"), str):
        body["path"] = to_tinker(body["path"])
    tinker_type = getattr(tt, type(response).__name__, None)
    if tinker_type is not None:
        fields = tinker_type.model_fields
        body = {k: v for k, v in body.items() if k in fields}
        tag = typing.get_args(typing.get_args(fields["type"].annotation)[0]) if "type" in fields else ()
        if tag:
            body["type"] = tag[0]
    return JSONResponse(body)


def _last_n(response: SampleResponse, last_n: int | None) -> SampleResponse:
    """Honour prompt_logprobs_last_n by blanking the earlier entries, as the SDK checks."""
    if last_n is None or response.prompt_logprobs is None:
        return response
    keep_from = max(0, len(response.prompt_logprobs) - last_n)
    topk = response.topk_prompt_logprobs
    return response.model_copy(
        update={
            "prompt_logprobs": [None] * keep_from + response.prompt_logprobs[keep_from:],
            "topk_prompt_logprobs": None if topk is None else [None] * keep_from + topk[keep_from:],
        }
    )
