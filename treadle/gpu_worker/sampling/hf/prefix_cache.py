"""Keys and values of token sequences already run, kept per snapshot: a prompt that starts with tokens run
before on the same snapshot (or the base model) is prefilled only from where they end.

Two kinds of traffic start with tokens already run: the requests of a GRPO group sent one by one (the same
prompt again) and multi-turn conversations (turn k + 1's prompt is turn k's prompt, its answer and a new
message). So after each prefill the sampler keeps the prompt's keys and values and the logits after its
last token, and when a request of one sample ends (a conversation's turn) it keeps its row's keys and
values: the prompt and the answer but its last token, which no forward has run (on the dynamic decode
path, `batch_decode`; the static-shape path's rows live in slots, and only their prompts are kept). A
later prompt on the same adapter starts from the longest kept sequence it begins with (`longest`): all of
it when the whole prompt is kept with the logits after it (no forward at all), else up to its last token;
only the rest goes through the prefill (`prefill_plan.PrefillPlan`, which also prefills equal prompts
admitted together once).

Bit for bit: on a CPU a prefill computes each query as the decode step at its position would (3. in
`row_invariant`'s docstring), so a position's keys, values and logits are the same whether a whole
prefill, the prefill of a suffix over kept keys and values, or the decode steps that sampled an answer
computed them: a seeded request gives the same tokens and logprobs with and without reuse
(`tests/test_prefix_reuse.py`). On an accelerator no layout promises that, as for batching; there the
numbers agree to floating-point tolerance.

Not resumed (`unresumable`): models with linear-attention or recurrent states (Qwen3.5, Falcon-H1,
Nemotron-H: a state summarises the whole sequence, and the state at a prefix's end is not kept) and
mixture-of-experts models with 3-D expert tensors (gpt-oss, Qwen3-MoE, DeepSeek-V3: an expert's product
over the tokens routed to it sums in another order when their number changes, so a suffix prefill would
differ from a whole one in the last bits). Equal prompts admitted together are still prefilled once there.

Memory: at most `budget` kept positions (the worker's `--sampling_prefix_cache_tokens`), the least
recently used sequence dropped first. One position costs 2 x layers x kv_heads x head_dim x dtype bytes,
as a batch position does (46 KB for SmolLM2-135M in fp32: 16384 positions ~ 0.75 GB), and each kept
prompt also holds the logits after it (vocab x dtype bytes). Snapshots are frozen, so what is kept for
one stays valid until it leaves the bank; its sequences go with it (`SampleScheduler.when_unused`).
Training sessions' live adapters are never sampled, only their snapshots.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.hf import cache_rows

log = logging.getLogger("treadle.sampler")


@dataclass
class Kept:
    """One kept sequence: its tokens, its keys and values, and the logits after some of its prefixes."""

    tokens: np.ndarray
    kv: cache_rows.RowKV
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # prefix length -> logits of the next token

    def prefix(self, length: int) -> cache_rows.RowKV:
        """The keys and values of the first `length` tokens (views)."""
        return [None if kv is None else (kv[0][:, :length], kv[1][:, :length]) for kv in self.kv]


@dataclass
class _Settings:
    observe: Callable[[str, int, int], None] | None = None  # (base model, tokens prefilled, prompt tokens reused)


SETTINGS = _Settings()


def configure(*, observe: Callable[[str, int, int], None]) -> None:
    """Set by the worker before it builds its engines: where each admission's prefill counts go (the Prometheus
    counters treadle_sampler_prefill_tokens and treadle_sampler_prefix_reused_tokens)."""
    SETTINGS.observe = observe


def observe(model: str, prefilled: int, reused: int) -> None:
    if SETTINGS.observe is not None:
        SETTINGS.observe(model, prefilled, reused)


def unresumable(host: ModelHost) -> str | None:
    """Why prompts of this model cannot resume from kept keys and values, or None (the module docstring)."""
    if cache_rows.has_states(host.model.config):
        return "its linear-attention or recurrent states hold no prefix"
    if host.targets.experts:
        return "its expert products sum in another order for another number of tokens"
    return None


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """Kept sequences of every adapter of one base model, least recently used first, within `budget` positions.

    Used by the decode loop's thread only, under the device lock (`SampleScheduler.when_unused` drops a
    snapshot's sequences under it too)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0  # positions kept
        self._kept: OrderedDict[int, tuple[str | None, Kept]] = OrderedDict()
        self._ids = itertools.count()

    @classmethod
    def for_model(cls, host: ModelHost, budget: int) -> PrefixCache | None:
        """The cache of a model, or None when reuse is off (`budget` 0) or the model cannot resume."""
        why = unresumable(host)
        if why is not None and budget:
            log.info("sampler for %s: no prefix reuse (%s)", host.name, why)
        return cls(budget) if budget and why is None else None

    def __len__(self) -> int:
        return len(self._kept)

    def longest(self, adapter: str | None, prompt: np.ndarray) -> tuple[Kept | None, int]:
        """The kept sequence of `adapter` that serves most of `prompt`, and how many of its tokens: all of them
        when the whole prompt is kept with the logits after it, else at most all but the last."""
        best, reused, best_key = None, 0, None
        for key, (owner, kept) in self._kept.items():
            if owner != adapter:
                continue
            common = _common(kept.tokens, prompt)
            usable = common if common == len(prompt) and common in kept.logits else min(common, len(prompt) - 1)
            if usable > reused:
                best, reused, best_key = kept, usable, key
        if best_key is not None:
            self._kept.move_to_end(best_key)
        return best, reused

    def keep(
        self, adapter: str | None, tokens: np.ndarray, kv: cache_rows.RowKV, logits: dict[int, torch.Tensor]
    ) -> None:
        """Keep a sequence (`kv` copies of its own), with the logits after some of its prefixes. A sequence kept
        already inside a longer one only adds its logits there; kept ones it extends are replaced by it."""
        if len(tokens) > self.budget:
            return
        for key, (owner, kept) in list(self._kept.items()):
            if owner != adapter:
                continue
            common = _common(kept.tokens, tokens)
            if common == len(tokens):
                kept.logits.update(logits)
                self._kept.move_to_end(key)
                return
            if common == len(kept.tokens):
                logits = {**kept.logits, **logits}
                self._remove(key)
        while self.used + len(tokens) > self.budget:
            self._remove(next(iter(self._kept)))
        self._kept[next(self._ids)] = (adapter, Kept(tokens, kv, logits))
        self.used += len(tokens)

    def drop(self, adapter: str | None) -> None:
        """Forget every sequence kept for `adapter` (a snapshot leaving the bank)."""
        for key in [key for key, (owner, _) in self._kept.items() if owner == adapter]:
            self._remove(key)

    def _remove(self, key: int) -> None:
        _, kept = self._kept.pop(key)
        self.used -= len(kept.tokens)
