"""The op contract: one typed request class per op, and the one table (`OPS`) everything derives from.

Each request class says what its op is: its name (`op`), the response type its result decodes into
(`response`), whether it changes session state (`stateful`: journaled until a checkpoint covers it,
replayed after a crash), and which queue carries it (`route`: a session's ordered queue, or a base
model's control queue). The SDK and the gateway build these requests; the worker decodes them once
from the journal (or the held control request) and hands them to the handler registered for the class. The
Celery task names (`treadle.op.<name>`), the SDK's decoders and the gateway's renderers all come
from `OPS`, so adding an op is: a request class here (and its entry in `OPS`), a handler in
`gpu_worker/sessions/op_handlers.py` (a session op) or the handlers of `ControlOps` in
`gpu_worker/wiring.py` (a control op, also named in `treadle.queue.control_requests.ControlRequest`), an SDK method, a gateway route, a test row
(the checklist in docs/architecture.md).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Self, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from treadle.errors import InvalidRequestError
from treadle.queue.sample_options import MAX_PROMPT_ALT_TOKENS, MAX_TOPK_SAMPLE_LOGPROBS, check_target_ids
from treadle.types import (
    WIRE,
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    FullConfig,
    LoraConfig,
    LossFnType,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    UNSERVED_LOSSES,
    LOSS_CONFIGS,
    MAX_TOKENS_PER_SEQUENCE,
    TokenId,
)

Route = Literal["session", "model"]
# Generous bounds (docs/gateway.md states them): a TTL of ten years at most (as the Tinker SDK
# documents), a batch of 16384 datums, an automatic checkpoint every million steps.
MAX_TTL_SECONDS, MAX_DATUMS, MAX_CHECKPOINT_EVERY = 10 * 365 * 24 * 3600, 16384, 10**6


class EmptyResponse(BaseModel):
    """The result of an op that returns nothing (noop, stop)."""

    model_config = ConfigDict(extra="ignore")


class CreateSessionResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: str = Field(description="The new session's id.")
    run_id: str = Field(description="The training run its checkpoints are filed under.")


class OpRequest(BaseModel):
    """Base of every op's request: unknown fields are an error, and so is NaN or infinity in a number
    (JSON would carry it as null); the class variables say what the op is."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    op: ClassVar[str]
    response: ClassVar[type[BaseModel]]
    stateful: ClassVar[bool] = False
    route: ClassVar[Route] = "session"

    @classmethod
    def build(cls, **fields) -> Self:
        """The request from Python values; a bad field becomes an InvalidRequestError naming it."""
        return parse_request(cls, fields, cls.op)

    def encode(self) -> bytes:
        """JSON with tensors as raw bytes: what the journal (or a held control request) holds."""
        return self.model_dump_json(context=WIRE).encode()

    @classmethod
    def decode(cls, raw: bytes | str | dict) -> Self:
        """The request from its encoded form; a bad field becomes an InvalidRequestError naming it."""
        if isinstance(raw, dict):
            return parse_request(cls, raw, cls.op)
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidRequestError(_describe(exc, cls.op)) from None


# ---------------------------------------------------------------- a session's ordered ops


class ForwardRequest(OpRequest):
    op: ClassVar[str] = "forward"
    response: ClassVar[type[BaseModel]] = ForwardBackwardOutput

    data: list[Datum] = Field(
        max_length=MAX_DATUMS, description="The batch; model_input is tokens[:-1], target_tokens tokens[1:]."
    )
    loss_fn: LossFnType = Field(description="Built-in loss computed on the logprobs of target_tokens.")
    loss_fn_config: dict[str, float] | None = Field(default=None, description="Loss parameters, e.g. clip thresholds.")

    @field_validator("loss_fn", mode="before")
    @classmethod
    def _served_loss(cls, value):
        if isinstance(value, str) and value in UNSERVED_LOSSES:
            raise ValueError(f"loss_fn {value!r} is not served: {UNSERVED_LOSSES[value]}")
        return value

    @field_validator("loss_fn_config")
    @classmethod
    def _loss_config_in_bounds(cls, value, info):
        """The parameters of the chosen loss, each within its bounds (a clip range in order, a sane beta)."""
        loss_fn = info.data.get("loss_fn")
        if value is None or loss_fn not in LOSS_CONFIGS:
            return value
        try:
            LOSS_CONFIGS[loss_fn].model_validate(value)
        except ValidationError as exc:
            raise ValueError(f"{_describe(exc, 'loss_fn_config', prefix='loss_fn_config')} ({loss_fn})") from None
        return value

    @field_validator("data")
    @classmethod
    def _finite_tensors(cls, data: list[Datum]) -> list[Datum]:
        """NaN or infinity in a loss input would poison the session's gradients: refuse it here, by name."""
        for i, datum in enumerate(data):
            for key, tensor in datum.loss_fn_inputs.items():
                values = tensor.to_numpy()
                if tensor.dtype == "float32" and not np.isfinite(values).all():
                    j = int(np.flatnonzero(~np.isfinite(values.reshape(-1)))[0])
                    raise ValueError(
                        f"data[{i}].loss_fn_inputs.{key}[{j}]: {values.reshape(-1)[j]} is not a finite number"
                    )
        return data


class ForwardBackwardRequest(ForwardRequest):
    op: ClassVar[str] = "forward_backward"
    stateful: ClassVar[bool] = True


class OptimStepRequest(OpRequest):
    op: ClassVar[str] = "optim_step"
    response: ClassVar[type[BaseModel]] = OptimStepResponse
    stateful: ClassVar[bool] = True

    adam_params: AdamParams = Field(default_factory=AdamParams, description="AdamW hyperparameters of this step.")


class SaveStateRequest(OpRequest):
    op: ClassVar[str] = "save_state"
    response: ClassVar[type[BaseModel]] = SaveWeightsResponse

    name: str = Field(description="Checkpoint name: treadle://<run_id>/weights/<name>.")
    ttl_seconds: int | None = Field(
        default=None, ge=1, le=MAX_TTL_SECONDS, description="Delete the checkpoint after this long (None: keep)."
    )
    overwrite: bool = Field(default=False, description="Replace a checkpoint of the same name.")
    user_metadata: dict | None = Field(default=None, description="Stored with the checkpoint's manifest.")


class SaveWeightsForSamplerRequest(OpRequest):
    op: ClassVar[str] = "save_weights_for_sampler"
    response: ClassVar[type[BaseModel]] = SaveWeightsForSamplerResponse

    name: str | None = Field(default=None, description="None: an ephemeral snapshot with a generated name.")
    ttl_seconds: int | None = Field(
        default=None, ge=1, le=MAX_TTL_SECONDS, description="Delete after this long (ephemeral default: a day)."
    )
    merge_weights: bool = Field(default=False, description="Also write a merged model (SageMaker's spelling).")


class SaveWeightsExternalRequest(OpRequest):
    op: ClassVar[str] = "save_weights_external"
    response: ClassVar[type[BaseModel]] = SaveWeightsExternalResponse

    name: str = Field(description="Checkpoint name: treadle://<run_id>/external_weights/<name>.")
    ttl_seconds: int | None = Field(
        default=None, ge=1, le=MAX_TTL_SECONDS, description="Delete the export after this long (None: keep)."
    )
    age_encryption_recipients: list[str] | None = Field(
        default=None,
        max_length=64,
        description="age or SSH public keys; each file is stored encrypted to them, as <file>.age (None: plain).",
    )


class LoadStateRequest(OpRequest):
    op: ClassVar[str] = "load_state"
    response: ClassVar[type[BaseModel]] = LoadWeightsResponse
    stateful: ClassVar[bool] = True

    path: str = Field(description="A save_state checkpoint: treadle://<run_id>/weights/<name>.")
    with_optimizer: bool = Field(default=False, description="Also restore Adam moments exactly (or fail).")


class NoopRequest(OpRequest):
    """Takes a seq and does nothing: the gateway fills a seq it cannot translate with one."""

    op: ClassVar[str] = "noop"
    response: ClassVar[type[BaseModel]] = EmptyResponse


class StopRequest(OpRequest):
    """Frees the session after every op before it; nothing runs after it."""

    op: ClassVar[str] = "stop"
    response: ClassVar[type[BaseModel]] = EmptyResponse


# ---------------------------------------------------------------- a base model's control ops


class SampleRequest(OpRequest):
    op: ClassVar[str] = "sample"
    response: ClassVar[type[BaseModel]] = SampleResponse
    route: ClassVar[Route] = "model"

    base_model: str = Field(description="The served base model; its workers sample.")
    model_path: str | None = Field(default=None, description="A sampler checkpoint path; None samples the base model.")
    prompt: Annotated[list[TokenId], Field(max_length=MAX_TOKENS_PER_SEQUENCE)] | ModelInput = Field(
        description="Prompt token ids, or the prompt's chunks when it holds images."
    )
    num_samples: int = Field(default=1, ge=1, le=1024, description="Independent samples of the prompt.")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams, description="How to sample.")
    include_prompt_logprobs: bool = Field(default=False, description="Also return each prompt token's logprob.")
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=100, description="Also return the top-k per prompt position.")
    topk_sample_logprobs: int = Field(
        default=0,
        ge=0,
        le=MAX_TOPK_SAMPLE_LOGPROBS,
        description="Also return, per sampled token, the top-k of the distribution it was drawn from.",
    )
    target_prompt_logprobs: TensorData | None = Field(
        default=None,
        description="int64 [len(prompt) - 1, K] token ids (-1: none); cell [i, j] is scored at prompt position i + 1.",
    )
    prompt_alt_tokens_k: int = Field(
        default=0,
        ge=0,
        le=MAX_PROMPT_ALT_TOKENS,
        description="Also draw k tokens, at the request's temperature, at every prompt position after the first.",
    )
    owner: str | None = Field(
        default=None,
        description="Who pays (the gateway's API key owner); None: the sampled session's owner, else `sdk`.",
    )
    stream_id: str | None = Field(
        default=None,
        max_length=64,
        description="Publish the rows' tokens as they are drawn under this id (treadle.queue.sample_stream); "
        "None: only the answer.",
    )

    @model_validator(mode="after")
    def _target_ids_fit_the_prompt(self) -> "SampleRequest":
        if self.target_prompt_logprobs is not None:
            if isinstance(self.prompt, ModelInput) and any(
                getattr(c, "expected_tokens", 0) is None for c in self.prompt.chunks
            ):
                raise ValueError("target_prompt_logprobs: every image chunk of the prompt needs expected_tokens")
            check_target_ids(self.target_prompt_logprobs, self.prompt_length)
        return self

    @property
    def prompt_input(self) -> ModelInput:
        """The prompt as chunks, whichever form it came in."""
        return self.prompt if isinstance(self.prompt, ModelInput) else ModelInput.from_ints(self.prompt)

    @property
    def prompt_length(self) -> int:
        """Positions of the prompt (an image chunk's: its expected_tokens, which must then be set)."""
        return self.prompt.length if isinstance(self.prompt, ModelInput) else len(self.prompt)


class CreateSessionRequest(OpRequest):
    op: ClassVar[str] = "create_session"
    response: ClassVar[type[BaseModel]] = CreateSessionResponse
    route: ClassVar[Route] = "model"

    session_id: str = Field(description="The new session's id (also its run id).")
    base_model: str = Field(description="The served base model to train on.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The session's adapter.")
    full: FullConfig | None = Field(default=None, description="Set: a full fine-tuning session instead of an adapter.")
    owner: str | None = Field(default=None, description="Who the session belongs to (the gateway's API key owner).")
    user_metadata: dict | None = Field(default=None, description="Stored with the training run.")
    from_state: str | None = Field(default=None, description="Start from this save_state checkpoint.")
    with_optimizer: bool = Field(default=False, description="With from_state: restore Adam moments too.")
    checkpoint_every: int | None = Field(
        default=None,
        ge=0,
        le=MAX_CHECKPOINT_EVERY,
        description="Automatic checkpoint period in steps (None: the worker's).",
    )


# ---------------------------------------------------------------- the table

OPS: dict[str, type[OpRequest]] = {
    cls.op: cls
    for cls in (
        ForwardRequest,
        ForwardBackwardRequest,
        OptimStepRequest,
        SaveStateRequest,
        SaveWeightsForSamplerRequest,
        SaveWeightsExternalRequest,
        LoadStateRequest,
        NoopRequest,
        StopRequest,
        SampleRequest,
        CreateSessionRequest,
    )
}

OpName = Literal[tuple(OPS)]  # type: ignore[valid-type]

TASK_PREFIX = "treadle.op."


def task_name(op: str) -> str:
    """The Celery task of an op, so Flower shows which op is running."""
    return TASK_PREFIX + op


def op_request(op: str) -> type[OpRequest]:
    try:
        return OPS[op]
    except KeyError:
        raise InvalidRequestError(f"op: unknown op {op!r}; known: {', '.join(OPS)}") from None


def decode_result(value: dict):
    """A stored result as its op's typed response (results record the op that produced them)."""
    return op_request(value["op"]).response.model_validate(value)


def encode_result(op: str, response: BaseModel) -> dict:
    """A response as the JSON a result holds: tensors as raw bytes, and the op that produced it."""
    return {**response.model_dump(mode="json", context=WIRE), "op": op}


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_request(model: type[ModelT], payload: dict, where: str = "request") -> ModelT:
    """Validate a payload; a bad field becomes an InvalidRequestError that names it."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc, where)) from None


def _describe(exc: ValidationError, where: str, prefix: str | None = None) -> str:
    """pydantic's errors as `field: problem (got value)`; a check of ours already names its field."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in ([prefix] if prefix else []) + list(err["loc"])) or where
        if err["type"] == "value_error":
            parts.append(err["msg"].removeprefix("Value error, "))
        else:
            parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r:.80})")
    return "; ".join(parts)
