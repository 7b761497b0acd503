"""Sampling entry points: `sample` (and compute_logprobs, a sample request for prompt logprobs only).

Sampling a frozen snapshot needs no session ordering, so requests come on the base model's control
queue, not a session's, and any worker serving the model answers. A request is handed to its
engine's sampling scheduler and answered through a future: the Celery thread goes straight on to
the next message, so every request in flight shares the scheduler's decode steps. Snapshots made
on this worker stay in memory (`SamplerCache`, least recently used first out); others are loaded
from the checkpoint store on first use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

from treadle.gpu_worker.executor.sample_stream import SampleStreams
from treadle.gpu_worker.sessions.checkpoint_io import load_sampler
from treadle.gpu_worker.sampling.backend import TokenStream
from treadle.gpu_worker.sampling.extras import SampleExtras
from treadle.queue.ops import SampleRequest
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.paths import CheckpointPath

# In-memory sampler snapshots kept per worker; older ones are reloaded from the store on demand.
MAX_CACHED_SAMPLERS = 8


class SamplerCache:
    """Which sampler snapshots are loaded on which engine; evicts the least recently used."""

    def __init__(self, engine_for: Callable[[str], object], store: CheckpointStore, limit: int = MAX_CACHED_SAMPLERS):
        self._engine_for = engine_for
        self._store = store
        self._limit = limit
        self._loaded: OrderedDict[str, str] = OrderedDict()  # sampler id -> base model

    def remember(self, sampler_id: str, base_model: str) -> None:
        self._loaded[sampler_id] = base_model
        self._loaded.move_to_end(sampler_id)
        while len(self._loaded) > self._limit:
            old, model = self._loaded.popitem(last=False)
            self._engine_for(model).drop_sampler(old)

    def engine_and_sampler(self, base_model: str, model_path: str | None):
        """The engine to sample on and the sampler id on it (None: the base model), loading it if needed."""
        if model_path is None:
            return self._engine_for(base_model), None
        sampler_id = CheckpointPath.parse(model_path).uri()
        if sampler_id in self._loaded:
            self._loaded.move_to_end(sampler_id)
            return self._engine_for(self._loaded[sampler_id]), sampler_id
        owner_model = self._store.manifest(CheckpointPath.parse(sampler_id)).base_model
        engine = self._engine_for(owner_model)
        load_sampler(engine, self._store, sampler_id)
        self.remember(sampler_id, owner_model)
        return engine, sampler_id


def tenant_of(req: SampleRequest) -> str:
    """Whom a sample request's device time counts for: the session its snapshot came from, as that session's own
    training ops count for it; the base model's samples per paying owner."""
    if req.model_path is None:
        return f"base:{req.owner or ''}"
    return CheckpointPath.parse(req.model_path).run_id


class Sampling:
    def __init__(self, cache: SamplerCache, op_lock: threading.RLock, streams: SampleStreams):
        self.cache = cache
        self.op_lock = op_lock
        self.streams = streams

    def sample(self, req: SampleRequest) -> Future:
        """The request queued on its engine's scheduler; the future resolves to its `SampleResponse`. A request that
        names a `stream_id` publishes its tokens as they are drawn, until it is answered (`sample_stream`)."""
        if req.stream_id is None:
            return self._queue(req, None)
        stream = self.streams.open(req.stream_id, topk=req.topk_sample_logprobs > 0)
        try:
            future = self._queue(req, stream)
        except BaseException:
            stream.close()
            raise
        future.add_done_callback(lambda _: stream.close())
        return future

    def _queue(self, req: SampleRequest, stream: TokenStream | None) -> Future:
        target = None if req.target_prompt_logprobs is None else req.target_prompt_logprobs.to_numpy()
        with self.op_lock:  # the sampler cache: look-ups, loads and evictions one at a time
            engine, sampler_id = self.cache.engine_and_sampler(req.base_model, req.model_path)
            return engine.samplers.sample_async(
                sampler_id,
                req.prompt_input,
                req.num_samples,
                req.sampling_params,
                include_prompt_logprobs=req.include_prompt_logprobs,
                topk_prompt_logprobs=req.topk_prompt_logprobs,
                extras=SampleExtras(req.topk_sample_logprobs, target, req.prompt_alt_tokens_k),
                tenant=tenant_of(req),
                stream=stream,
            )
