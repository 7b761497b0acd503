"""How to sample, step and adapt: SamplingParams, AdamParams, the losses and their parameters, LoraConfig."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import Field, field_validator, model_validator

from treadle.types.base import MAX_TOKENS_PER_SEQUENCE, SEED_MAX, TokenId, _Request

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
    train_vision: bool = Field(
        default=False,
        description="Also adapt the vision tower and its projector (vision-language models; frozen otherwise).",
    )

    @model_validator(mode="after")
    def _something_to_train(self) -> "LoraConfig":
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValueError("at least one of train_mlp, train_attn, train_unembed must be true")
        return self


class FullConfig(_Request):
    """A full fine-tuning session: every weight of the base model is trained (fp32 master weights and AdamW
    moments), or every weight but the embeddings."""

    train_embeddings: bool = Field(
        default=True,
        description="Train the input embeddings and the output projection (one matrix when the model ties them); "
        "false trains every other weight.",
    )
