"""The vLLM sampler backend: one vLLM engine per base model, in a child process with its own venv.

Why a child process: vLLM's pins (transformers, numpy, torch, fastapi) do not resolve beside the
worker's; see `server`. The child is started with the worker's engine and loads the same base
model, in the same dtype, on the same device; requests and answers cross a socketpair as JSON lines.

Each sampler snapshot is written once, on first use, to a local directory in PEFT format and sent as
a vLLM `LoRARequest` (the base model: no LoRA). vLLM keeps at most `max_loras` adapters in one
batch and `max_cpu_loras` loaded, evicting the least recently used; a dropped snapshot is removed
from vLLM and from disk once no request in flight needs it. A snapshot is a file, so training that
goes on never changes what it samples.

What the contract promises and how it is kept:
- logprobs of the distribution sampled from: the engine runs with `logprobs_mode="processed_logprobs"`
  (after temperature, top-k, top-p); at temperature 0 that distribution is a point mass, so 0.0 is
  reported, as the HF backend does (vLLM would give the raw logprob);
- per sampled token, the top-k of that same distribution (`topk_sample_logprobs`, vLLM's `logprobs=k`),
  the tokens it excludes left out: one entry, the token with 0.0, at temperature 0;
- stops exactly where the HF backend stops: `ignore_eos` with the tokenizer's EOS among the stop ids,
  so a model's generation_config cannot add stop tokens; the stopping token is kept;
- no sampling default from the model's generation_config (`generation_config="vllm"`);
- per-request seeds (vLLM seeds the k-th of `n` samples with seed + k);
- prompt logprobs (raw, like `compute_logprobs`) and top-k prompt logprobs up to `max_logprobs`;
  more, or a snapshot of a rank above `max_lora_rank`, is refused with an error naming the option.
The tokens drawn for a seed are not those the HF backend draws for it (another RNG and kernel order).

A streamed request (`SampleJob.stream`) gets its rows' tokens as vLLM draws them, step by step, and its client's
cancel aborts it in vLLM, which frees its rows (`link.EngineLink`).

A child that dies is started again and given the requests it had not answered (`link.EngineLink`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import numpy as np
from pydantic import BaseModel, Field

from treadle.errors import InvalidRequestError, ServerError
from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.backend import LogprobJob, SampleJob, TokenStream
from treadle.gpu_worker.sampling.vllm.link import EngineLink, EngineProcess
from treadle.gpu_worker.model.host import ModelHost
from treadle.queue.sample_options import MAX_TOPK_SAMPLE_LOGPROBS
from treadle.types import SampledSequence, SampleResponse

log = logging.getLogger("treadle.sampler.vllm")

SERVER = Path(__file__).with_name("server.py")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


class VllmOptions(BaseModel):
    """How the worker runs its vLLM engines (one per base model)."""

    python: str | None = Field(
        default=None,
        description="Interpreter of vLLM's venv (default: $TREADLE_VLLM_PYTHON, else .venv-vllm/bin/python of the checkout).",
    )
    max_lora_rank: int = Field(
        default=32,
        ge=1,
        le=512,
        description="Largest LoRA rank a snapshot may have (rounded up to vLLM's 1, 8, 16, 32, 64, ...); larger ones are refused.",
    )
    max_loras: int = Field(default=4, ge=1, description="Adapters that can share one vLLM batch (GPU slots).")
    max_cpu_loras: int = Field(
        default=16, ge=1, description="Adapters kept loaded in vLLM, least recently used out first."
    )
    max_logprobs: int = Field(
        default=64,
        ge=0,
        description="Most top-k prompt logprobs one request may ask for (a sampled token's top-k, at most "
        f"{MAX_TOPK_SAMPLE_LOGPROBS}, is served whatever this is).",
    )
    gpu_memory_share: float = Field(
        default=0.3,
        gt=0.0,
        lt=1.0,
        description="Share of the GPU's memory vLLM takes (weights, KV cache, activations); the trainer needs the rest.",
    )
    cpu_kv_cache_gib: int = Field(default=1, ge=1, description="On CPU, the KV cache vLLM allocates, in GiB.")


def vllm_python(options: VllmOptions) -> str | None:
    """The interpreter to run the engine with, or None if no vLLM installation is found."""
    candidates = [
        options.python,
        os.environ.get("TREADLE_VLLM_PYTHON"),
        str(Path(__file__).resolve().parents[4] / ".venv-vllm" / "bin" / "python"),
    ]
    for path in candidates:
        if path and Path(path).is_file():
            found = subprocess.run(
                [path, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                capture_output=True,
            )
            if found.returncode == 0:
                return path
    return None


class VllmSampler:
    """`SamplerBackend` over a vLLM engine in a child process (see the module docstring)."""

    path = "vllm"

    def __init__(self, bank: AdapterBank, host: ModelHost, options: VllmOptions):
        python = vllm_python(options)
        if python is None:
            raise ServerError("sampler vllm: no vLLM found; run scripts/setup_vllm.sh or set TREADLE_VLLM_PYTHON")
        self.bank, self.host, self.options = bank, host, options
        self.max_lora_rank = next(r for r in VLLM_LORA_RANKS if r >= options.max_lora_rank)
        self._dir = Path(tempfile.mkdtemp(prefix="treadle-vllm-"))
        self._loras: dict[str, dict] = {}  # adapter -> its LoRARequest fields, once written
        self._lora_ids = itertools.count(1)
        argv = [python, str(SERVER), json.dumps(self._engine_args())]
        what = f"sampler vllm: engine for {host.name}"
        self._link = EngineLink(lambda: EngineProcess(argv, self._env(), what), host.name, self._retire)
        log.info("vLLM engine for %s ready (pid %d, %s)", host.name, self._link.process_id, python)

    def _engine_args(self) -> dict:
        return dict(
            model=self.host.name,
            dtype=str(self.host.dtype).removeprefix("torch."),
            seed=0,
            max_model_len=self.host.max_seq_len,
            enable_lora=True,
            max_lora_rank=self.max_lora_rank,
            max_loras=self.options.max_loras,
            max_cpu_loras=max(self.options.max_cpu_loras, self.options.max_loras),
            # Sample-side top-k up to treadle's own bound (`SampleRequest`), whatever the prompt-side limit.
            max_logprobs=max(self.options.max_logprobs, MAX_TOPK_SAMPLE_LOGPROBS),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            gpu_memory_utilization=self.options.gpu_memory_share,
            # Prompt logprobs cannot come from cached prefixes; on CPU, eager mode skips torch.compile at start.
            enable_prefix_caching=False,
            enforce_eager=self.host.device.type != "cuda",
            # On CPU a seeded request whose prompt is prefilled in chunks fails the step: vLLM 0.32 rewinds
            # its generator with get_offset, which CPU generators lack. So there, whole prompts only.
            **({} if self.host.device.type == "cuda" else {"enable_chunked_prefill": False}),
        )

    def _env(self) -> dict:
        # No usage statistics: vLLM would otherwise report to its makers' server from a worker.
        env = dict(
            os.environ,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE=str(self.options.cpu_kv_cache_gib),
            VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        env.pop("PYTHONPATH", None)  # the child runs in its own venv, not on the worker's path
        env["CUDA_VISIBLE_DEVICES"] = str(self.host.device.index or 0) if self.host.device.type == "cuda" else ""
        return env

    # ------------------------------------------------------------ SamplerBackend

    def sample(self, job: SampleJob) -> Future:
        """Queue a sample request; the future resolves to its `SampleResponse`."""
        # vLLM scores no target ids and draws nothing from a prompt; each sampled token's top-k it serves.
        job.extras.refuse_prompt_side("the vllm sampler backend")
        if job.request.visual is not None:  # treadle's adapters reach vLLM as text-only LoRA requests
            raise InvalidRequestError(
                "prompt: image chunks are not served by the vllm sampler backend; run --sampler hf"
            )
        params = job.params
        # Prompt logprobs go as a request of their own: vLLM 0.32 fails the engine step that computes
        # them for a request of n > 1, and they do not depend on what is sampled.
        prompt_part = None
        if job.include_prompt_logprobs or job.topk_prompt_logprobs > 0:
            prompt_part = self.compute_logprobs(LogprobJob(job.adapter, job.request.prompt, job.topk_prompt_logprobs))
        greedy = params.temperature == 0
        # vLLM takes no n > 1 at temperature 0; greedy rows are all the same row, so one is drawn and repeated.
        rows, k = job.num_samples, job.extras.topk_sample_logprobs
        request = {
            "n": 1 if greedy else rows,
            "max_tokens": job.request.max_tokens,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop": job.request.stop_strings,
            "stop_token_ids": sorted(job.stop_ids),
            "ignore_eos": True,
            "logprobs": 0 if greedy else k,  # a point mass's top-k is its token: vLLM's would be the raw logprobs
        }

        def convert(answer: dict) -> SampleResponse:
            drawn = answer["sequences"] * (rows if greedy else 1)
            return SampleResponse(sequences=[_sequence(s, greedy, k) for s in drawn])

        stream = job.stream if job.stream is None or not greedy else _PointMass(job.stream, rows, k > 0)
        samples = self._submit(job.adapter, job.request.prompt.tolist(), request, convert, stream)
        if prompt_part is None:
            return samples
        combined: Future = Future()

        def finish(_) -> None:  # runs once, after both parts are done
            error = samples.exception() or prompt_part.exception()
            if error is not None:
                combined.set_exception(error)
                return
            prompt, top = prompt_part.result()
            combined.set_result(
                samples.result().model_copy(
                    update={
                        "prompt_logprobs": prompt if job.include_prompt_logprobs else None,
                        "topk_prompt_logprobs": top,
                    }
                )
            )

        samples.add_done_callback(lambda _: prompt_part.add_done_callback(finish))
        return combined

    def compute_logprobs(self, job: LogprobJob) -> Future:
        """Queue a prompt-logprobs request; the future resolves to (logprobs, top-k or None)."""
        topk, adapter = job.topk, job.adapter
        self._check_topk(topk)
        prompt = np.asarray(job.tokens, dtype=np.int64).tolist()
        if len(prompt) >= self.host.max_seq_len:
            raise InvalidRequestError(
                f"prompt: length {len(prompt)}; the vLLM sampler scores at most "
                f"{self.host.max_seq_len - 1} tokens (it needs room to sample one)"
            )
        request = {"n": 1, "max_tokens": 1, "temperature": 1.0, "logprobs": 0, "prompt_logprobs": topk}
        return self._submit(
            adapter, prompt, request, lambda answer: _prompt_logprobs(prompt, answer["prompt_logprobs"], topk)
        )

    def when_unused(self, adapter: str | None, callback: Callable[[], None]) -> None:
        """Run `callback` once no request in flight uses `adapter`; vLLM forgets the adapter too."""
        self._link.when_unused(adapter, callback)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine process; requests not answered yet fail with a ServerError."""
        self._link.close(timeout)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------ internals

    def _check_topk(self, topk: int) -> None:
        if topk > self.options.max_logprobs:
            raise InvalidRequestError(
                f"topk_prompt_logprobs: {topk} exceeds the vLLM sampler's limit "
                f"{self.options.max_logprobs} (worker option --vllm_max_logprobs)"
            )

    def _lora(self, adapter: str | None) -> dict | None:
        """The adapter's LoRARequest fields, its PEFT directory written on first use (the caller holds
        the engine's lock, so the tensors are read between training ops)."""
        if adapter is None:
            return None
        if adapter not in self._loras:
            rank = self.bank.config(adapter).r
            if rank > self.max_lora_rank:
                raise InvalidRequestError(
                    f"lora rank: {rank} exceeds the vLLM sampler's max_lora_rank {self.max_lora_rank} "
                    "(worker option --vllm_max_lora_rank)"
                )
            path = self._dir / adapter
            self.bank.save(adapter, path)
            self._loras[adapter] = {"name": adapter, "id": next(self._lora_ids), "path": str(path)}
        return self._loras[adapter]

    def _submit(
        self, adapter: str | None, prompt: list[int], params: dict, convert: Callable, stream: TokenStream | None = None
    ) -> Future:
        lora = self._lora(adapter)
        message = {"op": "sample", "prompt": prompt, "params": params, "lora": lora}
        return self._link.submit(message, convert, adapter, stream)

    def _retire(self, adapter: str | None, callback: Callable[[], None]) -> None:
        callback()
        lora = self._loras.pop(adapter, None)
        if lora is None:
            return  # never sampled with vLLM
        self._link.notify({"op": "remove_lora", "lora_id": lora["id"]})
        shutil.rmtree(lora["path"], ignore_errors=True)


class _PointMass:
    """A greedy request's `TokenStream`: vLLM draws its one row, which goes out as each of the request's `rows`, its
    tokens' logprobs as 0.0 (and their top-k, when asked for, as the token alone), as its answer gives them."""

    def __init__(self, stream: TokenStream, rows: int, topk: bool):
        self._stream, self._rows, self._topk = stream, rows, topk

    def drew(self, row: int, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        for copy in range(self._rows):
            self._stream.drew(copy, token, 0.0, [(token, 0.0)] if self._topk else None)

    @property
    def cancelled(self) -> bool:
        return self._stream.cancelled

    def dropped(self, tokens: list[int], rows_left: int) -> None:
        self._stream.dropped(tokens * self._rows, rows_left)


def _sequence(answer: dict, greedy: bool, k: int) -> SampledSequence:
    """One of the engine's sequences as the contract's: a greedy row's logprobs are a point mass's."""
    tokens = answer["tokens"]
    if greedy:
        logprobs, top = [0.0] * len(tokens), [[(t, 0.0)] for t in tokens] if k else None
    else:
        logprobs, top = answer["logprobs"], [[(t, lp) for t, lp in step] for step in answer["top"]] if k else None
    return SampledSequence(
        tokens=tokens, logprobs=logprobs, stop_reason=_stop_reason(answer["finish_reason"]), topk_logprobs=top
    )


def _stop_reason(finish_reason: str) -> str:
    if finish_reason not in ("stop", "length"):
        raise ServerError(f"vLLM finished a sequence with {finish_reason!r}")
    return finish_reason


def _prompt_logprobs(prompt: list[int], steps: list | None, topk: int):
    """vLLM's per-position entries ([token, logprob, rank] of the prompt token and the top-k) as the
    contract's (logprob of each prompt token, top-k pairs by rank or None); entry 0 is None."""
    if steps is None:
        return None, None
    chosen: list[float | None] = [None]
    top: list | None = [None] if topk else None
    for token, step in zip(prompt[1:], steps[1:]):
        entries = {t: (lp, rank) for t, lp, rank in step}
        chosen.append(entries[token][0])
        if topk:
            ranked = sorted((rank, t, lp) for t, (lp, rank) in entries.items() if rank <= topk)
            top.append([(t, lp) for _, t, lp in ranked])
    return chosen, top
