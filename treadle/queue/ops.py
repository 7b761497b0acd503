"""The typed payload of each op, shared by the publishing side (SDK, gateway) and the worker.

Adding an op: a request type here (and its entry in OP_REQUESTS), a handler in
`gpu_worker/op_handlers.py`, a method in `sdk/training_client.py`, a gateway route, a test row.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.errors import InvalidRequestError
from treadle.types import AdamParams, Datum, LoraConfig, SamplingParams


class _OpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ForwardBackwardRequest(_OpRequest):
    data: list[dict] = Field(description="Datums in wire form (Datum.to_wire()).")
    loss_fn: str = Field(description="cross_entropy | importance_sampling | ppo | cispo | dro")
    loss_fn_config: dict[str, float] | None = None

    @classmethod
    def build(cls, data: list[Datum], loss_fn: str, loss_fn_config: dict | None) -> "ForwardBackwardRequest":
        return cls(data=[d.to_wire() for d in data], loss_fn=loss_fn, loss_fn_config=loss_fn_config)

    def datums(self) -> list[Datum]:
        return [Datum.from_wire(w) for w in self.data]


class OptimStepRequest(_OpRequest):
    adam_params: AdamParams = Field(default_factory=AdamParams)


class SaveStateRequest(_OpRequest):
    name: str
    ttl_seconds: int | None = Field(default=None, ge=1)
    overwrite: bool = False
    user_metadata: dict | None = None


class SaveSamplerRequest(_OpRequest):
    name: str | None = Field(default=None, description="None: an ephemeral snapshot with a generated name.")
    ttl_seconds: int | None = Field(default=None, ge=1)
    merge_weights: bool = Field(default=False, description="Also write a merged model (SageMaker's spelling).")


class LoadStateRequest(_OpRequest):
    path: str
    with_optimizer: bool = False


class EmptyRequest(_OpRequest):
    pass


class SampleRequest(_OpRequest):
    model_path: str | None = Field(default=None, description="A sampler checkpoint path; None samples the base model.")
    prompt: list[int]
    num_samples: int = Field(default=1, ge=1, le=1024)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=100)


class CreateSessionRequest(_OpRequest):
    session_id: str
    base_model: str
    lora: LoraConfig = Field(default_factory=LoraConfig)
    owner: str | None = None
    user_metadata: dict | None = None
    from_state: str | None = None
    with_optimizer: bool = False
    checkpoint_every: int | None = Field(default=None, ge=0, description="Automatic checkpoint period in steps (None: the worker's).")


OpName = Literal["forward", "forward_backward", "optim_step", "save_state", "save_weights_for_sampler", "load_state", "noop", "stop"]

OP_REQUESTS: dict[str, type[_OpRequest]] = {
    "forward": ForwardBackwardRequest,
    "forward_backward": ForwardBackwardRequest,
    "optim_step": OptimStepRequest,
    "save_state": SaveStateRequest,
    "save_weights_for_sampler": SaveSamplerRequest,
    "load_state": LoadStateRequest,
    "noop": EmptyRequest,
    "stop": EmptyRequest,
}

# Ops that change a session's state: journaled, and replayed after a crash.
STATEFUL_OPS = {"forward_backward", "optim_step", "load_state"}


def parse_request(model: type[BaseModel], payload: dict, where: str = "request"):
    """Validate a payload; a bad field becomes an InvalidRequestError that names it."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"]) or where
            parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r:.80})")
        raise InvalidRequestError("; ".join(parts)) from None


# ------------------------------------------------------------------ results on the wire


def encode_forward_output(out, step: int) -> dict:
    """ForwardBackwardOutput -> JSON with tensors as raw bytes."""
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "loss_fn_outputs": [{k: v.to_wire() for k, v in o.items()} for o in out.loss_fn_outputs],
        "metrics": {**out.metrics, "step:max": float(step)},
        "step": step,
    }


def decode_forward_output(value: dict):
    from treadle.types import ForwardBackwardOutput, TensorData

    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=value.get("loss_fn_output_type", "TensorData"),
        loss_fn_outputs=[{k: TensorData.from_wire(v) for k, v in o.items()} for o in value["loss_fn_outputs"]],
        metrics=value["metrics"],
    )
