"""The sampling scheduler of one base model: every pending `sample` / `compute_logprobs` request shares
each decode step, whatever session, snapshot or base model it samples.

Requests wait in one queue and get a `concurrent.futures.Future`. One thread runs the decode loop
(`DecodeBatch`): at every step boundary it admits the waiting sample requests, in fair turns between
snapshots (each snapshot's own in arrival order), while the batch's projected KV cache stays within `max_batch_tokens` (their prompts prefilled together,
once each, their rows joining the running batch), runs one decode step for every row, and answers
each request as soon as its last row ends. This is continuous batching: a request that arrives
mid-batch starts at the next step, and finished rows free their place at once. `compute_logprobs`
requests are answered between steps, many in one padded forward with mixed adapters.

The device is shared with training through one `DeviceLock`, taken per forward (a prefill, a decode
step, a logprob batch), never for a whole batch: a training op waits at most one forward, and since
the lock is granted in arrival order, sampling goes on between the training ops of other sessions.

Prompts resume from KV kept from earlier requests on the same snapshot, within `prefix_cache_tokens`
positions (`prefix_cache`; 0: off).

A streamed request whose client went away (`SampleJob.stream`) leaves the queue, or the batch at the next step
boundary, its rows freed; it is answered with SampleCancelledError.

Memory: the batch's KV cache is at most `max_batch_tokens` positions (rows x padded length, counting
each row's full `max_tokens`; a request larger than that runs alone); one position costs
2 x layers x kv_heads x head_dim x dtype bytes (SmolLM2-135M in fp32: 2 x 30 x 3 x 64 x 4 = 46 KB,
so 16384 positions ~ 0.75 GB), plus one step's logits (rows x vocab x 4 bytes). A prefill or logprob
forward covers at most `max_forward_tokens` padded tokens, like a training micro-batch; with prompt
logprobs it holds their logits (tokens x vocab x 4 bytes: 4096 x 49152 x 4 = 0.8 GB for SmolLM2).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable, cast

import torch

from treadle.errors import SampleCancelledError, ServerError, TreadleError
from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.backend import LogprobJob, SampleJob, SamplerSetup, TokenStream
from treadle.gpu_worker.sampling.hf.batch_decode import DecodeBatch, forward_rows, prompt_logprobs_from_logits
from treadle.gpu_worker.sampling.hf.prefix_cache import PrefixCache
from treadle.gpu_worker.sampling.hf.decode_path import DecodePath, decode_batch
from treadle.gpu_worker.sampling.hf.slot_batch import SlotBatch, fixed_bucket
from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.gpu_worker.scheduling.fair import FairShare
from treadle.gpu_worker.sampling.logprob_audit import LogprobAudit
from treadle.gpu_worker.training.logprobs import micro_batches
from treadle.gpu_worker.model.host import ModelHost

log = logging.getLogger("treadle.sampler")

# The share of the batch's KV budget that a snapshot with rows in the batch leaves to the others (_take_admissible).
ROOM_FOR_OTHERS = 0.25

PromptLogprobs = tuple[list[float | None], list[list[tuple[int, float]] | None] | None]


class SampleScheduler:
    """A queue of sample and logprob requests on one base model, served by one decode-loop thread."""

    def __init__(
        self,
        bank: AdapterBank,
        host: ModelHost,
        device_lock: DeviceLock,
        *,
        max_batch_tokens: int = 16384,
        max_forward_tokens: int = 4096,
        prefix_cache_tokens: int = 16384,
        path: str = "hf",
        decode: DecodePath = "dynamic",
        static_decode: str = "yes",
        deterministic_rows: int = 0,
    ):
        self.bank = bank
        self.host = host
        self.device_lock = device_lock
        self.max_batch_tokens = max_batch_tokens
        self.max_forward_tokens = max_forward_tokens
        prefixes = PrefixCache.for_model(host, prefix_cache_tokens)
        fixed = fixed_bucket(deterministic_rows, max_batch_tokens, host.max_seq_len) if deterministic_rows else None
        self._batch = decode_batch(bank, host, decode, static_decode, prefixes, fixed)
        steps = {DecodeBatch: "dynamic decode steps", SlotBatch: "static-shape decode steps"}[type(self._batch)]
        graphs = " (CUDA graphs)" if isinstance(self._batch, SlotBatch) and self._batch.compiled else ""
        self.path = f"{path}; {steps}{graphs}"
        self._fair = FairShare()  # admission turns between snapshots (_take_admissible)
        self._audit = LogprobAudit(bank, host, device_lock)  # a fraction of answers against the training forward
        self._samples: deque[tuple[SampleJob, Future]] = deque()
        self._logprobs: deque[LogprobJob] = deque()
        self._running: dict[int, tuple[SampleJob, Future]] = {}
        self._retiring: list[tuple[str | None, Callable[[], None]]] = []  # adapters to remove once unused
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"treadle-sampler-{host.name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_setup(
        cls, setup: SamplerSetup, decode: DecodePath = "auto", deterministic_rows: int = 0
    ) -> SampleScheduler:
        return cls(
            setup.bank,
            setup.host,
            setup.device_lock,
            max_batch_tokens=setup.max_batch_tokens,
            max_forward_tokens=setup.max_forward_tokens,
            prefix_cache_tokens=setup.prefix_cache_tokens,
            path=setup.hf_batching,
            decode=decode,
            static_decode=setup.static_decode,
            deterministic_rows=deterministic_rows,
        )

    # ------------------------------------------------------------ public

    def sample(self, job: SampleJob) -> Future:
        """Queue a sample request; the future resolves to its `SampleResponse`."""
        future: Future = Future()
        with self._cond:
            self._check_open()
            self._samples.append((job, future))
            self._cond.notify()
        return future

    def compute_logprobs(self, job: LogprobJob) -> Future:
        """Queue a prompt-logprobs request; the future resolves to (logprobs, top-k or None)."""
        with self._cond:
            self._check_open()
            self._logprobs.append(job)
            self._cond.notify()
        return job.future

    def when_unused(self, adapter: str | None, callback: Callable[[], None]) -> None:
        """Run `callback` (which removes `adapter`) once no queued or running request needs the adapter:
        at once if none does, else right after the last such request is answered. The KV kept for the adapter
        goes with it (`prefix_cache`)."""

        def remove() -> None:
            self._batch.forget(adapter)
            callback()

        with self._cond:
            if adapter in self._needed():
                self._retiring.append((adapter, remove))
                return
        remove()

    def _needed(self) -> set[str | None]:
        return (
            {job.adapter for job, _ in self._samples}
            | {job.adapter for job in self._logprobs}
            | {job.adapter for job, _ in self._running.values()}
        )

    def _retire_unused(self) -> None:
        with self._cond:
            needed = self._needed()
            ready = [(a, c) for a, c in self._retiring if a not in needed]
            self._retiring = [(a, c) for a, c in self._retiring if a in needed]
        if ready:
            with self.device_lock:
                for _, callback in ready:
                    callback()

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
        # Each device turn is one forward: a compute_logprobs batch, a prefill of newly admitted
        # requests, or a decode step. What a turn takes from the queue is decided once it holds the
        # device, so everything that arrived while the device was busy goes into that turn.
        # The device is kept from one round to the next while no waiter (a training op) serves a tenant with less
        # device time than the batch's (treadle.gpu_worker.scheduling.device_lock): a light tenant's rows run their
        # decode steps one after another beside a heavy tenant's backlog of ops, which take turns with the heavy
        # tenant's own rows.
        while self._wait_for_work():
            with self.device_lock.hold(self._tenants()) as device:
                while device.run(self._round) and device.keep(self._tenants()):
                    pass
            if self._retiring:
                self._retire_unused()

    def _round(self) -> bool:
        """One round on the device (a logprob batch, a prefill of admitted requests, a decode step: whichever have
        work); whether another round has work now."""
        self._drop_cancelled()
        if logprob_jobs := self._take_logprobs():
            self._answer_logprobs(logprob_jobs)
        if admitted := self._take_admissible():
            self._admit(admitted)
        if self._batch:
            self._step()
        with self._cond:
            return not self._closed and not self._retiring and bool(self._samples or self._logprobs or self._batch)

    def _drop_cancelled(self) -> None:
        """Streamed requests whose client went away leave the queue or the batch (their rows freed at this step
        boundary) and are answered with SampleCancelledError."""
        with self._cond:
            waiting = [(j, f) for j, f in self._samples if j.stream is not None and j.stream.cancelled]
            for pair in waiting:
                self._samples.remove(pair)
            running = [j for j, _ in self._running.values() if j.stream is not None and j.stream.cancelled]
        for job, future in waiting:
            cast(TokenStream, job.stream).dropped([0] * job.num_samples, len(self._batch))
            future.set_exception(SampleCancelledError("sample: its client cancelled it before it started"))
        for job in running:
            drawn = {row.index: len(row.tokens) for row in self._batch.drop(job)}
            tokens = [len(s.tokens) if s is not None else drawn.get(k, 0) for k, s in enumerate(job.sequences)]
            cast(TokenStream, job.stream).dropped(tokens, len(self._batch))
            cancelled = f"sample: its client cancelled it after {max(tokens)} tokens"
            self._finish(job, SampleCancelledError(cancelled, sampled_tokens=sum(tokens)))

    def _tenants(self) -> dict[str, float]:
        """Whom the next round serves, by rows: the running batch's requests and the waiting ones."""
        tenants: dict[str, float] = {}
        with self._cond:
            rows = [(j.tenant or str(j.adapter), j.num_samples) for j, _ in [*self._samples, *self._running.values()]]
            rows += [(str(j.adapter), 1) for j in self._logprobs]
        for tenant, count in rows:
            tenants[tenant] = tenants.get(tenant, 0.0) + count
        return tenants

    def _wait_for_work(self) -> bool:
        """False once closed (everything unanswered has failed by then)."""
        with self._cond:
            # Re-checked every second, so a close() is never missed.
            while not (self._samples or self._logprobs or self._batch or self._closed):
                self._cond.wait(timeout=1.0)
            if self._closed:
                self._fail_everything(ServerError(f"sampler of {self.host.name} shut down"))
                return False
            return True

    def _take_logprobs(self) -> list[LogprobJob]:
        """The oldest waiting logprob requests whose padded size fits one forward."""
        with self._cond:
            if not self._logprobs:
                return []
            group = micro_batches([len(j.tokens) for j in self._logprobs], self.max_forward_tokens)[0]
            return [self._logprobs.popleft() for _ in group]

    def _take_admissible(self) -> list[SampleJob]:
        """Waiting sample requests in fair turns between snapshots, while the batch's projected KV cache stays
        within `max_batch_tokens`, their prompts fit one prefill forward and, in the deterministic mode, their rows the
        fixed bucket's free slots (`SlotBatch.room`): at least one when the batch is empty.

        Each turn goes to the snapshot (adapter; None: the base model) with the fewest token positions admitted so
        far (treadle.gpu_worker.scheduling.fair: rows x (prompt + max_tokens), a snapshot that was idle rejoining at the
        clock), and takes its oldest request whole: a small request does not queue behind another tenant's
        backlog of big ones, and each snapshot's requests keep their order.

        A snapshot that already has rows in the batch fills it only up to `1 - ROOM_FOR_OTHERS` of
        `max_batch_tokens`: the rest is room for the first request of another snapshot, which then joins at the next
        step instead of waiting for the long rows already there to end."""
        taken: list[SampleJob] = []
        with self._cond:
            present = {job.adapter for job, _ in self._running.values()}
            self._fair.forget(self._needed())
            while self._samples and not self._closed:
                adapter = self._fair.pick(dict.fromkeys({job.adapter for job, _ in self._samples}, ""))
                index = next(i for i, (job, _) in enumerate(self._samples) if job.adapter == adapter)
                job, future = self._samples[index]
                candidate = [*taken, job]
                longest_prompt = max(len(j.request.prompt) for j in candidate)
                limit = self.max_batch_tokens
                if adapter in present:
                    limit = int(limit * (1 - ROOM_FOR_OTHERS))
                if self._batch or taken:
                    if (
                        self._projected(candidate) > limit
                        or len(candidate) * longest_prompt > self.max_forward_tokens
                        or (isinstance(self._batch, SlotBatch) and not self._batch.room(candidate))
                    ):
                        break  # the request whose turn it is waits for room, and the others behind it
                del self._samples[index]
                positions = job.num_samples * (len(job.request.prompt) + job.request.max_tokens)
                self._fair.charge(adapter, "", positions, kind="positions", units=positions)
                self._running[id(job)] = (job, future)
                present.add(adapter)
                taken.append(job)
        return taken

    def _projected(self, jobs: list[SampleJob]) -> int:
        """KV positions the batch could reach with `jobs` added: rows x (padded width + longest remaining)."""
        width = max(self._batch.width, *(len(j.request.prompt) for j in jobs))
        longest = max([*(j.request.max_tokens for j in jobs), *self._batch.remaining()])
        return (len(self._batch) + sum(j.num_samples for j in jobs)) * (width + longest)

    def _admit(self, jobs: list[SampleJob]) -> None:
        try:
            completed = self._batch.admit(jobs)
        except Exception as exc:
            error = _as_error(exc, "sample")
            for job in jobs:
                self._finish(job, error=error)
            return
        for job in completed:
            self._finish(job)

    def _step(self) -> None:
        try:
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
            self._audit.consider(job)

    def _answer_logprobs(self, jobs: list[LogprobJob]) -> None:
        try:
            results = batch_prompt_logprobs(self.bank, self.host, jobs)
        except Exception as exc:
            error = _as_error(exc, "compute_logprobs")
            for job in jobs:
                job.future.set_exception(error)
            return
        for job, result in zip(jobs, results):
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
    """Prompt logprobs of several requests in one left-padded forward, each row with its own adapter.

    The forward is batch-invariant (`row_invariant`), so each row equals its own unbatched forward.
    """
    width = max(len(j.tokens) for j in jobs)
    ids = torch.full((len(jobs), width), host.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for row, job in enumerate(jobs):
        ids[row, width - len(job.tokens) :] = torch.from_numpy(job.tokens)
        mask[row, width - len(job.tokens) :] = 1
    ids, mask = ids.to(host.device), mask.to(host.device)
    logits = forward_rows(
        bank,
        [j.adapter for j in jobs],
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
        use_cache=False,
    ).logits
    results = []
    for row, job in enumerate(jobs):
        if len(job.tokens) < 2:
            results.append(([None], [None] if job.topk else None))
        else:
            real = slice(width - len(job.tokens), width)
            results.append(prompt_logprobs_from_logits(logits[row, real], ids[row, real], job.topk))
    return results


def _as_error(exc: Exception, op: str) -> TreadleError:
    """User errors pass through; anything else is a server error that names the op."""
    if isinstance(exc, TreadleError):
        return exc
    log.exception("%s failed", op)
    return ServerError(f"{op} failed: {type(exc).__name__}: {exc}")
