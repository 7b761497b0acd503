"""The sampler-backend protocol and the types every backend shares: what an engine asks of any sampler.

A backend takes validated `SampleJob`s and `LogprobJob`s and answers each with a future; it keeps one
contract (tests/test_sampler_contract.py runs the same suite against each): logprobs of the distribution
sampled from, per-request seeds, stop strings and ids with the stopping token kept, `num_samples` rows per
request, prompt logprobs and their top-k, frozen snapshots. Which backends exist, and which one an engine
gets, is `treadle/gpu_worker/sampling/registry.py`; nothing here names one.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.extras import SampleExtras
from treadle.gpu_worker.training.validation import PreparedSample
from treadle.types import SampledSequence, SampleResponse, SamplingParams


class TokenStream(Protocol):
    """Where a streamed request's rows report each token as they draw it, and how its client's cancel reaches the
    sampler (treadle.gpu_worker.executor.sample_stream publishes both through Redis). Called on the decode thread:
    each call only hands its values on."""

    def drew(self, row: int, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        """Sample `row` drew `token` (with its logprob, and its top-k when the request asks for them)."""

    @property
    def cancelled(self) -> bool:
        """Whether the client went away: the sampler then drops the request's rows at its next step boundary."""

    def dropped(self, tokens: list[int], rows_left: int) -> None:
        """The request's rows left the batch on a cancel, each having drawn `tokens[i]`; `rows_left` remain."""


@dataclass
class SampleJob:
    """One `sample` request: `num_samples` rows sharing a prompt, an adapter (None: base) and an RNG.

    The fields after `generator` are the answer as a backend fills it in."""

    adapter: str | None
    request: PreparedSample
    num_samples: int
    params: SamplingParams
    stop_ids: frozenset[int]
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    extras: SampleExtras = field(default_factory=SampleExtras)
    tenant: str = ""  # whom its device time is charged to (treadle.gpu_worker.scheduling.device_lock); "": the adapter
    stream: TokenStream | None = None  # where its tokens go as they are drawn (None: only the answer)
    generator: torch.Generator | None = None
    sequences: list[SampledSequence | None] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    topk: list[list[tuple[int, float]] | None] | None = None
    prompt_extras: dict = field(default_factory=dict)  # target_prompt_logprobs / prompt_alt_tokens, from the prefill

    @property
    def done(self) -> bool:
        return all(s is not None for s in self.sequences)

    def response(self) -> SampleResponse:
        return SampleResponse(
            sequences=list(self.sequences),
            prompt_logprobs=self.prompt_logprobs if self.include_prompt_logprobs else None,
            topk_prompt_logprobs=self.topk,
            **self.prompt_extras,
        )


@dataclass
class LogprobJob:
    """One `compute_logprobs` request: the prompt's token logprobs under an adapter (None: base).

    Its future resolves to (logprobs with entry 0 None, the top-k of each position or None)."""

    adapter: str | None
    tokens: np.ndarray
    topk: int = 0
    future: Future = field(default_factory=Future)


@dataclass(frozen=True)
class SamplerSetup:
    """What a backend is built from: the engine's model, its adapters, the device it shares with training, the batch
    budgets, and what the model's profile (`treadle/gpu_worker/model_profile.py`) says each backend can do with it."""

    bank: AdapterBank
    host: ModelHost
    device_lock: DeviceLock
    max_batch_tokens: int
    max_forward_tokens: int
    hf_batching: str  # how the hf backend batches the model's adapters
    static_decode: str  # "yes..." if the hf backend's static-shape decode steps serve the model, else "no: why"
    vllm_serves: str  # "yes" if the vllm backend serves the model's family, else why not
    prefix_cache_tokens: int = 16384  # KV positions kept for prompts to resume from (hf: `prefix_cache`; 0: none)


class SamplerBackend(Protocol):
    """What an engine needs from any sampler."""

    path: str  # how this backend samples the model, as `treadle status` and `treadle models check` show it

    def sample(self, job: SampleJob) -> Future:
        """Queue a sample request (validated already); the future resolves to its `SampleResponse`."""

    def compute_logprobs(self, job: LogprobJob) -> Future:
        """Queue a prompt-logprobs request (validated already); the future resolves as `LogprobJob` says."""

    def when_unused(self, adapter: str | None, callback: Callable[[], None]) -> None:
        """Run `callback` (which removes the adapter) once no queued or running request needs it."""

    def close(self, timeout: float = 30.0) -> None:
        """Stop; requests not answered yet fail with a ServerError."""
