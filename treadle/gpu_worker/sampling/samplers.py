"""An engine's samplers: which frozen snapshot serves which sampler id, and the one way in to its sampler backend.

A sampler is a name in the engine's `AdapterBank` that no training ever changes: a copy of a session's adapter (or of
a full session's weights), or an adapter directory loaded from the checkpoint store. The engine makes, loads, saves
and drops those snapshots (`Engine.snapshot_sampler`, `Engine.load_sampler`, ...: they change the device's weights,
and a device group's `GroupEngine` replicates them); here they are served. Sample and `compute_logprobs` requests on
one (or on the bare base model) are validated against the model, then queued to the backend (`backend.py`, chosen by
`registry.py`), which answers each with a future.

Queueing never waits for the device: it takes only the catalog lock (sampler ids), never the device lock, which every
decode step holds. A caller that takes both (a drop) takes the device lock first.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from treadle.errors import SessionNotFoundError
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.backend import LogprobJob, SampleJob, SamplerBackend, TokenStream
from treadle.gpu_worker.sampling.extras import SampleExtras
from treadle.gpu_worker.training.validation import check_tokens, prepare_sample
from treadle.types import ModelInput, SampleResponse, SamplingParams

# Bound on an in-process caller's wait for the sampler thread (which answers or fails every request).
LOCAL_WAIT_S = 600.0


class Samplers:
    """One engine's sampler ids (each the name of a frozen snapshot in its bank) and the backend that serves them."""

    def __init__(self, backend: SamplerBackend, host: ModelHost):
        self.backend = backend
        self._host = host
        self._adapters: dict[str, str] = {}  # sampler id -> adapter name
        self._catalog = threading.Lock()  # sampler ids; not the device lock, held by every decode step (sample_async)
        self._limits = dict(max_seq_len=host.max_seq_len, vocab_size=host.vocab_size, vision=host.vision)

    def add(self, sampler_id: str, adapter: str) -> None:
        """Serve the frozen snapshot `adapter` as `sampler_id`."""
        with self._catalog:
            self._adapters[sampler_id] = adapter

    def drop(self, sampler_id: str, then: Callable[[str], None]) -> None:
        """Serve the sampler no more; `then(adapter)` runs once no queued or running request needs its snapshot."""
        with self._catalog:
            adapter = self.adapter(sampler_id)
            del self._adapters[sampler_id]
            # Requests already queued or decoding keep the adapter until they are answered.
            self.backend.when_unused(adapter, lambda: then(adapter))

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self._adapters

    def adapter(self, sampler_id: str) -> str:
        """The sampler's snapshot: its name in the engine's `AdapterBank`."""
        if sampler_id not in self._adapters:
            raise SessionNotFoundError(f"sampler_id: no sampler {sampler_id!r} on base model {self._host.name}")
        return self._adapters[sampler_id]

    def sample_async(
        self,
        sampler_id: str | None,
        prompt: ModelInput,
        num_samples: int,
        params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        extras: SampleExtras = SampleExtras(),
        tenant: str = "",
        stream: TokenStream | None = None,
    ) -> Future:
        """Queue a sample request on a frozen sampler (None: base); the future resolves to its `SampleResponse`, whose
        logprobs are those of the distribution sampled from (`sampling/backend.py`). A rejected request raises here.
        Queueing never waits for the device. `tenant`: whom its device time counts for (`scheduling/device_lock.py`);
        `stream`: where its tokens go as they are drawn, and whence its client's cancel comes (None: neither)."""
        with self._catalog:
            adapter = self.adapter(sampler_id) if sampler_id is not None else None
            request = prepare_sample(prompt, num_samples, params, topk_prompt_logprobs, **self._limits)
            extras.check(self._host.vocab_size)
            stop_ids = frozenset({self._host.eos_token_id, *request.stop_token_ids})
            return self.backend.sample(
                SampleJob(
                    adapter,
                    request,
                    num_samples,
                    params,
                    stop_ids,
                    include_prompt_logprobs,
                    topk_prompt_logprobs,
                    extras,
                    tenant,
                    stream,
                )
            )

    def sample(self, *args, **kwargs) -> SampleResponse:
        """`sample_async(...)`, awaited (never call it holding the engine's lock: the sampler needs it)."""
        return self.sample_async(*args, **kwargs).result(timeout=LOCAL_WAIT_S)

    def compute_logprobs(self, sampler_id: str | None, prompt: ModelInput) -> list[float | None]:
        """Logprob of each prompt token given the ones before it; entry 0 is None (batched with others)."""
        if not prompt.is_text:  # images are prepared and encoded where a sample's prompt is
            params = SamplingParams(max_tokens=1)
            return self.sample(sampler_id, prompt, 1, params, include_prompt_logprobs=True).prompt_logprobs or []
        with self._catalog:
            adapter = self.adapter(sampler_id) if sampler_id is not None else None
            host = self._host
            tokens = check_tokens("prompt", prompt.to_ints(), max_seq_len=host.max_seq_len, vocab_size=host.vocab_size)
            future = self.backend.compute_logprobs(LogprobJob(adapter, tokens))
        return future.result(timeout=LOCAL_WAIT_S)[0]
