"""Public wire types: what a training loop sends to treadle and gets back.

Names, fields and defaults follow Tinker's SDK (`tinker.types`) so that a Tinker loop ports by
changing its imports. Requests reject unknown fields; responses ignore them. This module imports
numpy but never torch: torch is touched only inside `TensorData.from_torch` / `to_torch`.

Tensors travel as raw little-endian bytes (`model_dump(context=WIRE)`), never as pickles.
"""

from __future__ import annotations

import base64
import binascii
import math
import typing
from typing import Annotated, Any, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_serializer, model_validator

__all__ = [
    "AdamParams",
    "Checkpoint",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "LoadWeightsResponse",
    "LoraConfig",
    "LossFnType",
    "ModelData",
    "ModelInput",
    "OptimStepResponse",
    "PromptAltTokens",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsExternalResponse",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServerCapabilities",
    "StopReason",
    "SupportedModel",
    "TensorData",
    "TrainingRun",
    "WeightsInfo",
    "LOSS_CONFIGS",
    "LOSS_FN_TYPES",
    "CISPOConfig",
    "DROConfig",
    "GSPOConfig",
    "LossConfig",
    "PPOConfig",
    "UNSERVED_LOSSES",
    "ALIASABLE_LOSSES",
    "ALIAS_TARGETS",
]

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
LOSS_FN_TYPES: tuple[str, ...] = typing.get_args(LossFnType)
# Tinker's other loss names, which treadle refuses with these reasons (a clear error, never a guess).
UNSERVED_LOSSES: dict[str, str] = {
    "stable_reinforce": "its objective is not published, and treadle will not train on a guess under its name. "
    "Pass loss_fn=cispo instead (a REINFORCE-style loss whose importance weight is clipped, the nearest published "
    "relative), or ppo (clipped both ways; the cookbook's advice for off-policy async runs); importance_sampling "
    "(unclipped) and gspo (sequence-level, needs sequence_ratio_mask) work too. The cookbook takes loss_fn=cispo on "
    "rl_loop, math_rl and rubric; an operator can map the name on a gateway with --loss_alias stable_reinforce=cispo",
    "custom": "uploaded (server-side) losses are not supported; use forward_backward_custom, which runs the loss on the client",
}
# What a gateway's --loss_alias may map an unserved name to: the served losses whose inputs are those a
# stable_reinforce datum carries (target_tokens, logprobs, advantages); gspo also needs sequence_ratio_mask.
ALIASABLE_LOSSES: tuple[str, ...] = ("stable_reinforce",)
ALIAS_TARGETS: tuple[str, ...] = ("importance_sampling", "ppo", "cispo", "dro")
StopReason = Literal["stop", "length"]
DType = Literal["int64", "float32"]


class _Request(BaseModel):
    """Base of everything a client sends: unknown fields are an error, not silently dropped, and NaN
    or infinity in a number is an error here, naming the field (JSON would turn it into null)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Token ids and seeds: what torch and the tokenizers accept. torch takes seeds below 2**64; the
# margin leaves room for the per-row offsets a sampler adds to a request's seed.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
SEED_MAX = 2**63 - 1
MAX_TOKENS_PER_SEQUENCE = 2**20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Generous limits on counts, so no request can ask for unbounded work or memory: a tensor has at most
# 8 dimensions; a protobuf tensor (sparse ones are densified) at most 2**24 values; a datum at most 64
# loss inputs; a ModelInput at most one chunk per token.
MAX_TENSOR_DIMS = 8
MAX_TENSOR_VALUES = 2**24
MAX_LOSS_INPUTS = 64


class _Response(BaseModel):
    """Base of everything the server returns: newer servers may add fields."""

    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- model input


class EncodedTextChunk(_Request):
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_PER_SEQUENCE, description="Token ids of this chunk.")
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ModelInput(_Request):
    """A token sequence, as a list of chunks (only encoded text is supported)."""

    chunks: list[EncodedTextChunk] = Field(
        default_factory=list, max_length=MAX_TOKENS_PER_SEQUENCE, description="Chunks in order."
    )

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> "ModelInput":
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> "ModelInput":
        return self.append(EncodedTextChunk(tokens=[int(token)]))


# ---------------------------------------------------------------- tensors

_NP_DTYPES = {"int64": np.dtype("<i8"), "float32": np.dtype("<f4")}

# model_dump(context=WIRE) writes tensors in their compact wire form (raw bytes, base64'd once).
WIRE = {"wire": True}


class TensorData(_Request):
    """A flat tensor with a dtype and an optional shape (Tinker's `TensorData`).

    The values live in a numpy array; `data` (Tinker's list field) is built only when something reads
    it. On the wire a tensor is `{"dtype", "shape", "b64"}`: its raw little-endian bytes, decoded with
    one `np.frombuffer`, so a batch never turns into Python lists between the client and the engine.
    """

    data: list[int] | list[float] = Field(description="Flattened values, row-major (made from the array on first use).")
    dtype: DType = Field(description="`int64` or `float32`.")
    shape: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_TENSOR_DIMS, description="Shape; None means 1-D."
    )
    _array: np.ndarray | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_wire_form(cls, value: Any, handler) -> "TensorData":
        if isinstance(value, dict) and "b64" in value:
            return cls._from_wire_dict(value)
        return handler(value)

    @model_validator(mode="after")
    def _check_shape(self) -> "TensorData":
        if self._array is not None:  # came off the wire: its shape was checked against the bytes
            return self
        if self.shape is not None and math.prod(self.shape) != len(self.data):
            raise ValueError(f"shape {self.shape} holds {math.prod(self.shape)} values but data has {len(self.data)}")
        if self.dtype == "int64":  # numpy would raise a bare OverflowError later, far from the field
            j = next((j for j, v in enumerate(self.data) if not INT64_MIN <= v <= INT64_MAX), None)
            if j is not None:
                raise ValueError(f"data[{j}]: {self.data[j]} is outside int64 (-2^63 to 2^63-1)")
        return self

    @model_serializer(mode="wrap")
    def _serialize(self, handler, info):
        if info.context and info.context.get("wire"):
            return self.to_wire()
        self.data  # noqa: B018 - materialise the list before the default serializer reads the fields
        return handler(self)

    def __getattr__(self, name: str) -> Any:
        if name == "data":  # built from the array on first read, then kept
            private = self.__pydantic_private__ or {}
            values = private["_array"].reshape(-1).tolist()
            vars(self)["data"] = values
            return values
        return super().__getattr__(name)  # pyright: ignore[reportAttributeAccessIssue] (pydantic defines it)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorData):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and np.array_equal(self.to_numpy(), other.to_numpy())
        )

    @classmethod
    def _of(cls, array: np.ndarray, dtype: DType, shape: list[int] | None) -> "TensorData":
        tensor = cls.model_construct(dtype=dtype, shape=shape)
        tensor._array = array
        return tensor

    @classmethod
    def _from_wire_dict(cls, wire: dict) -> "TensorData":
        dtype, shape = wire.get("dtype"), wire.get("shape")
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_NP_DTYPES)}")
        if shape is not None and not (
            isinstance(shape, list) and len(shape) <= MAX_TENSOR_DIMS and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise ValueError(f"shape: {shape!r:.80} is not a list of at most {MAX_TENSOR_DIMS} dimensions >= 0")
        try:
            array = np.frombuffer(base64.b64decode(wire["b64"], validate=True), dtype=_NP_DTYPES[dtype])
        except (binascii.Error, ValueError, TypeError) as exc:
            raise ValueError(f"b64: not the raw bytes of a {dtype} tensor ({exc})") from None
        if shape is not None and math.prod(shape) != array.size:
            raise ValueError(f"shape {shape} holds {math.prod(shape)} values but the bytes hold {array.size}")
        return cls._of(array, dtype, shape)

    # numpy / torch / lists
    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorData":
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        # A copy: the caller may keep writing into its array after handing it over.
        return cls._of(np.array(array, dtype=_NP_DTYPES[dtype], copy=True), dtype, list(array.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> "TensorData":
        return cls.from_numpy(tensor.detach().cpu().numpy())

    @classmethod
    def from_list(cls, values: Sequence[Any], dtype: DType | None = None) -> "TensorData":
        if dtype is None:
            dtype = (
                "int64"
                if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
                else "float32"
            )
        try:
            array = np.asarray(values, dtype=_NP_DTYPES[dtype])
        except OverflowError:  # a ValueError, so a validator reports it as the field's error
            bad = next((v for v in values if not INT64_MIN <= v <= INT64_MAX), None)
            raise ValueError(f"{bad} is outside int64 (-2^63 to 2^63-1)") from None
        return cls.from_numpy(array)

    def to_numpy(self) -> np.ndarray:
        """The values as an array of `shape` (read-only when it came off the wire)."""
        if self._array is None:
            self._array = np.asarray(self.data, dtype=_NP_DTYPES[self.dtype])
        return self._array.reshape(self.shape) if self.shape is not None else self._array.reshape(-1)

    def to_torch(self) -> Any:
        import torch

        return torch.from_numpy(self.to_numpy().copy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def to_wire(self) -> dict:
        raw = np.ascontiguousarray(self.to_numpy(), dtype=_NP_DTYPES[self.dtype]).tobytes()
        return {"dtype": self.dtype, "shape": self.shape, "b64": base64.b64encode(raw).decode("ascii")}


def _as_tensor_data(key: str, value: Any) -> Any:
    """Lets users pass lists, numpy arrays or torch tensors, as Tinker's `Datum` does."""
    if isinstance(value, (TensorData, dict)):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, (list, tuple)):
        dtype: DType = "int64" if key == "target_tokens" else "float32"
        return TensorData.from_list(list(value), dtype)
    return value


class Datum(_Request):
    """One training example: the (pre-shifted) input tokens and the loss's per-token inputs."""

    model_input: ModelInput = Field(description="Input tokens, i.e. tokens[:-1].")
    loss_fn_inputs: dict[str, TensorData] = Field(
        default_factory=dict,
        max_length=MAX_LOSS_INPUTS,
        description="Per-token loss inputs: target_tokens, weights, logprobs, advantages, ...",
    )

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _convert_inputs(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: _as_tensor_data(k, v) for k, v in value.items()}
        return value


# ---------------------------------------------------------------- configs


class SamplingParams(_Request):
    """How to sample. `top_k=1` is greedy; `seed` makes a request reproducible."""

    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TOKENS_PER_SEQUENCE,
        description="Most new tokens per sequence (None: up to the context limit).",
    )
    seed: int | None = Field(
        default=None, ge=0, le=SEED_MAX, description="Random seed; the same seed gives the same tokens."
    )
    stop: str | list[str] | list[TokenId] | None = Field(
        default=None, description="Stop strings or stop token ids (at most 64)."
    )
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy.")
    top_k: int = Field(default=-1, ge=-1, le=2**31 - 1, description="Keep the k most likely tokens; -1 keeps all.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")

    @field_validator("stop")
    @classmethod
    def _stop_within_limits(cls, value):
        if isinstance(value, list) and len(value) > 64:
            raise ValueError(f"{len(value)} stop sequences; at most 64")
        strings = [value] if isinstance(value, str) else [v for v in value or [] if isinstance(v, str)]
        if any(len(v) > 1024 for v in strings):
            raise ValueError("a stop string is longer than 1024 characters")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in (self.stop or []) if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        return [s for s in (self.stop or []) if isinstance(s, int)] if not isinstance(self.stop, str) else []


class AdamParams(_Request):
    """AdamW hyperparameters of one `optim_step` (identical to `torch.optim.AdamW`, decoupled decay)."""

    learning_rate: float = Field(default=1e-4, ge=0.0, le=10.0, description="Step size.")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0, description="First-moment decay.")
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0, description="Second-moment decay.")
    eps: float = Field(default=1e-12, gt=0.0, le=1.0, description="Denominator epsilon.")
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="Decoupled weight decay.")
    grad_clip_norm: float = Field(
        default=0.0, ge=0.0, le=1e6, description="Clip the global grad norm to this; 0 is off."
    )


class LossConfig(_Request):
    """A loss's parameters (`loss_fn_config`); the base takes none, like cross_entropy and importance_sampling."""


class _ClipConfig(LossConfig):
    clip_low_threshold: float
    clip_high_threshold: float

    @model_validator(mode="after")
    def _ordered(self) -> "_ClipConfig":
        if self.clip_low_threshold >= self.clip_high_threshold:
            raise ValueError(
                f"loss_fn_config.clip_low_threshold: {self.clip_low_threshold} must be below "
                f"clip_high_threshold {self.clip_high_threshold}"
            )
        return self


class PPOConfig(_ClipConfig):
    clip_low_threshold: float = Field(default=0.8, gt=0.0, le=1.0, description="Lower bound of the clipped ratio.")
    clip_high_threshold: float = Field(default=1.2, ge=1.0, le=100.0, description="Upper bound of the clipped ratio.")


class CISPOConfig(_ClipConfig):
    clip_low_threshold: float = Field(default=0.0, ge=0.0, le=1.0, description="Lower bound of the ratio weight.")
    clip_high_threshold: float = Field(default=4.0, gt=0.0, le=1000.0, description="Upper bound of the ratio weight.")


class DROConfig(LossConfig):
    # Tinker documents beta without a default; 0.05 is the value of its examples.
    beta: float = Field(
        default=0.05, gt=0.0, le=1e4, description="Weight of the quadratic pull towards the sampler's logprobs."
    )


class GSPOConfig(_ClipConfig):
    # In ratio space like ppo's; the defaults are the GSPO paper's clip ranges (3e-4 below, 4e-4 above).
    clip_low_threshold: float = Field(
        default=1.0 - 3e-4, gt=0.0, le=1.0, description="Lower bound of the clipped sequence ratio."
    )
    clip_high_threshold: float = Field(
        default=1.0 + 4e-4, ge=1.0, le=100.0, description="Upper bound of the clipped sequence ratio."
    )


# Every built-in loss's parameters, with defaults and bounds; the worker's losses take their defaults from here.
LOSS_CONFIGS: dict[str, type[LossConfig]] = {
    "cross_entropy": LossConfig,
    "importance_sampling": LossConfig,
    "ppo": PPOConfig,
    "cispo": CISPOConfig,
    "dro": DROConfig,
    "gspo": GSPOConfig,
}


class LoraConfig(_Request):
    """The LoRA adapter of a training session."""

    rank: int = Field(default=32, ge=1, le=1024, description="LoRA rank r.")
    alpha: float = Field(default=32.0, gt=0.0, le=1e6, description="LoRA alpha (scale = alpha / rank).")
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX, description="Seed of the adapter's initialisation.")
    train_mlp: bool = Field(default=True, description="Adapt the MLP projections.")
    train_attn: bool = Field(default=True, description="Adapt the attention projections.")
    train_unembed: bool = Field(default=True, description="Adapt the output embedding (lm_head).")

    @model_validator(mode="after")
    def _something_to_train(self) -> "LoraConfig":
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValueError("at least one of train_mlp, train_attn, train_unembed must be true")
        return self


# ---------------------------------------------------------------- responses


class SampledSequence(_Response):
    tokens: list[int] = Field(description="Sampled token ids (the stop token included when one ended it).")
    logprobs: list[float] | None = Field(
        default=None, description="Logprob of each sampled token under the distribution sampled from."
    )
    stop_reason: StopReason = Field(description="`stop` (a stop string/token or EOS) or `length` (max_tokens).")
    topk_logprobs: list[list[tuple[int, float]]] | None = Field(
        default=None,
        description="Per sampled token, the top-k (token, logprob) of the distribution it was drawn from (topk_sample_logprobs).",
    )


class PromptAltTokens(_Response):
    """Tinker's `PromptAltTokens`: k draws at every prompt position after the first (prompt_alt_tokens_k)."""

    tokens: TensorData = Field(description="int64 [len(prompt) - 1, k]: row i holds draws for prompt position i + 1.")
    logprobs: TensorData = Field(description="float32 [len(prompt) - 1, k]: the model's logprob of each draw there.")


class SampleResponse(_Response):
    sequences: list[SampledSequence] = Field(default_factory=list)
    prompt_logprobs: list[float | None] | None = Field(default=None, description="Per prompt token; entry 0 is None.")
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = Field(
        default=None, description="Top-k (token, logprob) per prompt position; entry 0 is None."
    )
    target_prompt_logprobs: TensorData | None = Field(
        default=None, description="float32, the request's target ids' shape: their logprobs, 0.0 where it had -1."
    )
    prompt_alt_tokens: PromptAltTokens | None = Field(
        default=None, description="The draws prompt_alt_tokens_k asked for."
    )
    prompt_cache_hit_tokens: int = 0


class ForwardBackwardOutput(_Response):
    loss_fn_output_type: str = "TensorData"
    loss_fn_outputs: list[dict[str, TensorData]] = Field(
        default_factory=list, description="Per datum: {'logprobs': ...} of target_tokens."
    )
    metrics: dict[str, float] = Field(default_factory=dict, description="Keys are `name:reduction`, e.g. `loss:sum`.")

    @field_validator("metrics")
    @classmethod
    def _keys_have_reduction(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [k for k in value if ":" not in k]
        if bad:
            raise ValueError(f"metric keys must look like name:reduction, got {bad}")
        return value


class OptimStepResponse(_Response):
    metrics: dict[str, float] | None = None


class SaveWeightsResponse(_Response):
    path: str = Field(description="treadle://<run_id>/weights/<name>")


class SaveWeightsForSamplerResponse(_Response):
    path: str | None = Field(default=None, description="treadle://<run_id>/sampler_weights/<name> (named form).")
    sampling_session_id: str | None = Field(default=None, description="Ephemeral sampler id (unnamed form).")


class SaveWeightsExternalResponse(_Response):
    path: str = Field(description="treadle://<run_id>/external_weights/<name>: files to download with signed URLs.")
    size_bytes: int | None = Field(default=None, description="Bytes stored (ciphertext when encrypted).")


class LoadWeightsResponse(_Response):
    path: str | None = None
    model_id: str | None = None


class ModelData(_Response):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(_Response):
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int | None = None
    model_name: str | None = None


class SupportedModel(_Response):
    model_name: str
    max_context_length: int | None = None


class ServerCapabilities(_Response):
    supported_models: list[SupportedModel] = Field(default_factory=list)


class Checkpoint(_Response):
    checkpoint_id: str = Field(description="`weights/<name>` or `sampler_weights/<name>`.")
    checkpoint_type: Literal["training", "sampler"]
    time: float = Field(description="Creation time, seconds since the epoch.")
    treadle_path: str
    size_bytes: int | None = None
    expires_at: float | None = None


class TrainingRun(_Response):
    training_run_id: str
    base_model: str
    is_lora: bool = True
    lora_rank: int | None = None
    created_at: float | None = None
    user_metadata: dict[str, str] | None = None


class WeightsInfo(_Response):
    base_model: str
    is_lora: bool = True
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
