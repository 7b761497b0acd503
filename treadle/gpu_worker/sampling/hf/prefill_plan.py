"""The prefill of one admission: each distinct prompt once, each from the end of its kept prefix (`prefix_cache`).

Prompts admitted together that are equal (same adapter, same tokens) share one row. A prompt with nothing
kept is one left-padded row, as every row of a batch is. A prompt that resumes from kept keys and values
has them in the forward's cache, right-aligned before the columns of the new tokens, and its new tokens
come right after them, padded on the right: its keys stay one run of columns, which the attention's
layouts need (`row_invariant`). The forward's logits are taken at each row's last token
(`logits_to_keep`), and afterwards those rows are shifted right (`cache_rows.shift_right`) so the cache is
left-padded, as the decode batch joins it. A prompt kept whole, with the logits after it, needs no row in
the forward: its cache rows are the kept ones.

A prompt with images is a row of its own, never kept nor resumed: its image tokens' ids do not say which
image they show, and where image tokens attend both ways within an image (Gemma 3) a kept prefix that ended
inside an image would hold keys computed without the image's later tokens. Its image features are computed
before the forward, with its row's adapter (`images`), a model with multimodal rotary positions gets the
prompt's own (`model.vision`), and one whose image tokens attend both ways gets each image's columns
(`image_blocks`, which the attention reads: `image_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.model.vision import VisualInput, batch_positions, image_blocks
from treadle.gpu_worker.sampling.backend import SampleJob
from treadle.gpu_worker.sampling.hf import cache_rows
from treadle.gpu_worker.sampling.hf.prefix_cache import Kept, PrefixCache


@dataclass
class Prompt:
    """One distinct prompt of an admission."""

    adapter: str | None
    tokens: np.ndarray
    wants_logits: bool  # a job asked for the logits of every prompt position: prefilled whole
    kept: Kept | None = None
    reused: int = 0  # leading tokens whose keys and values come from `kept`
    visual: VisualInput | None = None  # its images

    @property
    def next_position(self) -> int:
        """The position id of the token after the prompt."""
        return self.visual.next_position if self.visual is not None else len(self.tokens)

    @property
    def suffix(self) -> int:
        """Tokens the forward runs."""
        return len(self.tokens) - self.reused


class PrefillPlan:
    """The distinct prompts of `jobs` (`prompts`; job i's is `prompts[of_job[i]]`), those the forward runs (`run`),
    its inputs, and afterwards one cache row and one row of next-token logits per distinct prompt."""

    def __init__(self, jobs: list[SampleJob], wants_logits: list[bool], prefixes: PrefixCache | None):
        self.prompts: list[Prompt] = []
        self.of_job: list[int] = []
        index: dict[tuple[str | None, bytes], int] = {}
        for j, (job, wants) in enumerate(zip(jobs, wants_logits)):
            visual = job.request.visual
            key = (job.adapter, job.request.prompt.tobytes() if visual is None else str(j).encode())
            if key not in index:
                index[key] = len(self.prompts)
                self.prompts.append(Prompt(job.adapter, job.request.prompt, False, visual=visual))
            self.prompts[index[key]].wants_logits |= wants
            self.of_job.append(index[key])
        for prompt in self.prompts:
            if prefixes is not None and not prompt.wants_logits and prompt.visual is None:
                prompt.kept, prompt.reused = prefixes.longest(prompt.adapter, prompt.tokens)
        self.run = [p for p in self.prompts if p.suffix]
        # Kept whole, with the logits after them: no forward row.
        self.whole = [(p, p.kept) for p in self.prompts if not p.suffix and p.kept is not None]
        self.past = max((p.reused for p in self.run), default=0)  # cache columns before the new tokens
        self.length = max((p.suffix for p in self.run), default=0)  # the forward's token columns
        # Cache and logits rows: `run` then `whole`.
        self.row = {id(p): r for r, p in enumerate([*self.run, *(p for p, _ in self.whole)])}

    @property
    def prefilled(self) -> int:
        return sum(p.suffix for p in self.run)

    def _last(self, prompt: Prompt) -> int:
        """The forward's column of a run prompt's last token."""
        return prompt.suffix - 1 if prompt.reused else self.length - 1

    def inputs(self, host: ModelHost) -> dict:
        """`forward_rows`' keyword arguments (besides the adapters: `[p.adapter for p in run]`)."""
        past, length = self.past, self.length
        ids = torch.full((len(self.run), length), host.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(self.run), past + length), dtype=torch.long)
        for r, p in enumerate(self.run):
            if p.reused:
                ids[r, : p.suffix] = torch.tensor(p.tokens[p.reused :])
                mask[r, past - p.reused : past + p.suffix] = 1
            else:
                ids[r, length - p.suffix :] = torch.tensor(p.tokens)
                mask[r, past + length - p.suffix :] = 1
        rows = [p.kept.prefix(p.reused) if p.kept is not None and p.reused else None for p in self.run]
        cache = cache_rows.from_rows(host.model.config, rows, past)
        keep = 0 if any(p.wants_logits for p in self.run) else torch.tensor(sorted({self._last(p) for p in self.run}))
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, past:]
        if any(p.visual is not None and p.visual.positions is not None for p in self.run):
            # Rows with images never resume (past is 0 for them), so their columns are the whole prompt's.
            multimodal = batch_positions(
                [p.visual for p in self.run], [len(p.tokens) for p in self.run], length, left=True
            )
            text = positions.expand(3, -1, -1)
            has_own = torch.tensor([p.visual is not None and p.visual.positions is not None for p in self.run])
            positions = torch.where(has_own[None, :, None], multimodal, text)
        inputs = dict(
            input_ids=ids.to(host.device),
            attention_mask=mask.to(host.device),
            position_ids=positions.to(host.device),
            use_cache=True,
            logits_to_keep=keep if isinstance(keep, int) else keep.to(host.device),
            cache=cache,
        )
        if any(p.visual is not None for p in self.run):
            inputs["images"] = [p.visual.pictures if p.visual is not None else () for p in self.run]
            if host.vision is not None and host.vision.bidirectional:
                # On the host: each attention layer reads the images' columns from it, with no device sync.
                inputs["image_blocks"] = self._image_blocks(host.vision.image_token_id)
        return inputs

    def _image_blocks(self, image_token: int) -> torch.Tensor:
        """(rows, past + length): the image block of each key column of the forward (`vision.image_blocks`), -1
        outside images. An image row is its whole prompt, right-aligned in the columns."""
        is_image = torch.zeros((len(self.run), self.past + self.length), dtype=torch.bool)
        for r, p in enumerate(self.run):
            if p.visual is not None:
                is_image[r, is_image.shape[1] - len(p.tokens) :] = torch.from_numpy(p.tokens == image_token)
        return image_blocks(is_image)

    def finish(self, out, host: ModelHost) -> tuple[object, torch.Tensor, torch.Tensor]:
        """The cache (left-padded, one row per distinct prompt), its attention mask, and each row's logits after
        its prompt, from the forward's output (None when nothing ran). `next_positions` gives each row's next
        position id."""
        device = host.device
        last, cache = [], None
        if self.run:
            cache = out.cache
            shifts = [self.length - p.suffix if p.reused else 0 for p in self.run]
            if any(shifts):
                cache_rows.shift_right(cache, torch.tensor(shifts, device=device))
            kept_columns = out.logits.shape[1] < self.length
            columns = sorted({self._last(p) for p in self.run})
            for r, p in enumerate(self.run):
                last.append(out.logits[r, columns.index(self._last(p)) if kept_columns else self._last(p)])
        width = max([self.past + self.length, *(len(p.tokens) for p, _ in self.whole)])
        if self.whole:
            rows = [kept.prefix(len(p.tokens)) for p, kept in self.whole]
            whole = cache_rows.from_rows(host.model.config, rows, width)
            if cache is None:
                cache = whole
            else:
                cache_rows.join(cache, whole, width)
            last += [kept.logits[len(p.tokens)] for p, kept in self.whole]
        mask = torch.zeros((len(self.prompts), width), dtype=torch.long, device=device)
        for p in self.prompts:
            mask[self.row[id(p)], width - len(p.tokens) :] = 1
        return cache, mask, torch.stack(last)

    def next_positions(self, device: torch.device) -> torch.Tensor:
        """Per cache row (as `finish` orders them), the position id of the token after its prompt."""
        positions = torch.zeros(len(self.prompts), dtype=torch.long)
        for p in self.prompts:
            positions[self.row[id(p)]] = p.next_position
        return positions.to(device)

    def prompt_logits(self, out, prompt: Prompt) -> torch.Tensor:
        """The logits at every position of a prompt that asked for them (`wants_logits`: a left-padded run row)."""
        return out.logits[self.row[id(prompt)], self.length - len(prompt.tokens) :]

    def keep(self, prefixes: PrefixCache, cache, mask: torch.Tensor, last: torch.Tensor) -> None:
        """Keep each prompt the forward ran, with the logits after it."""
        width = mask.shape[1]
        for p in self.run:
            if p.visual is not None:
                continue
            row = self.row[id(p)]
            kv = cache_rows.row_kv(cache, row, width - len(p.tokens))
            prefixes.keep(p.adapter, p.tokens, kv, {len(p.tokens): last[row].clone()})
