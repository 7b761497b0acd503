"""Training endpoints: create_model, get_info, forward_backward, optim_step, save/load weights.

Each returns a future (`{"request_id", "model_id"}`) at once; `retrieve_future` renders the result.
Model ids are Tinker's own `<session>:train:<n>` and double as treadle session ids, so the SDK's
client-side id arithmetic and treadle's checkpoint paths (`<run_id>` = model id) agree.
"""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from tinker import types as tt

from treadle.errors import InvalidRequestError, TreadleError
from treadle.gateway.auth import require_owner
from treadle.gateway.backend import Backend, get_backend, model_session_id
from treadle.gateway.proto_codec import decode_data, forward_backward_request, parse_forward_backward
from treadle.gateway.settings import LOSS_ALIAS_METADATA_KEY
from treadle.queue.ops import (
    CreateSessionRequest,
    LoadStateRequest,
    OpRequest,
    OptimStepRequest,
    SaveStateRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    parse_request,
)
from treadle.types import AdamParams, LoraConfig

router = APIRouter()


def _future(request_id: str, model_id: str) -> dict:
    return {"request_id": request_id, "model_id": model_id}


def _run_metadata(backend: Backend, user_metadata: dict | None) -> dict | None:
    """The run's user_metadata, plus the gateway's loss aliases when it has any: whoever reads the run
    (get_training_run) then sees that a refused loss name was trained as another."""
    aliases = backend.settings.loss_aliases
    if not aliases:
        return user_metadata
    return {**(user_metadata or {}), LOSS_ALIAS_METADATA_KEY: ",".join(f"{k}={v}" for k, v in aliases.items())}


@router.post("/create_model")
async def create_model(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    body = await request.body()
    req = parse_request(tt.CreateModelRequest, await request.json())
    await run_in_threadpool(backend.owners.client_session, req.session_id, owner)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    if req.optimizer_config.type != "adamw":
        error = InvalidRequestError(
            f"optimizer_config.type: {req.optimizer_config.type!r} is not supported; treadle trains with 'adamw'"
        )
        return _future(backend.local.fail(owner, "create_model", error), model_id)
    tinker_lora = req.lora_config or tt.LoraConfig(rank=LoraConfig().rank)
    lora = parse_request(LoraConfig, tinker_lora.model_dump(exclude_none=True), "lora_config")
    create = CreateSessionRequest.build(
        session_id=model_id,
        base_model=req.base_model,
        lora=lora,
        owner=owner,
        user_metadata=_run_metadata(backend, req.user_metadata),
    )

    def run() -> dict:
        backend.create_model(create)
        return {"model_id": model_id, "type": "create_model"}

    await run_in_threadpool(backend.store.add_member, req.session_id, "models", model_id)
    request_id = await run_in_threadpool(
        backend.local.run, owner, "create_model", f"create_model:{model_id}", run, body=body
    )
    return _future(request_id, model_id)


@router.post("/get_info")
async def get_info(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    req = parse_request(tt.GetInfoRequest, await request.json())
    info = await run_in_threadpool(backend.owners.model, req.model_id, owner)
    tokenizer_id = await run_in_threadpool(backend.owners.tokenizer_source, info.base_model)
    return {
        "type": "get_info",
        "model_id": info.session_id,
        # tokenizer_id is what the SDK's get_tokenizer() loads: the served model's HF id or directory
        "model_data": {"arch": None, "model_name": info.base_model, "tokenizer_id": tokenizer_id},
        "is_lora": True,
        "lora_rank": info.lora.rank,
        "model_name": info.base_model,
        "optimizer_config": {"type": "adamw"},
    }


@router.post("/forward_backward")
async def forward_backward(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    """Protobuf in; `forward_only` makes it a forward (the SDK has no separate /forward call)."""
    body = await request.body()  # zstd already decompressed, within the body limits (gateway/bodies.py)
    msg = parse_forward_backward(body)
    await run_in_threadpool(backend.owners.model, msg.model_id, owner)
    try:
        data = await run_in_threadpool(decode_data, msg)
    except (
        InvalidRequestError
    ) as exc:  # tensors or tokens the message cannot mean: a 400, as a bad JSON field is, that takes its seq
        await run_in_threadpool(_take_refused, backend, owner, msg.model_id, msg.seq_id, exc, body)
        raise
    aliases = backend.settings.loss_aliases
    return _future(
        await _submit(
            backend,
            owner,
            msg.model_id,
            msg.seq_id,
            lambda: forward_backward_request(msg, data, aliases),
            kind="forward_backward",
            body=body,
        ),
        msg.model_id,
    )


@router.post("/optim_step")
async def optim_step(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    body = await request.body()
    req = await _parse_op(backend, owner, tt.OptimStepRequest, await request.json(), body)
    await run_in_threadpool(backend.owners.model, req.model_id, owner)

    def build() -> OptimStepRequest:
        if not isinstance(req.optim_params, tt.AdamParams):
            raise InvalidRequestError(
                f"optimizer_params.type: {req.optim_params.type!r} is not supported; treadle trains with AdamW (adam_params)"
            )
        return OptimStepRequest.build(
            adam_params=parse_request(AdamParams, req.optim_params.model_dump(), "adam_params")
        )

    return _future(
        await _submit(backend, owner, req.model_id, req.seq_id, build, kind="optim_step", body=body), req.model_id
    )


@router.post("/save_weights")
async def save_weights(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    """`TrainingClient.save_state`: adapter + optimizer state under tinker://<model_id>/weights/<name>."""
    body = await request.body()
    req = await _parse_op(backend, owner, tt.SaveWeightsRequest, await request.json(), body)
    await run_in_threadpool(backend.owners.model, req.model_id, owner)

    def build() -> SaveStateRequest:
        if not req.path:
            raise InvalidRequestError("path: a checkpoint name is required for save_state")
        return SaveStateRequest.build(
            name=req.path, ttl_seconds=req.ttl_seconds, overwrite=req.overwrite, user_metadata=req.user_metadata
        )

    return _future(
        await _submit(backend, owner, req.model_id, req.seq_id, build, kind="save_weights", body=body), req.model_id
    )


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    """Named: a persistent sampler checkpoint. Ephemeral (no path): a snapshot that becomes a sampling session."""
    body = await request.body()
    req = await _parse_op(backend, owner, tt.SaveWeightsForSamplerRequest, await request.json(), body)
    info = await run_in_threadpool(backend.owners.model, req.model_id, owner)
    extra = None
    if req.path is None:
        session_id = model_session_id(req.model_id)
        seq = req.sampling_session_seq_id if req.sampling_session_seq_id is not None else req.seq_id
        extra = {
            "sampler_id": f"{session_id}:sample:{seq}",
            "base_model": info.base_model,
            "session_id": session_id,
            "inflight_of": req.model_id if req.kind == "inflight" else None,
            "sampler_seq": seq,
        }
    return _future(
        await _submit(
            backend,
            owner,
            req.model_id,
            req.seq_id,
            lambda: SaveWeightsForSamplerRequest.build(name=req.path, ttl_seconds=req.ttl_seconds),
            kind="save_weights_for_sampler",
            body=body,
            extra=extra,
        ),
        req.model_id,
    )


@router.post("/load_weights")
async def load_weights(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    """Into an existing model (deprecated `load_state`), or into a new one (`create_training_client_from_state*`)."""
    body = await request.body()
    req = await _parse_op(backend, owner, tt.LoadWeightsRequest, await request.json(), body)
    if req.model_id is not None:
        await run_in_threadpool(backend.owners.model, req.model_id, owner)

        def build() -> LoadStateRequest:
            path, _ = backend.owners.checkpoint(req.path, owner)
            return LoadStateRequest.build(path=path.uri(), with_optimizer=req.optimizer)

        return _future(
            await _submit(backend, owner, req.model_id, req.seq_id, build, kind="load_weights", body=body), req.model_id
        )

    if req.session_id is None or req.model_seq_id is None:
        raise InvalidRequestError("load_weights: give either model_id and seq_id, or session_id and model_seq_id")
    await run_in_threadpool(backend.owners.client_session, req.session_id, owner)
    path, manifest = await run_in_threadpool(backend.owners.readable_checkpoint, req.path, owner)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    lora = LoraConfig.model_validate(manifest.lora_config) if manifest.lora_config else LoraConfig()
    create = CreateSessionRequest.build(
        session_id=model_id,
        base_model=req.base_model or manifest.base_model,
        lora=lora,
        owner=owner,
        user_metadata=_run_metadata(backend, req.user_metadata),
        from_state=path.uri(),
        with_optimizer=req.optimizer,
    )

    def run() -> dict:
        backend.create_model(create)
        return {"model_id": model_id, "path": path.uri("tinker"), "type": "load_weights"}

    await run_in_threadpool(backend.store.add_member, req.session_id, "models", model_id)
    request_id = await run_in_threadpool(
        backend.local.run, owner, "load_weights", f"load_weights:{model_id}", run, body=body
    )
    return _future(request_id, model_id)


@router.post("/save_weights_external")
async def save_weights_external(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> dict:
    """The adapter as downloadable files under tinker://<model_id>/external_weights/<name> (maybe age-encrypted)."""
    body = await request.body()
    req = await _parse_op(backend, owner, tt.SaveWeightsExternalRequest, await request.json(), body)
    await run_in_threadpool(backend.owners.model, req.model_id, owner)
    return _future(
        await _submit(
            backend,
            owner,
            req.model_id,
            req.seq_id,
            lambda: SaveWeightsExternalRequest.build(
                name=req.path, ttl_seconds=req.ttl_seconds, age_encryption_recipients=req.age_encryption_recipients
            ),
            kind="save_weights_external",
            body=body,
        ),
        req.model_id,
    )


async def _parse_op(backend: Backend, owner: str, tinker_type, payload, body: bytes):
    """A training op's Tinker request. One that fails validation but names a model of the caller's and a
    seq_id still takes that seq (a noop whose future fails with the same reason), so later ops run."""
    try:
        return parse_request(tinker_type, payload)
    except InvalidRequestError as exc:
        model_id, seq_id = (
            (payload.get("model_id"), payload.get("seq_id")) if isinstance(payload, dict) else (None, None)
        )
        if isinstance(model_id, str) and type(seq_id) is int and seq_id >= 1:
            await run_in_threadpool(_take_refused, backend, owner, model_id, seq_id, exc, body)
        raise


def _take_refused(
    backend: Backend, owner: str, model_id: str, seq_id: int, error: InvalidRequestError, body: bytes
) -> None:
    try:
        backend.owners.model(model_id, owner)
        backend.seqs.refuse(owner, model_id, seq_id, error, body=body)
    except TreadleError:
        pass  # not the caller's model, a stopped one, a seq outside the window: nothing to take; the 400 says why


async def _submit(
    backend: Backend, owner: str, model_id: str, seq_id: int | None, build: Callable[[], OpRequest], **kwargs
) -> str:
    """Build the op's typed request and publish it at seq_id; a request that cannot be translated takes its seq as a noop."""

    def run() -> str:
        try:
            request = build()
        except TreadleError as exc:
            if exc.category != "user":
                raise
            return backend.seqs.refuse(owner, model_id, seq_id, exc, body=kwargs["body"])
        return backend.seqs.submit(owner, model_id, seq_id, request, **kwargs)

    return await run_in_threadpool(run)
