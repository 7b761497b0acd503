"""The six training losses, as a registry: name -> `LossFn`.

Semantics are Tinker's: every loss is a **sum over tokens** (never a mean; normalisation belongs in
the weights or advantages), over inputs that are already shifted (`target_tokens[t]` is the token
after `model_input[t]`). `lp` is the learner's logprob of each target token; `q` is the sampler's
logprob (`loss_fn_inputs["logprobs"]`); `A` is the advantage; `r = exp(lp - q)`.

cross_entropy also takes top-k soft targets: `target_tokens` and `weights` of shape `[N, K]` (K tokens a
position, e.g. a teacher's top-k with their probabilities), whose loss is the weighted sum over the K
targets of each position, `-(lp * weights).sum()` with `lp` of shape `[N, K]` too. K = 1 is the 1-D loss.

Because every loss is a sum of per-token terms, a function here receives the tokens (and a position's K
targets) of a whole micro-batch flattened into 1-D tensors, and summing micro-batch losses gives the batch loss exactly.
A loss whose terms depend on a whole sequence (gspo) says so (`per_sequence`): it then also gets
`sequence_index`, the datum each token belongs to (a datum never straddles micro-batches).

Not here, on purpose: `stable_reinforce` (its objective is not published, so treadle will not serve
a guess under its name) and `custom` (uploaded server-side losses); `treadle.types.UNSERVED_LOSSES`
says why and what to use instead.

Adding a loss: write the function, add a `LossSpec` row to `LOSSES` (its required inputs and its
parameters: a `LossConfig` in `treadle.types.LOSS_CONFIGS`), add its name to `treadle.types.LossFnType`
(a test pins that the three agree), and a hand-computed row to tests/test_losses.py. If a 0 in one of its
inputs makes a token's gradient exactly 0 (an advantage, a weight), name that input as its `gradient_gate`
and add the loss to tests/test_gradient_gate.py: the trainer then differentiates only the other positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from treadle.types import CISPOConfig, DROConfig, GSPOConfig, LossConfig, PPOConfig

LossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]


def cross_entropy(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """Weighted negative log-likelihood: `-(lp * weights).sum()`; weight 0 masks a token out. With `[N, K]`
    targets, `lp` and `weights` hold every position's K targets, so the sum runs over them too."""
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


def gspo(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """GSPO-token: each token carries its sequence's ratio s with its own lp's gradient, clipped like ppo.

    `s = exp(mean(lp - q))` over the tokens `sequence_ratio_mask` marks (treated as a constant), and a
    token's ratio is `s * exp(lp - sg(lp))`: value s, derivative s in its own lp. Loss:
    `-min(s_t*A, clip(s_t, lo, hi)*A).sum()`. A sequence with no marked token has s = 1.
    """
    seq, marked = inputs["sequence_index"], (inputs["sequence_ratio_mask"] != 0).to(lp.dtype)
    count = seq.max().item() + 1
    log_ratio = (lp.detach() - inputs["logprobs"]) * marked
    sums = torch.zeros(count, dtype=lp.dtype, device=lp.device).index_add_(0, seq, log_ratio)
    sizes = torch.zeros(count, dtype=lp.dtype, device=lp.device).index_add_(0, seq, marked).clamp(min=1.0)
    ratio = torch.exp((sums / sizes)[seq] + lp - lp.detach())
    advantages = inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


@dataclass(frozen=True)
class LossSpec:
    """A loss with what it needs: per-token input keys (besides `target_tokens`) and config defaults."""

    fn: LossFn
    inputs: tuple[str, ...]
    config: type[LossConfig] = LossConfig  # the parameters' defaults and bounds (treadle.types.LOSS_CONFIGS)
    per_sequence: bool = False  # also give the function `sequence_index` (datum of each token)
    columns: bool = False  # also takes `[N, K]` target_tokens and weights (K targets a position)
    # An input whose 0 at a position makes the loss's gradient there exactly 0 (A = 0 or weight 0: a prompt's
    # positions), so the trainer differentiates only the other positions; None: every position can have one.
    gradient_gate: str | None = None

    @property
    def config_defaults(self) -> dict[str, float]:
        return self.config().model_dump()


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), columns=True, gradient_gate="weights"),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages"), gradient_gate="advantages"),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), PPOConfig, gradient_gate="advantages"),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), CISPOConfig, gradient_gate="advantages"),
    # dro's quadratic pull towards q has a gradient wherever lp != q, whatever the advantage.
    "dro": LossSpec(dro, ("logprobs", "advantages"), DROConfig),
    "gspo": LossSpec(
        gspo,
        ("logprobs", "advantages", "sequence_ratio_mask"),
        GSPOConfig,
        per_sequence=True,
        gradient_gate="advantages",  # the sequence ratio reads every marked lp, but as a constant
    ),
}


def resolve_config(loss_fn: str, loss_fn_config: dict[str, float] | None) -> dict[str, float]:
    """The loss's defaults overridden by the request's config (keys already validated)."""
    return {**LOSSES[loss_fn].config_defaults, **{k: float(v) for k, v in (loss_fn_config or {}).items()}}
