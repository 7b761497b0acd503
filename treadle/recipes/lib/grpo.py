"""What a GRPO step of math_rl and code_rl shares: reading sampled groups oldest first, deciding by their
staleness whether each is trained on, requeued or discarded (`off_policy`), and the step's bookkeeping.

A recipe's `Rollouts` sample groups and know how a stale one is sampled again; `read_groups` yields
the groups a step trains on, each as soon as it is ready, so the recipe submits its forward_backward
before the next group is awaited. In sync mode exactly the step's groups are
sampled, all by the current policy; in async mode `async_in_flight` groups are kept sampling while the
trainer trains, so a group may come from a policy some steps old.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Iterator, Protocol, Self, Sequence, TypeVar

from treadle.recipes.lib.advantages import group_advantages, is_informative
from treadle.recipes.lib.loop import GroupRLConfig, Run
from treadle.recipes.lib.off_policy import Action, ProblemStream, staleness, staleness_action
from treadle.recipes.lib.run_log import RunLog


class SampledGroup(Protocol):
    """A group as `read_groups` sees it: its problem, the policy version that sampled it, what to log of it."""

    @property
    def problem_index(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    def details(self) -> dict[str, Any]:
        """What rollouts.jsonl records of the group beside its staleness and the action taken."""
        ...


G = TypeVar("G", bound=SampledGroup)


class Pending(Protocol):
    """A group being sampled: at least the index of its problem in the stream."""

    @property
    def index(self) -> int: ...


P = TypeVar("P", bound=Pending)


@dataclass(kw_only=True)
class Rollouts(ABC, Generic[P, G]):
    """The sampling side of a GRPO loop: the snapshot being sampled and its version (the step that made it), the
    problems to sample next, and the groups being sampled, oldest first. A recipe says how a group is sampled
    (`submit`), how it is read (`next_group`) and how a stale one is sampled again (`requeue`)."""

    sampler: Any
    version: int
    stream: ProblemStream
    async_in_flight: int  # async mode: groups kept being sampled
    in_flight: deque[P] = field(default_factory=deque)

    @classmethod
    def of_run(cls, run: Run, async_in_flight: int, **own: Any) -> Self:
        """Rollouts that sample the run's current weights (version: the last step it ran) and continue its problem
        stream; `own` are the recipe's own fields."""
        return cls(
            sampler=run.training.save_weights_and_get_sampling_client(),
            version=run.step - 1,
            stream=ProblemStream.at(run.position),
            async_in_flight=async_in_flight,
            **own,
        )

    @abstractmethod
    def submit(self, index: int) -> P:
        """Start sampling a group of problem `index` from the current snapshot: a future, not a wait."""

    @abstractmethod
    def next_group(self) -> G:
        """Wait for the oldest group being sampled (taken out of `in_flight`) and grade it."""

    @abstractmethod
    def requeue(self, group: G) -> None:
        """Have a stale group's problem sampled again by the current policy."""

    def top_up(self, target: int) -> None:
        """Keep `target` groups being sampled (requeued problems first)."""
        while len(self.in_flight) < target:
            self.in_flight.append(self.submit(self.stream.next_index()))

    def position(self) -> dict[str, Any]:
        """What a checkpoint saves to continue the problem stream (the groups in flight are sampled again)."""
        return self.stream.position([g.index for g in self.in_flight])


@dataclass
class GroupTally:
    """How the groups one step read went: what was done with each (`skipped`: used, but every reward equal),
    the staleness of those used, the tokens trained on, and the time spent waiting for groups."""

    counts: dict[str, int] = field(default_factory=lambda: {"use": 0, "requeue": 0, "discard": 0, "skipped": 0})
    stalenesses: list[int] = field(default_factory=list)
    tokens: int = 0
    sample_wait: float = 0.0

    @property
    def used(self) -> int:
        return self.counts["use"]

    def advantages(self, rewards: Sequence[float], normalize_std: bool) -> list[float] | None:
        """The group's advantages, or None (counted as skipped) when they are all zero: it has nothing to teach."""
        advantages = group_advantages(rewards, normalize_std)
        if is_informative(advantages):
            return advantages
        self.counts["skipped"] += 1
        return None

    def metrics(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "groups/used": self.counts["use"],
            "groups/skipped_uniform": self.counts["skipped"],
            "groups/requeued": self.counts["requeue"],
            "groups/discarded": self.counts["discard"],
            "async/staleness_max": max(self.stalenesses),
            "async/staleness_mean": sum(self.stalenesses) / len(self.stalenesses),
            "time/sample_wait": self.sample_wait,
        }


def read_groups(
    rollouts: Rollouts[Any, G], tally: GroupTally, cfg: GroupRLConfig, *, log: RunLog, step: int
) -> Iterator[G]:
    """The groups step `step` trains on, oldest first, until `groups_per_batch` are used. A group staler than
    `max_steps_off_policy` is requeued or discarded (`stale_policy`); each group read gets a rollouts.jsonl row."""
    while tally.used < cfg.groups_per_batch:
        rollouts.top_up(cfg.groups_per_batch - tally.used if cfg.mode == "sync" else rollouts.async_in_flight)
        waited = time.monotonic()
        group = rollouts.next_group()
        tally.sample_wait += time.monotonic() - waited
        action: Action = staleness_action(
            group.policy_version, rollouts.version, cfg.max_steps_off_policy, cfg.stale_policy
        )
        tally.counts[action] += 1
        lag = staleness(group.policy_version, rollouts.version)
        row = {
            "problem_index": group.problem_index,
            "policy_version": group.policy_version,
            "trained_at_version": rollouts.version,
            "staleness": lag,
            "action": action,
            **group.details(),
        }
        log.append("rollouts.jsonl", step, row)
        if action == "requeue":
            rollouts.requeue(group)
        if action == "use":
            tally.stalenesses.append(lag)
            yield group
