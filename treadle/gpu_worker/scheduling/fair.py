"""Fair turns: which tenant's work runs next on a shared worker, by measured cost.

A worker serves several sessions, often of several owners. When more than one has work ready, the
next turn goes to the one that has had the least service so far, counted in seconds of device time
divided by its weight (start-time fair queueing, the deficit round robin of variable-cost work): a
heavy op of 200 ms counts as ten light ones of 20 ms, so a tenant that pipelines heavy ops deeply
runs one of them, then whoever waits, then the next. A turn's cost is its work (an op's tokens) at
the measured rate of its kind of op, so identical work costs the same whoever does it.

The shares are two-level: owners first (an owner's weight from the worker's configuration, 1 by
default), then the sessions of the chosen owner. Every tag counts from a common clock, the tag of
the last turn given: a tenant that was idle rejoins at the clock, so idleness is never banked as
credit to spend later in a burst.

Used by the sequencer (training ops of owned sessions, under the worker's device lock) and by the
sampler's admission (sample requests of different snapshots, under the scheduler's lock). Pure Python,
no Redis, no torch, not thread-safe by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, cast

# The weight of each new measurement in an average (of a kind's rate, of a key's turn cost).
COST_SMOOTHING = 0.2


@dataclass
class ServiceTags:
    """Start-time fair tags of one level (owners, the sessions of one owner, the tenants of a device lock) and its
    clock: a key's tag is the service it has had, and one that was idle rejoins at the clock."""

    clock: float = 0.0
    tags: dict[Hashable, float] = field(default_factory=dict)
    served: dict[Hashable, int] = field(default_factory=dict)  # turn number of the last turn, for round-robin ties

    def tag(self, key: Hashable) -> float:
        return max(self.tags.get(key, self.clock), self.clock)

    def order(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Keys by the service they have had (least first); ties go to the one served longest ago."""
        return sorted(keys, key=lambda k: (self.tag(k), self.served.get(k, -1)))

    def charge(self, key: Hashable, cost: float, turn: int) -> None:
        self.tags[key] = self.tag(key) + cost
        self.served[key] = turn

    def advance(self, key: Hashable) -> None:
        """`key`'s turn has come: the clock moves to its tag, and keys behind the clock (which would rejoin at it
        anyway) are dropped, so a level that sees many keys come and go stays small."""
        self.clock = self.tag(key)
        for stale in [k for k, t in self.tags.items() if t < self.clock]:
            del self.tags[stale]
            self.served.pop(stale, None)


class FairShare:
    """`order(ready)` says who goes next; `charge(key, owner, seconds)` records a turn's measured cost."""

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})
        self._owners = ServiceTags()
        self._sessions: dict[str, ServiceTags] = {}
        self._turns = 0
        self.rate: dict[str, float] = {}  # seconds per unit of work, by kind (exponential averages)
        self.cost: dict[Hashable, float] = {}  # each key's average turn cost (seconds), for wait estimates

    def weight(self, owner: str) -> float:
        return self.weights.get(owner, 1.0)

    def order(self, ready: dict[Hashable, str]) -> list[Hashable]:
        """The ready keys (key -> owner) in the order their turns would come: the owner with the least
        weighted service first, then its sessions the same way; each owner's next key, owner by owner,
        round after round."""
        by_owner: dict[str, list[Hashable]] = {}
        for key, owner in ready.items():
            by_owner.setdefault(owner, []).append(key)
        queues = {o: self._level(o).order(keys) for o, keys in by_owner.items()}
        owner_tags = {o: self._owners.tag(o) for o in queues}
        result: list[Hashable] = []
        while queues:  # simulate the turns: each charges its owner the key's average cost
            owner = min(queues, key=lambda o: (owner_tags[o], self._owners.served.get(o, -1)))
            key = queues[owner].pop(0)
            result.append(key)
            owner_tags[owner] += self.cost.get(key, 0.0) / self.weight(owner)
            if not queues[owner]:
                del queues[owner]
        return result

    def pick(self, ready: dict[Hashable, str]) -> Hashable:
        """The key whose turn it is; the clocks move to its tags."""
        owner = cast(str, self._owners.order(set(ready.values()))[0])
        sessions = self._level(owner)
        key = sessions.order([k for k, o in ready.items() if o == owner])[0]
        self._owners.clock = self._owners.tag(owner)
        sessions.clock = sessions.tag(key)
        return key

    def charge(self, key: Hashable, owner: str, seconds: float, kind: str = "", units: int = 1) -> None:
        """A turn of `key` (of `owner`) took `seconds` of device time for `units` of work of one `kind` (an op's
        tokens). It is charged at the kind's average rate per unit, measured over every key's turns: on a shared
        host one op measures anywhere from 1x to 4x an identical one (a descheduled thread), and charging each
        its own figure let that noise tilt the shares by a quarter; a rate shared by all keys charges identical
        work identically, and a heavy op still many times a light one."""
        self._turns += 1
        units = max(1, units)
        before = self.rate.get(kind)
        rate = self.rate[kind] = (
            seconds / units if before is None else before + COST_SMOOTHING * (seconds / units - before)
        )
        cost = rate * units
        self._book(key, owner, cost)
        before = self.cost.get(key)
        self.cost[key] = cost if before is None else before + COST_SMOOTHING * (cost - before)

    def hold(self, key: Hashable, owner: str, seconds: float) -> None:
        """The device stood idle `seconds` for `key` (waiting for its next op): charged as they are, not at a rate,
        and not counted in its average turn cost."""
        self._turns += 1
        self._book(key, owner, seconds)

    def _book(self, key: Hashable, owner: str, cost: float) -> None:
        self._owners.charge(owner, cost / self.weight(owner), self._turns)
        self._level(owner).charge(key, cost, self._turns)

    def forget(self, keep: set) -> None:
        """Drop the state of keys not in `keep` (sessions this worker no longer owns)."""
        for level in self._sessions.values():
            for key in [k for k in level.tags if k not in keep]:
                del level.tags[key]
                level.served.pop(key, None)
        for key in [k for k in self.cost if k not in keep]:
            del self.cost[key]

    def _level(self, owner: str) -> ServiceTags:
        return self._sessions.setdefault(owner, ServiceTags())
