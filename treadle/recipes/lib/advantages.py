"""GRPO advantages and the KL penalty, both computed from rewards on the client.

GRPO samples a group of K completions per prompt and scores each against its own group: the
advantage is the reward minus the group mean (optionally divided by the group's std, as in the
GRPO paper; the Tinker cookbook leaves it off). A group whose rewards are all equal teaches nothing
and is skipped. The KL penalty, as in the cookbook, goes into the reward rather than the loss.
"""

from __future__ import annotations

import math
from typing import Sequence


def group_advantages(rewards: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Reward minus the group mean (divided by the group's std if `normalize_std`)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def is_informative(advantages: Sequence[float]) -> bool:
    """False when every advantage is zero: the group would add nothing but compute."""
    return any(a != 0.0 for a in advantages)


def kl_sample_ref(sampler_logprobs: Sequence[float], reference_logprobs: Sequence[float]) -> float:
    """Monte-Carlo estimate of KL(policy || reference) over one completion: sum of (log p - log p_ref)."""
    if len(sampler_logprobs) != len(reference_logprobs):
        raise ValueError(f"{len(sampler_logprobs)} sampler logprobs but {len(reference_logprobs)} reference logprobs")
    return float(sum(p - r for p, r in zip(sampler_logprobs, reference_logprobs)))


def kl_penalized_reward(reward: float, kl: float, coef: float) -> float:
    """Reward minus `coef` times the completion's KL estimate against the reference policy."""
    return reward - coef * kl
