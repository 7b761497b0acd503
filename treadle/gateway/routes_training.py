"""Training endpoints: create_model, get_info, forward_backward, optim_step, save/load weights.

Each returns a future (`{"request_id", "model_id"}`) at once; `retrieve_future` renders the result.
Model ids are Tinker's own `<session>:train:<n>` and double as treadle session ids, so the SDK's
client-side id arithmetic and treadle's checkpoint paths (`<run_id>` = model id) agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from fastapi import APIRouter
from pydantic import BaseModel
from tinker import types as tt

from treadle.errors import InvalidRequestError, TreadleError
from treadle.gateway.backend import Backend
from treadle.gateway.caller import Call, Caller
from treadle.gateway.proto_codec import decode_data, forward_backward_request, parse_forward_backward
from treadle.gateway.settings import LOSS_ALIAS_METADATA_KEY
from treadle.queue import names
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
from treadle.queue.sessions import SessionRecord
from treadle.types import AdamParams, FullConfig, LoraConfig

router = APIRouter()


# The Tinker requests of the ops on an existing model that name it by model_id.
OpT = TypeVar(
    "OpT", tt.OptimStepRequest, tt.SaveWeightsRequest, tt.SaveWeightsForSamplerRequest, tt.SaveWeightsExternalRequest
)
RequestT = TypeVar("RequestT", bound=BaseModel)


def _future(request_id: str, model_id: str) -> dict:
    return {"request_id": request_id, "model_id": model_id}


def _run_metadata(backend: Backend, user_metadata: dict | None) -> dict | None:
    """The run's user_metadata, plus the gateway's loss aliases when it has any: whoever reads the run
    (get_training_run) then sees that a refused loss name was trained as another."""
    aliases = backend.settings.loss_aliases
    if not aliases:
        return user_metadata
    return {**(user_metadata or {}), LOSS_ALIAS_METADATA_KEY: ",".join(f"{k}={v}" for k, v in aliases.items())}


@dataclass(frozen=True)
class _ModelOp:
    """An op at the client's seq on one of the caller's models. Its raw body is kept with the op, so a retry
    with the same body is the same request."""

    call: Caller
    model_id: str
    seq_id: int | None
    body: bytes
    info: SessionRecord

    @classmethod
    async def owned(cls, call: Caller, model_id: str, seq_id: int | None, body: bytes) -> _ModelOp:
        return cls(call, model_id, seq_id, body, await call.model(model_id))

    async def submit(self, build: Callable[[], OpRequest], kind: str, extra: dict | None = None) -> dict:
        """Build the op's typed request and publish it at seq_id; one that cannot be translated takes its seq
        as a noop. Answers the op's future."""
        backend, owner = self.call.backend, self.call.owner

        def run() -> str:
            try:
                request = build()
            except TreadleError as exc:
                if exc.category != "user":
                    raise
                return backend.seqs.refuse(owner, self.model_id, self.seq_id, exc, body=self.body)
            return backend.seqs.submit(
                owner, self.model_id, self.seq_id, request, kind=kind, body=self.body, extra=extra
            )

        return _future(await self.call.run(run), self.model_id)


async def _training_op(call: Caller, tinker_type: type[OpT]) -> tuple[OpT, _ModelOp]:
    """What every op on an existing model starts with: the body, the Tinker request, the model checked to be
    the caller's."""
    req, body = await _parse_op(call, tinker_type)
    return req, await _ModelOp.owned(call, req.model_id, req.seq_id, body)


async def _parse_op(call: Caller, tinker_type: type[RequestT]) -> tuple[RequestT, bytes]:
    """A training op's Tinker request and raw body. One that fails validation but names a model of the
    caller's and a seq_id still takes that seq (a noop whose future fails with the same reason), so later
    ops run."""
    body = await call.body()
    payload = await call.json()
    try:
        return parse_request(tinker_type, payload), body
    except InvalidRequestError as exc:
        model_id, seq_id = (
            (payload.get("model_id"), payload.get("seq_id")) if isinstance(payload, dict) else (None, None)
        )
        if isinstance(model_id, str) and type(seq_id) is int and seq_id >= 1:
            await _take_refused(call, model_id, seq_id, exc, body)
        raise


async def _take_refused(call: Caller, model_id: str, seq_id: int, error: InvalidRequestError, body: bytes) -> None:
    def take() -> None:
        try:
            call.backend.owners.model(model_id, call.owner)
            call.backend.seqs.refuse(call.owner, model_id, seq_id, error, body=body)
        except TreadleError:
            pass  # not the caller's model, a stopped one, a seq outside the window: nothing to take; the 400 says why

    await call.run(take)


async def _create_model(call: Caller, session_id: str, create: CreateSessionRequest, answer: dict, body: bytes) -> dict:
    """Create a training model in the caller's client session: a gateway-side future, of the kind `answer`'s
    type names, that answers `answer` once a worker has the model."""
    model_id, kind = create.session_id, answer["type"]

    def run() -> dict:
        call.backend.create_model(create)
        return answer

    await call.run(call.backend.store.add_member, session_id, "models", model_id)
    request_id = await call.run(call.backend.local.run, call.owner, kind, model_id, run, body=body)
    return _future(request_id, model_id)


@router.post("/create_model")
async def create_model(call: Call) -> dict:
    body = await call.body()
    req = await call.parse(tt.CreateModelRequest)
    await call.session(req.session_id)
    model_id = names.tinker_model_id(req.session_id, req.model_seq_id)
    if req.optimizer_config.type != "adamw":
        error = InvalidRequestError(
            f"optimizer_config.type: {req.optimizer_config.type!r} is not supported; treadle trains with 'adamw'"
        )
        return _future(call.backend.local.fail(call.owner, "create_model", error), model_id)
    tinker_lora = req.lora_config or tt.LoraConfig(rank=LoraConfig().rank)
    # Rank 0 asks for no adapter: full fine-tuning (docs/gateway.md); train_unembed=False keeps the embeddings.
    full = FullConfig(train_embeddings=tinker_lora.train_unembed) if tinker_lora.rank == 0 else None
    lora = LoraConfig() if full else parse_request(LoraConfig, tinker_lora.model_dump(exclude_none=True), "lora_config")
    create = CreateSessionRequest.build(
        session_id=model_id,
        base_model=req.base_model,
        lora=lora,
        full=full,
        owner=call.owner,
        user_metadata=_run_metadata(call.backend, req.user_metadata),
    )
    return await _create_model(call, req.session_id, create, {"model_id": model_id, "type": "create_model"}, body)


@router.post("/get_info")
async def get_info(call: Call) -> dict:
    req = await call.parse(tt.GetInfoRequest)
    info = await call.model(req.model_id)
    tokenizer_id = await call.run(call.backend.owners.tokenizer_source, info.base_model)
    return {
        "type": "get_info",
        "model_id": info.session_id,
        # tokenizer_id is what the SDK's get_tokenizer() loads: the served model's HF id or directory
        "model_data": {"arch": None, "model_name": info.base_model, "tokenizer_id": tokenizer_id},
        "is_lora": info.full is None,
        "lora_rank": info.lora.rank if info.full is None else 0,
        "model_name": info.base_model,
        "optimizer_config": {"type": "adamw"},
    }


@router.post("/forward_backward")
async def forward_backward(call: Call) -> dict:
    """Protobuf in; `forward_only` makes it a forward (the SDK has no separate /forward call)."""
    body = await call.body()
    msg = parse_forward_backward(body)
    op = await _ModelOp.owned(call, msg.model_id, msg.seq_id, body)
    try:
        data = await call.run(decode_data, msg)
    # tensors or tokens the message cannot mean: a 400, as a bad JSON field is, that takes its seq
    except InvalidRequestError as exc:
        await _take_refused(call, msg.model_id, msg.seq_id, exc, body)
        raise
    aliases = call.backend.settings.loss_aliases
    return await op.submit(lambda: forward_backward_request(msg, data, aliases), "forward_backward")


@router.post("/optim_step")
async def optim_step(call: Call) -> dict:
    req, op = await _training_op(call, tt.OptimStepRequest)

    def build() -> OptimStepRequest:
        if not isinstance(req.optim_params, tt.AdamParams):
            raise InvalidRequestError(
                f"optimizer_params.type: {req.optim_params.type!r} is not supported; treadle trains with AdamW (adam_params)"
            )
        return OptimStepRequest.build(
            adam_params=parse_request(AdamParams, req.optim_params.model_dump(), "adam_params")
        )

    return await op.submit(build, "optim_step")


@router.post("/save_weights")
async def save_weights(call: Call) -> dict:
    """`TrainingClient.save_state`: adapter + optimizer state under tinker://<model_id>/weights/<name>."""
    req, op = await _training_op(call, tt.SaveWeightsRequest)

    def build() -> SaveStateRequest:
        if not req.path:
            raise InvalidRequestError("path: a checkpoint name is required for save_state")
        return SaveStateRequest.build(
            name=req.path, ttl_seconds=req.ttl_seconds, overwrite=req.overwrite, user_metadata=req.user_metadata
        )

    return await op.submit(build, "save_weights")


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(call: Call) -> dict:
    """Named: a persistent sampler checkpoint. Ephemeral (no path): a snapshot that becomes a sampling session."""
    req, op = await _training_op(call, tt.SaveWeightsForSamplerRequest)
    extra = None
    if req.path is None:
        session_id = names.model_client_session(req.model_id)
        seq = req.sampling_session_seq_id if req.sampling_session_seq_id is not None else req.seq_id
        extra = {
            "sampler_id": names.tinker_sampler_id(session_id, seq),
            "base_model": op.info.base_model,
            "session_id": session_id,
            "inflight_of": req.model_id if req.kind == "inflight" else None,
            "sampler_seq": seq,
        }
    return await op.submit(
        lambda: SaveWeightsForSamplerRequest.build(name=req.path, ttl_seconds=req.ttl_seconds),
        "save_weights_for_sampler",
        extra,
    )


@router.post("/load_weights")
async def load_weights(call: Call) -> dict:
    """Into an existing model (deprecated `load_state`), or into a new one (`create_training_client_from_state*`)."""
    req, body = await _parse_op(call, tt.LoadWeightsRequest)
    if req.model_id is not None:
        op = await _ModelOp.owned(call, req.model_id, req.seq_id, body)

        def build() -> LoadStateRequest:
            path, _ = call.backend.owners.checkpoint(req.path, call.owner)
            return LoadStateRequest.build(path=path.uri(), with_optimizer=req.optimizer)

        return await op.submit(build, "load_weights")

    if req.session_id is None or req.model_seq_id is None:
        raise InvalidRequestError("load_weights: give either model_id and seq_id, or session_id and model_seq_id")
    await call.session(req.session_id)
    path, manifest = await call.run(call.backend.owners.readable_checkpoint, req.path, call.owner)
    model_id = names.tinker_model_id(req.session_id, req.model_seq_id)
    lora = LoraConfig.model_validate(manifest.lora_config) if manifest.lora_config else LoraConfig()
    create = CreateSessionRequest.build(
        session_id=model_id,
        base_model=req.base_model or manifest.base_model,
        lora=lora,
        owner=call.owner,
        user_metadata=_run_metadata(call.backend, req.user_metadata),
        from_state=path.uri(),
        with_optimizer=req.optimizer,
    )
    answer = {"model_id": model_id, "path": path.uri("tinker"), "type": "load_weights"}
    return await _create_model(call, req.session_id, create, answer, body)


@router.post("/save_weights_external")
async def save_weights_external(call: Call) -> dict:
    """The adapter as downloadable files under tinker://<model_id>/external_weights/<name> (maybe age-encrypted)."""
    req, op = await _training_op(call, tt.SaveWeightsExternalRequest)

    def build() -> SaveWeightsExternalRequest:
        return SaveWeightsExternalRequest.build(
            name=req.path, ttl_seconds=req.ttl_seconds, age_encryption_recipients=req.age_encryption_recipients
        )

    return await op.submit(build, "save_weights_external")
