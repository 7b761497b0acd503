"""Correctness telemetry: the sampler's logprobs against the training forward's, on live traffic.

RL trains on the logprobs the sampler reports; a sampler that disagrees with the trainer about the same
snapshot (a wrong KV cache, mask or position ids for a model family, a stale adapter) biases every
update quietly, and it shows only as a reward curve that sags. So for a fraction of sampled sequences
(`configure(fraction=...)`, the worker's `--logprob_audit_fraction`, small by default) the worker
recomputes the sequence's token logprobs with the training forward (`target_logprobs`, the helper
every loss uses) on the same snapshot, the adapter active and frozen, and reports the mean absolute gap
per token in nats: `treadle_sampler_logprob_gap{base_model}`, whose dashboard panel alerts above a
threshold. On a correct sampler it is float noise (about 1e-6 in fp32, 1e-2 in bf16).

Only sequences drawn from the model's own distribution are audited (temperature 1, no top-k or top-p):
for the others the sampler reports the processed distribution's logprobs, which the training forward
does not compute. The recomputation runs on a thread of its own, one forward per sequence under the
device lock like any other forward, never on the decode loop's path; when it falls behind, sequences
are dropped from the audit, never queued without bound.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from treadle.gpu_worker.training.logprobs import target_logprobs

log = logging.getLogger("treadle.sampler")

# Sequences waiting for their audit; past this many, new ones are skipped.
MAX_PENDING = 64


@dataclass
class _Settings:
    fraction: float = 0.0
    observe: Callable[[str, float], None] | None = None  # (base_model, mean |gap| in nats per token)


SETTINGS = _Settings()


def configure(*, fraction: float, observe: Callable[[str, float], None]) -> None:
    """Set by the worker before it builds its engines: the share of sampled sequences to audit, and where each
    gap goes (the Prometheus histogram)."""
    SETTINGS.fraction, SETTINGS.observe = fraction, observe


@dataclass(frozen=True)
class _Case:
    adapter: str | None
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


class LogprobAudit:
    """One per sampling scheduler: `consider(job)` when a sample request is answered."""

    def __init__(self, bank, host, device_lock, settings: _Settings = SETTINGS, rng: random.Random | None = None):
        self.bank, self.host, self.device_lock, self.settings = bank, host, device_lock, settings
        self._rng = rng or random.Random()
        self._pending: queue.Queue[_Case] = queue.Queue(MAX_PENDING)
        self._thread: threading.Thread | None = None

    def consider(self, job) -> None:
        """Pick this answered request's sequences for an audit, each with probability `fraction`."""
        params = job.params
        if (
            self.settings.fraction <= 0
            or params.temperature != 1.0
            or params.top_k not in (-1, 0)
            or params.top_p < 1.0
            or job.request.visual is not None  # the audit's forward scores token ids alone, not images
        ):
            return
        for sequence in job.sequences:
            if sequence is None or not sequence.tokens or sequence.logprobs is None:
                continue
            if self._rng.random() >= self.settings.fraction:
                continue
            try:
                self._pending.put_nowait(
                    _Case(
                        job.adapter,
                        np.asarray(job.request.prompt, dtype=np.int64),
                        np.asarray(sequence.tokens, dtype=np.int64),
                        np.asarray(sequence.logprobs, dtype=np.float64),
                    )
                )
            except queue.Full:
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"treadle-logprob-audit-{self.host.name}", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        while True:
            case = self._pending.get()
            try:
                gap = self.gap(case)
            except Exception:  # the snapshot was dropped meanwhile, or the forward failed: telemetry, not an op
                log.debug("logprob audit skipped", exc_info=True)
                continue
            if self.settings.observe is not None:
                self.settings.observe(self.host.name, gap)

    def _trained(self, adapter: str | None, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        """The training forward's logprobs of `targets` after each of `tokens`."""
        with torch.no_grad(), self.bank.using(adapter, trainable=False) as model:
            [row] = target_logprobs(
                model, [tokens], [targets], device=self.host.device, pad_token_id=self.host.pad_token_id
            )
        return row

    def gap(self, case: _Case) -> float:
        """Mean |sampler logprob - training-forward logprob| over the sequence's tokens (nats)."""
        tokens = np.concatenate([case.prompt, case.tokens])
        targets = np.concatenate([tokens[1:], [self.host.pad_token_id]])
        with self.device_lock:
            row = self.device_lock.run(self._trained, case.adapter, tokens, targets)
        trained = row[len(case.prompt) - 1 : len(tokens) - 1].double().cpu().numpy()
        return float(np.abs(trained - case.logprobs).mean())
