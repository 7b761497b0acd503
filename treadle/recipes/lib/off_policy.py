"""Staleness bookkeeping of asynchronous (off-policy) RL.

In async mode, rollouts keep being sampled while the trainer trains, so a group may have been
sampled by a policy that is already some optimizer steps old. A group sampled by policy version v
and trained on at version `current` is `current - v` steps off-policy. Up to `max_steps_off_policy`
it is used (the importance ratio exp(lp - q) corrects for the gap); beyond that it is either
discarded, or its problem is requeued to be sampled again by the current policy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

StalePolicy = Literal["requeue", "discard"]
Action = Literal["use", "requeue", "discard"]


@dataclass
class SampledCompletion:
    tokens: list[int]
    logprobs: list[float]
    reward: float
    text: str


@dataclass
class Group:
    """K completions of one prompt, and the policy version that sampled them."""

    problem_index: int
    prompt: list[int]
    completions: list[SampledCompletion]
    policy_version: int

    def details(self) -> dict[str, float]:
        """Its rollouts.jsonl details: the mean reward of its completions."""
        return {"reward_mean": sum(c.reward for c in self.completions) / len(self.completions)}


@dataclass
class ProblemStream:
    """Training problem indices to sample next: `pending` first (requeued ones, or those in flight at a
    checkpoint), then from `cursor`. A checkpoint saves both, so a resumed run continues the stream."""

    cursor: int = 0
    pending: deque[int] = field(default_factory=deque)

    def next_index(self) -> int:
        if self.pending:
            return self.pending.popleft()
        self.cursor += 1
        return self.cursor - 1

    def position(self, in_flight: list[int]) -> dict[str, object]:
        """What a checkpoint saves to continue the stream: groups `in_flight` are not part of the training
        state, so on resume their problems are sampled again, first."""
        return {"cursor": self.cursor, "pending": [*self.pending, *in_flight]}

    @classmethod
    def at(cls, position: dict) -> "ProblemStream":
        """The stream a checkpoint's `position` continues (a fresh run's is empty: from problem 0)."""
        return cls(position.get("cursor", 0), deque(position.get("pending", [])))


def staleness(group_version: int, current_version: int) -> int:
    return current_version - group_version


def staleness_action(
    group_version: int, current_version: int, max_steps_off_policy: int, stale_policy: StalePolicy
) -> Action:
    """What to do with a group sampled at `group_version` when the trainer is at `current_version`."""
    if staleness(group_version, current_version) <= max_steps_off_policy:
        return "use"
    return stale_policy
