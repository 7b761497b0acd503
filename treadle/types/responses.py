"""What treadle answers: sampled sequences, forward/backward outputs, checkpoints, runs and capabilities."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from treadle.types.base import _Response
from treadle.types.tensors import TensorData

StopReason = Literal["stop", "length"]


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
