"""The static-shape decode path: a decode step of fixed shapes that a GPU runs as a captured CUDA graph.

Why: on a GPU a decode step of the dynamic path (`batch_decode`) launches thousands of small kernels
from Python, and the GPU waits on the launches (docs/benchmarks.md, "On a GPU"). A step whose tensors
keep their shapes and addresses from one step to the next can be captured once and replayed: here
`torch.compile(mode="reduce-overhead", fullgraph=True)`, which fuses the step's elementwise work with
Inductor and replays it through CUDA graph trees, one graph per bucket. (A hand-made `torch.cuda.graph`
capture of the eager step would replay the same thousands of unfused kernels, and would need its own
memory pool and warm-up per bucket, which graph trees keep.)

What stays fixed within a bucket of (rows, capacity), rows in 8, 16, 32, ... and capacity a power of
two of at least `KEY_MULTIPLE` positions:

- the KV cache (`slot_cache.SlotCache`, recurrent states in `state_slots`): one slot per row, rows join and
  leave without reshaping it;
- the step's inputs, device tensors updated in place: each slot's last token, its length (the position
  of that token, where its key is written) and its adapter slot;
- the adapters (`lora_table.LoraTable`): stacked static weights, indexed per row by the adapter slots,
  one pair of products per LoRA layer whatever the mix (expert tensors' factors gathered per routed token,
  `expert_table`).

A step runs the whole bucket (free slots compute garbage that nothing reads) and returns the last
logits of every slot; the token draw (per-request generators, `token_choice`) and its logprobs run
right after, eagerly, on the running rows, and one host transfer reads the tokens for the stop checks.
Prefill stays eager (`batch_decode.prefill`), and its K, V and states are copied into the rows' slots.

Requests this path cannot take run beside it in a dynamic batch (`DecodeBatch`), stepped in the same
round: an adapter the table cannot stack (`LoraTable.can_hold`: DoRA, a LoRA embedding), or a step whose rows would use
more adapters than the table's slots. Which families take the path at all is `slot_cache.static_path`.

The deterministic mode (`fixed`, the worker's `--sampler_deterministic_rows`): on a GPU the kernels of a product
are chosen by its shapes, so a row's numbers move with its bucket. With one fixed bucket every step has the same
shapes whatever rows share it; each prompt is prefilled alone (its forward's shapes its own) and resumes from no
kept KV (whose numbers would come from another forward's shapes); the adapters' deltas are taken per slot
(`LoraTable`'s `fixed_rank`). A job that cannot take it (more rows than the bucket, or longer) decodes beside, on
the dynamic path, without the guarantee; the scheduler holds jobs back while the bucket's slots are full (`room`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.backend import SampleJob
from treadle.gpu_worker.sampling.hf.batch_decode import DecodeBatch, Row, choose, prefill, record
from treadle.gpu_worker.sampling.hf.prefix_cache import PrefixCache
from treadle.gpu_worker.sampling.hf.lora_table import SLOTS, LoraTable, static_address
from treadle.gpu_worker.sampling.hf.row_invariant import KEY_MULTIPLE, ROW_MULTIPLE
from treadle.gpu_worker.sampling.hf.slot_cache import SlotCache, attending


KEPT_BUCKETS = 2  # buckets whose buffers stay allocated (`SlotBatch._fit`)
FIXED_RANK = 64  # the deterministic mode's LoRA table rank: rows of adapters of a larger rank decode dynamically


def bucket(needed: int, least: int) -> int:
    """The smallest power of two times `least` that holds `needed`."""
    size = least
    while size < needed:
        size *= 2
    return size


def fixed_bucket(rows: int, positions: int, max_seq_len: int) -> tuple[int, int]:
    """The deterministic mode's one bucket: `rows` (up to a multiple of `ROW_MULTIPLE`) of the most positions, a
    multiple of `KEY_MULTIPLE` up to the model's longest sequence, that `positions` in all hold (at least one block)."""
    rows = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    capacity = positions // rows // KEY_MULTIPLE * KEY_MULTIPLE
    return rows, max(KEY_MULTIPLE, min(capacity, bucket(max_seq_len, KEY_MULTIPLE)))


class SlotBatch:
    """The rows being decoded on the static-shape path, their slots, and the rows beside them on the dynamic path.

    `compile`: how the step runs: None (eagerly), "graphs" (`torch.compile(mode="reduce-overhead")`: CUDA graphs), or
    a `torch.compile` backend name (tests trace the step with backend "eager" to check it is one graph). `fixed`: the
    deterministic mode's (rows, capacity) of every step (`fixed_bucket`); None: buckets as the rows need."""

    def __init__(
        self,
        bank: AdapterBank,
        host: ModelHost,
        *,
        compile: str | None = None,
        slots: int = SLOTS,
        prefixes: PrefixCache | None = None,
        fixed: tuple[int, int] | None = None,
    ):
        self.bank = bank
        self.host = host
        self.fixed = fixed
        self.table = LoraTable(bank, slots, fixed_rank=FIXED_RANK if fixed else None)
        self.rows: list[Row] = []
        self.slots: list[int] = []  # each row's slot
        # Prompts resume from kept KV (`prefix_cache`; answers are kept by `dynamic` only), but for the deterministic
        # mode's: kept KV was computed in other forwards' shapes.
        self.prefixes = None if fixed else prefixes
        self.dynamic = DecodeBatch(bank, host, prefixes)
        self._cache: SlotCache | None = None
        self._buckets: OrderedDict[tuple[int, int], tuple] = OrderedDict()  # (rows, capacity) -> buffers, `_fit`
        self._tokens = self._lengths = self._adapters = torch.zeros(0, dtype=torch.long, device=host.device)
        self.compiled = compile is not None
        self._run: Callable[..., torch.Tensor] = _compiled(self._forward, compile)
        self._limit = bucket(host.max_seq_len, KEY_MULTIPLE)

    def __len__(self) -> int:
        return len(self.rows) + len(self.dynamic)

    @property
    def width(self) -> int:
        """The longest row, in positions (the scheduler projects the batch's KV cache from it)."""
        return max([self.dynamic.width, *(len(r.job.request.prompt) + len(r.tokens) for r in self.rows)])

    def remaining(self) -> list[int]:
        return [*(row.job.request.max_tokens - len(row.tokens) for row in self.rows), *self.dynamic.remaining()]

    def room(self, jobs: list[SampleJob]) -> bool:
        """Whether the jobs' rows fit the fixed bucket's free slots (always without one): the scheduler holds the
        others back rather than have them decode beside, without the deterministic mode's guarantee."""
        return self.fixed is None or sum(job.num_samples for job in jobs) <= self.fixed[0] - len(self.rows)

    def admit(self, jobs: list[SampleJob]) -> list[SampleJob]:
        """Prefill the jobs and place their rows in slots (or in the dynamic batch); returns the jobs already
        complete."""
        busy = {row.job.adapter for row in self.rows if row.job.adapter is not None}
        free = self.fixed[0] - len(self.rows) if self.fixed else 0
        mine, others = [], []
        for job in jobs:  # in order: a job's adapter slot is kept from the jobs admitted after it
            if self._takes(job, busy) and self._fits(job, free):
                mine.append(job)
                busy.add(job.adapter)
                free -= job.num_samples
            else:
                others.append(job)
        completed = self.dynamic.admit(others) if others else []
        # The deterministic mode prefills each job alone: a batched prefill's shapes depend on its neighbours.
        groups = [[job] for job in mine] if self.fixed else [mine]
        for group in filter(None, groups):
            done = prefill(self.bank, self.host, group, self.prefixes)
            if done.rows:
                self._place(done.rows, done.cache, done.mask, done.last)
            completed += done.completed
        return completed

    def step(self) -> list[SampleJob]:
        """One decode step of every row; returns the jobs that completed in it."""
        completed = self.dynamic.step() if len(self.dynamic) else []
        if not self.rows:
            return completed
        assert self._cache is not None
        with torch.no_grad(), attending(self.host.model), self.table.installed():
            logits = self._run(self._cache, self._tokens, self._lengths, self._adapters)
        active = torch.tensor(self.slots, device=self.host.device)
        tokens = choose(logits[active], self.rows)
        going = record(self.rows, tokens, self.host.tokenizer)
        self._tokens.index_copy_(0, active, tokens)
        self._lengths.index_add_(0, active, torch.ones_like(active))
        rows = self.rows
        completed += list({id(r.job): r.job for r in rows if r.job.done}.values())
        if len(going) < len(rows):
            kept = set(going)
            self._free([self.slots[i] for i in range(len(rows)) if i not in kept])
            self.rows, self.slots = [rows[i] for i in going], [self.slots[i] for i in going]
        return completed

    def forget(self, adapter: str | None) -> None:
        """Drop what is kept for an adapter that leaves the bank."""
        self.dynamic.forget(adapter)

    def drop(self, job: SampleJob) -> list[Row]:
        """Remove the job's rows (its client cancelled) and free their slots; returns them."""
        dropped = self.dynamic.drop(job)
        mine = [i for i, row in enumerate(self.rows) if row.job is job]
        if mine:
            self._free([self.slots[i] for i in mine])
            dropped += [self.rows[i] for i in mine]
            going = [i for i, row in enumerate(self.rows) if row.job is not job]
            self.rows, self.slots = [self.rows[i] for i in going], [self.slots[i] for i in going]
        return dropped

    def fail_all(self) -> list[SampleJob]:
        """Drop every row (after a failed step); returns their jobs."""
        jobs = list({id(r.job): r.job for r in self.rows}.values()) + self.dynamic.fail_all()
        self.rows, self.slots = [], []
        if self._cache is not None:
            self._free(list(range(self._cache.rows)))
        return jobs

    # ------------------------------------------------------------ internals

    def _forward(self, cache: SlotCache, tokens: torch.Tensor, lengths: torch.Tensor, adapters: torch.Tensor):
        """The step that is captured: every slot's next-token logits, (rows, vocab)."""
        self.table.select(adapters)
        out = self.host.model(
            input_ids=tokens[:, None],
            position_ids=lengths[:, None],
            cache=cache,
            use_cache=True,
            slot_lengths=lengths,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _takes(self, job: SampleJob, busy: set) -> bool:
        """Whether the job's rows can run here: its adapter stacks, and a slot for it is free or already its
        (`busy`: adapters whose slots are not to be taken). A prompt with images decodes dynamically: its rows'
        next positions are M-RoPE's, not their lengths, which the slots' step takes them to be."""
        if not self.table.can_hold(job.adapter) or job.request.visual is not None:
            return False
        try:
            self.table.slot(job.adapter, busy)
        except LookupError:
            return False
        return True

    def _fits(self, job: SampleJob, free: int) -> bool:
        """Whether the job's rows fit the fixed bucket: `free` slots left, and its prompt and answer within a slot."""
        if self.fixed is None:
            return True
        return job.num_samples <= free and len(job.request.prompt) + job.request.max_tokens <= self.fixed[1]

    def _place(self, rows: list[Row], cache, mask: torch.Tensor, last: torch.Tensor) -> None:
        """Give the prefilled rows slots, their K, V and states, first tokens, lengths and adapter slots."""
        lengths = mask.sum(dim=1).tolist()  # the prompts' lengths: one read at admission
        needed = max(length + row.job.request.max_tokens for row, length in zip(rows, lengths))
        self._fit(len(self.rows) + len(rows), needed)
        assert self._cache is not None
        free = sorted(set(range(self._cache.rows)) - set(self.slots))[: len(rows)]
        slots = torch.tensor(free, device=self.host.device)
        self._cache.fill_rows(cache, slots, lengths, mask.shape[1])
        busy = {r.job.adapter for r in [*self.rows, *rows] if r.job.adapter is not None}
        adapter_slots = [self.table.slot(row.job.adapter, busy) for row in rows]
        self._tokens[slots] = last
        self._lengths[slots] = torch.tensor(lengths, device=self.host.device)
        self._adapters[slots] = torch.tensor(adapter_slots, device=self.host.device)
        self.rows += rows
        self.slots += free

    def _fit(self, rows: int, capacity: int) -> None:
        """Make the bucket hold `rows` rows of `capacity` positions, moving the slots held so far.

        The last `KEPT_BUCKETS` buckets keep their buffers, empty or not: a captured graph replays on their
        addresses, and buffers made anew would be captured again (CUDA graph trees re-record a graph whose
        static inputs moved, and give up on it after a number of times)."""
        now = self._cache if self.rows else None  # an empty bucket moves nothing and sets no least size
        want = self.fixed or (
            bucket(max(rows, now.rows if now else 0), ROW_MULTIPLE),
            min(bucket(max(capacity, now.capacity if now else 0), KEY_MULTIPLE), self._limit),
        )
        if self._cache is not None and (self._cache.rows, self._cache.capacity) == want:
            return
        cache, tokens, lengths, adapters = self._buckets.pop(want, None) or self._new_bucket(*want)
        tokens.fill_(self.host.pad_token_id), lengths.zero_(), adapters.fill_(-1)
        if now is not None:
            cache.move(now)
            tokens[: now.rows], lengths[: now.rows], adapters[: now.rows] = self._tokens, self._lengths, self._adapters
        self._buckets[want] = (cache, tokens, lengths, adapters)
        while len(self._buckets) > KEPT_BUCKETS:
            self._buckets.popitem(last=False)
        self._cache, self._tokens, self._lengths, self._adapters = cache, tokens, lengths, adapters

    def _new_bucket(self, rows: int, capacity: int) -> tuple:
        return SlotCache(rows, capacity), *(self._buffer(rows, 0) for _ in range(3))

    def _buffer(self, rows: int, fill: int) -> torch.Tensor:
        return static_address(torch.full((rows,), fill, dtype=torch.long, device=self.host.device))

    def _free(self, slots: list[int]) -> None:
        index = torch.tensor(slots, device=self.host.device)
        self._lengths[index], self._adapters[index], self._tokens[index] = 0, -1, self.host.pad_token_id


def _compiled(forward: Callable[..., torch.Tensor], how: str | None) -> Callable[..., torch.Tensor]:
    if how is None:
        return forward
    if how == "graphs":
        return torch.compile(forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(forward, backend=how, fullgraph=True, dynamic=False)
