"""The five training losses, as a registry: name -> `LossFn`.

Semantics are Tinker's: every loss is a **sum over tokens** (never a mean; normalisation belongs in
the weights or advantages), over inputs that are already shifted (`target_tokens[t]` is the token
after `model_input[t]`). `lp` is the learner's logprob of each target token; `q` is the sampler's
logprob (`loss_fn_inputs["logprobs"]`); `A` is the advantage; `r = exp(lp - q)`.

Because every loss is a sum of per-token terms, a function here receives the tokens of a whole
micro-batch flattened into 1-D tensors, and summing micro-batch losses gives the batch loss exactly.

Adding a loss: write the function, add a `LossSpec` row to `LOSSES` (its required inputs and its
config defaults), add its name to `treadle.types.LossFnType` (a test pins that the two agree), and a hand-computed row to
tests/test_losses.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

LossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]


def cross_entropy(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """Weighted negative log-likelihood: `-(lp * weights).sum()`; weight 0 masks a token out."""
    return -(lp * inputs["weights"]).sum()


def importance_sampling(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """Off-policy policy gradient: `-(exp(lp - q) * A).sum()`."""
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """Clipped surrogate: `-min(r*A, clip(r, lo, hi)*A).sum()` with lo/hi in ratio space."""
    ratio = torch.exp(lp - inputs["logprobs"])
    advantages = inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def cispo(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """Clipped importance-sampling policy optimisation: the clipped ratio is a constant weight on `lp * A`."""
    ratio = torch.exp(lp - inputs["logprobs"])
    weight = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(weight * lp * inputs["advantages"]).sum()


def dro(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """Direct reward optimisation: `-(lp*A - 0.5*beta*(lp - q)**2).sum()` (a quadratic pull towards q)."""
    q = inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * (lp - q) ** 2).sum()


@dataclass(frozen=True)
class LossSpec:
    """A loss with what it needs: per-token input keys (besides `target_tokens`) and config defaults."""

    fn: LossFn
    inputs: tuple[str, ...]
    config_defaults: dict[str, float] = field(default_factory=dict)


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",)),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages")),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    # Tinker documents beta without a default; 0.05 is the value of its examples.
    "dro": LossSpec(dro, ("logprobs", "advantages"), {"beta": 0.05}),
}


def resolve_config(loss_fn: str, loss_fn_config: dict[str, float] | None) -> dict[str, float]:
    """The loss's defaults overridden by the request's config (keys already validated)."""
    return {**LOSSES[loss_fn].config_defaults, **{k: float(v) for k, v in (loss_fn_config or {}).items()}}
