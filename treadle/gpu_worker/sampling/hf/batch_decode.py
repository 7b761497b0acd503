"""One decode loop for many sample requests at once: mixed adapters, per-row sampling, shared prefill.

Every row of the batch is one sequence being sampled; rows of different requests, sessions,
snapshots and the bare base model step together. Each row names its adapter; a step whose rows use
one adapter runs it as the active adapter; a mixed step adds each adapter's LoRA delta to its own
runs of rows (`mixed_lora`), so a row's numbers are those of its adapter alone. Adapters that are not
plain LoRA linears (MoE expert adapters, DoRA loaded from a user's directory) cannot be added as a
delta after the layer: such a step runs one forward per run of rows, each on its slice of the cache.

A request's prompt is prefilled once, as one row (the prompts admitted together share one prefill forward,
equal ones one row), from the end of the longest prefix of it whose KV is kept from earlier requests on
the same adapter (`prefix_cache`, `prefill_plan`); that row's KV cache is then repeated for the request's
`num_samples` rows. Rows join at step boundaries: the newcomer's cache and the batch's cache are
left-padded to one length (padding is masked out and every row carries its own position ids, so
padding never changes a row's numbers) and concatenated; finished rows leave, and columns that have
become padding for every remaining row are cut off. `cache_rows` does this for every cache layer
kind (attention layers, sliding-window layers kept whole, linear-attention and recurrent states).

The caller serialises calls (one decode step or one prefill at a time on the device).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from treadle.gpu_worker.sampling.hf import cache_rows, prefix_cache
from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.hf.mixed_lora import grouped_adapters, stacks_for
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.hf.prefill_plan import PrefillPlan
from treadle.gpu_worker.sampling.hf.prefix_cache import PrefixCache
from treadle.gpu_worker.sampling.hf.row_invariant import first_columns, invariant_forward, row_runs
from treadle.gpu_worker.sampling.backend import SampleJob
from treadle.gpu_worker.sampling.extras import score_prompt, top_of_rows
from treadle.gpu_worker.sampling.hf.token_choice import draw, finished, processed_logprobs
from treadle.types import SampledSequence


@dataclass
class Row:
    """One sample being drawn: the job it belongs to, which of its samples, what it has drawn so far."""

    job: SampleJob
    index: int  # which of the job's num_samples
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]]] = field(default_factory=list)


def forward_rows(bank: AdapterBank, adapters: list[str | None], **inputs):
    """The model's output (`.logits`, `.cache`) for a left-padded batch whose row i runs with adapter
    `adapters[i]` (None: base); batch-invariant (`row_invariant`): each row's numbers are those it
    would get alone. `images` (a prefill's): each row's pictures, whose features its own adapter computes."""
    images = inputs.pop("images", None)
    mask = inputs["attention_mask"]
    if inputs["input_ids"].shape[1] == 1 and mask.shape[1] > 1:  # a decode step: one attention call per layer
        inputs["row_starts"], inputs["decode_masks"] = first_columns(mask), {}
    else:  # read on the host (on a GPU, a sync): only prefills need it
        inputs["row_runs"] = row_runs(mask)
    names = tuple(sorted({a for a in adapters if a is not None}))
    with torch.no_grad():
        layers = stacks_for(bank, names) if names else None
        if names and layers is None and len(set(adapters)) > 1:
            return _split_forward(bank, adapters, inputs if images is None else {**inputs, "images": images})
        if images is not None:
            inputs["mm_encoder_outputs"] = _image_features(bank, adapters, images)
        with invariant_forward(bank.host.model):
            if not names:
                with bank.using(None, trainable=False) as model:
                    return model(**inputs)
            if layers is not None:  # one adapter or many: the same grouped LoRA products (`mixed_lora`)
                with grouped_adapters(bank, adapters, layers) as model:
                    return model(**inputs)
            with bank.using(adapters[0], trainable=False) as model:
                return model(**inputs)


def _image_features(bank: AdapterBank, adapters: list[str | None], images: list) -> dict:
    """`mm_encoder_outputs` of a prefill: every row's pictures in row order, each computed on its own with its
    row's adapter (a vision tower's LoRA, if the session trains one), so no row's numbers depend on the others'."""
    vision = bank.host.vision
    assert vision is not None  # a prompt with images passed validation only on a vision model
    features = []
    for adapter, pictures in zip(adapters, images):
        if pictures:
            with bank.using(adapter, trainable=False) as model:
                features.extend(vision.features(model, pictures, bank.host.device))
    return vision.encoder_outputs(features)


def _split_forward(bank: AdapterBank, adapters: list[str | None], inputs: dict) -> SimpleNamespace:
    """One forward per run of rows with the same adapter, each on its rows of the inputs and the cache."""
    runs, begin = [], 0
    for end in range(1, len(adapters) + 1):
        if end == len(adapters) or adapters[end] != adapters[begin]:
            runs.append((begin, end))
            begin = end
    config, cache = bank.host.model.config, inputs.get("cache")
    outputs = []
    for begin, end in runs:
        part = {
            key: value[:, begin:end] if key == "position_ids" and value.dim() == 3 else value[begin:end]
            for key, value in inputs.items()
            if isinstance(value, torch.Tensor) and key != "logits_to_keep"  # (columns, the same for every row)
        }
        if "images" in inputs:
            part["images"] = inputs["images"][begin:end]
        part |= {key: value for key, value in inputs.items() if key not in part and key not in ("cache", "row_runs")}
        part.pop("row_starts", None)
        part.pop("decode_masks", None)
        if cache is not None:
            part["cache"] = cache_rows.slice_rows(cache, begin, end, config)
        outputs.append(forward_rows(bank, adapters[begin:end], **part))
    caches = [out.cache for out in outputs]
    return SimpleNamespace(
        logits=torch.cat([out.logits for out in outputs]),
        cache=cache_rows.concat_rows(caches) if all(c is not None for c in caches) else None,
    )


def prompt_logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, topk: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    """Per prompt token, its logprob given the tokens before (entry 0 None), and optionally the top-k.

    `logits` (length, vocab) are the model's outputs at each prompt position of `tokens` (length,).
    """
    all_lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    chosen = all_lp.gather(1, tokens[1:].unsqueeze(1)).squeeze(1).tolist()
    if not topk:
        return [None, *chosen], None
    values, ids = all_lp.topk(topk, dim=-1)
    return [None, *chosen], [None, *[list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]]


@dataclass
class Prefilled:
    """Admitted jobs after their prompts' forward: the rows that go on (one per sample that did not end on its
    first token), their cache and left-padded mask (one row each), and the first token each row drew."""

    rows: list[Row]
    cache: object  # a DynamicCache (`cache_rows`), rows as `rows`
    mask: torch.Tensor  # (rows, width)
    last: torch.Tensor  # (rows,)
    completed: list[SampleJob]  # jobs whose every row ended on its first token
    positions: torch.Tensor  # (rows,) each row's next position id (M-RoPE's after images is not its length)


def prefill(
    bank: AdapterBank, host: ModelHost, jobs: list[SampleJob], prefixes: PrefixCache | None = None
) -> Prefilled:
    """Prefill the jobs' prompts in one forward (one row per distinct prompt, each with its own adapter, each from the
    end of its longest prefix kept in `prefixes`: `prefill_plan`), keep them there, score what the jobs ask of their
    prompts, and draw each sample's first token."""
    device = host.device
    for job in jobs:
        if job.generator is None:
            job.generator = torch.Generator(device=device)
            job.generator.manual_seed(job.params.seed if job.params.seed is not None else secrets.randbits(63))
        job.sequences = [None] * job.num_samples
    wants_prompt = [job.include_prompt_logprobs or job.topk_prompt_logprobs > 0 for job in jobs]
    wants_logits = [w or job.extras.from_prompt for w, job in zip(wants_prompt, jobs)]
    plan = PrefillPlan(jobs, wants_logits, prefixes)
    out = forward_rows(bank, [p.adapter for p in plan.run], **plan.inputs(host)) if plan.run else None
    cache, mask, last = plan.finish(out, host)
    if prefixes is not None:
        plan.keep(prefixes, cache, mask, last)
    prefix_cache.observe(host.name, plan.prefilled, sum(len(job.request.prompt) for job in jobs) - plan.prefilled)
    for i, job in enumerate(jobs):
        if wants_logits[i]:
            prompt = plan.prompts[plan.of_job[i]]
            logits = plan.prompt_logits(out, prompt)
            job.prompt_extras = score_prompt(logits, job.extras, job.params.temperature, job.generator.initial_seed())
            if wants_prompt[i]:
                tokens = torch.tensor(prompt.tokens, device=device)
                job.prompt_logprobs, job.topk = prompt_logprobs_from_logits(logits, tokens, job.topk_prompt_logprobs)
    # The num_samples rows of a job all start from its prompt's one row.
    rows = [Row(job, k) for job in jobs for k in range(job.num_samples)]
    of_job = [plan.row[id(plan.prompts[plan.of_job[i]])] for i in range(len(jobs))]
    source = torch.tensor([of_job[i] for i, job in enumerate(jobs) for _ in range(job.num_samples)], device=device)
    first = choose(last[source], rows)
    going = record(rows, first, host.tokenizer)
    completed = [job for job in jobs if job.done]
    keep = torch.tensor(going, dtype=torch.long, device=device)
    if going:
        cache_rows.select_rows(cache, source[keep])
    positions = plan.next_positions(device)[source[keep]]
    return Prefilled([rows[g] for g in going], cache, mask[source[keep]], first[keep], completed, positions)


def choose(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Draw each row's next token; its logprob (under the processed distribution) goes on the row."""
    params = [row.job.params for row in rows]
    logprobs = processed_logprobs(
        logits, [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params]
    )
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(id(row.job), (row.job.generator, []))[1].append(i)
    tokens = draw(logprobs, list(groups.values()))
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    for row, lp, top in zip(rows, chosen, top_of_rows(logprobs, [row.job.extras.topk_sample_logprobs for row in rows])):
        row.logprobs.append(lp)
        if top is not None:
            row.topk.append(top)
    return tokens


def record(rows: list[Row], tokens: torch.Tensor, tokenizer) -> list[int]:
    """Append each row's token; rows that ended become sequences. Returns the indices that go on."""
    going = []
    for i, (row, token) in enumerate(zip(rows, tokens.tolist())):
        row.tokens.append(token)
        job = row.job
        if job.stream is not None:
            job.stream.drew(
                row.index, token, row.logprobs[-1], row.topk[-1] if job.extras.topk_sample_logprobs else None
            )
        reason = finished(
            row.tokens,
            stop_ids=job.stop_ids,
            stop_strings=job.request.stop_strings,
            max_tokens=job.request.max_tokens,
            tokenizer=tokenizer,
        )
        if reason is None:
            going.append(i)
        else:
            job.sequences[row.index] = SampledSequence(
                tokens=row.tokens,
                logprobs=row.logprobs,
                stop_reason=reason,
                topk_logprobs=row.topk if job.extras.topk_sample_logprobs else None,
            )
    return going


class DecodeBatch:
    """The rows being decoded, their shared (left-padded) KV cache, attention mask and positions."""

    def __init__(self, bank: AdapterBank, host: ModelHost, prefixes: PrefixCache | None = None):
        self.bank = bank
        self.host = host
        self.prefixes = prefixes  # kept KV of prompts and answers (None: no reuse across admissions)
        self.rows: list[Row] = []
        self._cache = None  # DynamicCache over every row, or None when empty
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=host.device)
        self._positions = torch.zeros(0, dtype=torch.long, device=host.device)  # next position id per row
        self._last = torch.zeros(0, dtype=torch.long, device=host.device)  # last sampled token per row

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Length of the shared cache, padding included."""
        return self._mask.shape[1]

    def remaining(self) -> list[int]:
        """Per row, the most tokens it may still generate."""
        return [row.job.request.max_tokens - len(row.tokens) for row in self.rows]

    def admit(self, jobs: list[SampleJob]) -> list[SampleJob]:
        """Prefill the jobs' prompts (`prefill`) and add the rows that go on to the batch.

        Returns the jobs that are already complete (every row ended on its first token).
        """
        done = prefill(self.bank, self.host, jobs, self.prefixes)
        if done.rows:
            self._join(done.rows, done.cache, done.mask, done.last, done.positions)
        return done.completed

    def step(self) -> list[SampleJob]:
        """One decode step for every row; returns the jobs that completed in it."""
        mask = torch.cat(
            [self._mask, torch.ones((len(self.rows), 1), dtype=torch.long, device=self._mask.device)], dim=1
        )
        out = forward_rows(
            self.bank,
            [row.job.adapter for row in self.rows],
            input_ids=self._last.unsqueeze(1),
            attention_mask=mask,
            position_ids=self._positions.unsqueeze(1),
            cache=self._cache,
            use_cache=True,
        )
        self._cache, self._mask, self._positions = out.cache, mask, self._positions + 1
        tokens = choose(out.logits[:, -1], self.rows)
        rows = self.rows
        going = record(rows, tokens, self.host.tokenizer)
        if self.prefixes is not None and len(going) < len(rows):
            self._keep_answers(self.prefixes, going)
        completed = list({id(r.job): r.job for r in rows if r.job.done}.values())
        if len(going) < len(rows):
            self._keep(going)
        if going:
            self._last = tokens[torch.tensor(going, device=tokens.device)]
        return completed

    def forget(self, adapter: str | None) -> None:
        """Drop what is kept for an adapter that leaves the bank."""
        if self.prefixes is not None:
            self.prefixes.drop(adapter)

    def drop(self, job: SampleJob) -> list[Row]:
        """Remove the job's rows (its client cancelled) and their cache; returns them."""
        going = [i for i, row in enumerate(self.rows) if row.job is not job]
        dropped = [row for row in self.rows if row.job is job]
        if dropped:
            self._last = self._last[torch.tensor(going, dtype=torch.long, device=self._last.device)]
            self._keep(going)
        return dropped

    def fail_all(self) -> list[SampleJob]:
        """Drop every row (after a failed step); returns their jobs."""
        jobs = list({id(r.job): r.job for r in self.rows}.values())
        self._keep([])
        return jobs

    # ------------------------------------------------------------ internals

    def _keep_answers(self, prefixes: PrefixCache, going: list[int]) -> None:
        """Keep the KV of the rows that ended this step, of requests of one sample: a conversation's next turn
        starts with its prompt and answer. (A group of samples is scored, not continued.) The cache holds the
        prompt and every token but the last one drawn."""
        for i in sorted(set(range(len(self.rows))) - set(going)):
            row = self.rows[i]
            if row.job.num_samples != 1 or row.job.request.visual is not None:  # (image prompts are never kept)
                continue
            length = int(self._positions[i])
            tokens = np.concatenate([row.job.request.prompt, np.asarray(row.tokens[:-1], dtype=np.int64)])
            prefixes.keep(row.job.adapter, tokens, cache_rows.row_kv(self._cache, i, self.width - length), {})

    def _join(self, rows: list[Row], cache, mask: torch.Tensor, last: torch.Tensor, positions: torch.Tensor) -> None:
        """Add rows with their (left-padded) prefill cache and mask, and each one's next position id."""
        width = max(self.width, mask.shape[1])
        if self._cache is None:
            self._cache = cache
        else:
            cache_rows.join(self._cache, cache, width)
        self._mask = torch.cat([F.pad(self._mask, (width - self.width, 0)), F.pad(mask, (width - mask.shape[1], 0))])
        self._positions = torch.cat([self._positions, positions])
        self._last = torch.cat([self._last, last])
        self.rows.extend(rows)

    def _keep(self, going: list[int]) -> None:
        """Keep only rows `going`; cut the leading columns that are padding for all of them."""
        self.rows = [self.rows[i] for i in going]
        if not going:
            self._cache = None
            self._mask = self._mask[:0, :0]
            self._positions, self._last = self._positions[:0], self._last[:0]
            return
        index = torch.tensor(going, device=self._mask.device)
        mask = self._mask[index]
        cut = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
        self._mask, self._positions = mask[:, cut:], self._positions[index]
        cache_rows.select_rows(self._cache, index)
        cache_rows.cut_left(self._cache, cut)
