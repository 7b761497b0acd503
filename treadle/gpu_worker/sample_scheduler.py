"""The sampling scheduler of one base model: every pending `sample` / `compute_logprobs` request shares
each decode step, whatever session, snapshot or base model it samples.

Requests wait in one queue and get a `concurrent.futures.Future`. One thread runs the decode loop
(`DecodeBatch`): at every step boundary it admits waiting sample requests in arrival order (each
prefilled once, its rows joining the running batch) while the batch's projected KV cache stays
within `max_batch_tokens`, runs one decode step for every row, and answers each request as soon as
its last row ends. This is continuous batching: a request that arrives mid-batch starts at the next
step, and finished rows free their place at once. `compute_logprobs` requests are answered between
steps, many in one padded forward (mixed adapters), split by `max_logprob_tokens`.

The device is shared with training through one `DeviceLock`, taken per prefill, per decode step and
per logprob forward, never for a whole batch: a training op waits at most one of those, and since the
lock is granted in arrival order, sampling goes on between the training ops of other sessions.

Memory: the batch's KV cache is at most `max_batch_tokens` positions (rows x padded length, counting
each row's full `max_tokens`); one position costs 2 x layers x kv_heads x head_dim x dtype bytes
(SmolLM2-135M in fp32: 2 x 30 x 3 x 64 x 4 = 46 KB, so 16384 positions ~ 0.75 GB), plus one step's
logits (rows x vocab x 4 bytes). A request larger than the budget runs alone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.errors import ServerError, TreadleError
from treadle.gpu_worker.adapters import AdapterBank
from treadle.gpu_worker.batch_decode import DecodeBatch, SampleJob, forward_rows, prompt_logprobs_from_logits
from treadle.gpu_worker.device_lock import DeviceLock
from treadle.gpu_worker.logprobs import micro_batches
from treadle.gpu_worker.model_host import ModelHost

log = logging.getLogger("treadle.sampler")

PromptLogprobs = tuple[list[float | None], list[list[tuple[int, float]] | None] | None]


@dataclass
class LogprobJob:
    """One `compute_logprobs` request: the prompt's token logprobs under an adapter (None: base)."""

    adapter: str | None
    tokens: np.ndarray
    topk: int = 0
    future: Future = field(default_factory=Future)


class SampleScheduler:
    """A queue of sample and logprob requests on one base model, served by one decode-loop thread."""

    def __init__(self, bank: AdapterBank, host: ModelHost, device_lock: DeviceLock, *,
                 max_batch_tokens: int = 16384, max_logprob_tokens: int = 4096):
        self.bank = bank
        self.host = host
        self.device_lock = device_lock
        self.max_batch_tokens = max_batch_tokens
        self.max_logprob_tokens = max_logprob_tokens
        self._batch = DecodeBatch(bank, host)
        self._samples: deque[tuple[SampleJob, Future]] = deque()
        self._logprobs: deque[LogprobJob] = deque()
        self._running: dict[int, tuple[SampleJob, Future]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"treadle-sampler-{host.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public

    def sample(self, job: SampleJob) -> Future:
        """Queue a sample request; the future resolves to its `SampleResponse`."""
        future: Future = Future()
        with self._cond:
            self._check_open()
            self._samples.append((job, future))
            self._cond.notify()
        return future

    def compute_logprobs(self, adapter: str | None, tokens: np.ndarray, topk: int = 0) -> Future:
        """Queue a prompt-logprobs request; the future resolves to (logprobs, top-k or None)."""
        job = LogprobJob(adapter, np.asarray(tokens, dtype=np.int64), topk)
        with self._cond:
            self._check_open()
            self._logprobs.append(job)
            self._cond.notify()
        return job.future

    def adapters_in_use(self) -> set[str | None]:
        """Adapters that a queued or running request still needs (they must not be removed yet)."""
        with self._cond:
            return (
                {job.adapter for job, _ in self._samples}
                | {job.adapter for job in self._logprobs}
                | {job.adapter for job, _ in self._running.values()}
            )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests not answered yet fail with a ServerError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise ServerError(f"sampler of {self.host.name} is shut down")

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._cond:
                # Idle: sleep until a request arrives (re-checked every second so close() is never missed).
                while not (self._samples or self._logprobs or self._batch or self._closed):
                    self._cond.wait(timeout=1.0)
                if self._closed:
                    self._fail_everything(ServerError(f"sampler of {self.host.name} shut down"))
                    return
                logprob_jobs = list(self._logprobs)
                self._logprobs.clear()
            if logprob_jobs:
                self._answer_logprobs(logprob_jobs)
            while (entry := self._next_admissible()) is not None:
                self._admit(*entry)
            if self._batch:
                self._step()

    def _next_admissible(self) -> tuple[SampleJob, Future] | None:
        """The oldest waiting sample request, if its rows fit the budget beside the running ones."""
        with self._cond:
            if not self._samples or self._closed:
                return None
            job, future = self._samples[0]
            if self._batch and self._projected(job) > self.max_batch_tokens:
                return None  # first come, first served: later requests wait behind it
            self._samples.popleft()
            self._running[id(job)] = (job, future)
            return job, future

    def _projected(self, job: SampleJob) -> int:
        """KV positions the batch could reach with `job` added: rows x (padded width + longest remaining)."""
        width = max(self._batch.width, len(job.request.prompt))
        longest = max([job.request.max_tokens, *self._batch.remaining()])
        return (len(self._batch) + job.num_samples) * (width + longest)

    def _admit(self, job: SampleJob, future: Future) -> None:
        try:
            with self.device_lock:
                done = self._batch.admit(job)
        except Exception as exc:
            self._finish(job, error=_as_error(exc, "sample"))
            return
        if done:
            self._finish(job)

    def _step(self) -> None:
        try:
            with self.device_lock:
                completed = self._batch.step()
        except Exception as exc:
            error = _as_error(exc, "sample")
            for job in self._batch.fail_all():
                self._finish(job, error=error)
            return
        for job in completed:
            self._finish(job)

    def _finish(self, job: SampleJob, error: BaseException | None = None) -> None:
        with self._cond:
            _, future = self._running.pop(id(job))
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(job.response())

    def _answer_logprobs(self, jobs: list[LogprobJob]) -> None:
        for group in micro_batches([len(j.tokens) for j in jobs], self.max_logprob_tokens):
            batch = [jobs[i] for i in group]
            try:
                with self.device_lock:
                    results = batch_prompt_logprobs(self.bank, self.host, batch)
            except Exception as exc:
                error = _as_error(exc, "compute_logprobs")
                for job in batch:
                    job.future.set_exception(error)
                continue
            for job, result in zip(batch, results):
                job.future.set_result(result)

    def _fail_everything(self, error: ServerError) -> None:
        for job in self._batch.fail_all():
            self._finish(job, error=error)
        for job, future in self._samples:
            future.set_exception(error)
        for job in self._logprobs:
            job.future.set_exception(error)
        self._samples.clear()
        self._logprobs.clear()


def batch_prompt_logprobs(bank: AdapterBank, host: ModelHost, jobs: list[LogprobJob]) -> list[PromptLogprobs]:
    """Prompt logprobs of several requests in one right-padded forward, each row with its own adapter.

    Causal attention means padding after a prompt cannot change it, so each row equals its own
    unbatched forward up to floating-point effects of the batch shape.
    """
    width = max(len(j.tokens) for j in jobs)
    ids = torch.full((len(jobs), width), host.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for row, job in enumerate(jobs):
        ids[row, : len(job.tokens)] = torch.from_numpy(job.tokens)
        mask[row, : len(job.tokens)] = 1
    ids, mask = ids.to(host.device), mask.to(host.device)
    logits = forward_rows(bank, [j.adapter for j in jobs], input_ids=ids, attention_mask=mask, use_cache=False).logits
    results = []
    for row, job in enumerate(jobs):
        if len(job.tokens) < 2:
            results.append(([None], [None] if job.topk else None))
        else:
            results.append(prompt_logprobs_from_logits(logits[row, : len(job.tokens)], ids[row, : len(job.tokens)], job.topk))
    return results


def _as_error(exc: Exception, op: str) -> TreadleError:
    """User errors pass through; anything else is a server error that names the op."""
    if isinstance(exc, TreadleError):
        return exc
    log.exception("%s failed", op)
    return ServerError(f"{op} failed: {type(exc).__name__}: {exc}")
