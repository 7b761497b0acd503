"""A sample request's prompt- and sample-side logprob options, from logits the HF sampler has anyway.

Tinker 0.38's semantics (`tinker.types.SampleRequest`, `SampleResponse`, `PromptAltTokens`):
- `target_prompt_logprobs`: int64 ids [len(prompt) - 1, K]; cell [i, j] is scored at prompt position
  i + 1, from the prefill's logits after prompt[: i + 1]; -1 asks for nothing and gets 0.0. These are
  the model's raw logprobs, the numbers `compute_logprobs` and the trainer's forward give.
- `prompt_alt_tokens_k`: k draws with replacement, at the request's temperature (0: the most likely
  token k times), from the next-token distribution at every prompt position after the first, each
  with the model's raw logprob (what `target_prompt_logprobs` would give that id there). They come
  from a generator of their own, seeded from the request's, so asking for them never changes the
  tokens sampled for a seed.
- `topk_sample_logprobs`: per sampled token, the k most likely tokens of the distribution it was drawn
  from (after temperature, top-k and top-p, like the sampled token's own logprob); tokens that
  distribution excludes are left out, so a row may hold fewer than k (one at temperature 0). The vllm
  backend serves this one too, from vLLM's processed logprobs; the prompt-side ones only the HF backend.

Each value comes from its own request's rows of a batch-invariant forward, and row-wise ops after it,
so a request batched with others gets what it would get alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.errors import InvalidRequestError
from treadle.types import PromptAltTokens, TensorData

ALT_SEED_SALT = 0x5A17  # the alternatives' generator: the request's seed plus this, so its own stream


@dataclass(frozen=True)
class SampleExtras:
    """The options as the sampler takes them (bounded already by `treadle.queue.sample_options`)."""

    topk_sample_logprobs: int = 0
    target_ids: np.ndarray | None = None  # int64 [len(prompt) - 1, K], -1: none
    prompt_alt_tokens_k: int = 0

    @property
    def from_prompt(self) -> bool:
        """Whether the prefill's logits over the whole prompt are needed."""
        return self.target_ids is not None or self.prompt_alt_tokens_k > 0

    def refuse_prompt_side(self, backend: str) -> None:
        """For a backend that serves the sample-side option only: an error naming the first prompt-side one asked for."""
        asked = {
            "target_prompt_logprobs": self.target_ids is not None,
            "prompt_alt_tokens_k": self.prompt_alt_tokens_k,
        }
        for name, value in asked.items():
            if value:
                raise InvalidRequestError(
                    f"{name}: not served by {backend}; leave it at its default or run the worker with --sampler hf"
                )

    def check(self, vocab_size: int) -> None:
        if self.target_ids is not None and (bad := np.flatnonzero(self.target_ids.reshape(-1) >= vocab_size)).size:
            i, j = divmod(int(bad[0]), self.target_ids.shape[1])
            raise InvalidRequestError(
                f"target_prompt_logprobs[{i}][{j}]: token id {int(self.target_ids[i, j])} "
                f"outside vocabulary (size {vocab_size})"
            )


def score_prompt(logits: torch.Tensor, extras: SampleExtras, temperature: float, seed: int) -> dict:
    """The response fields of the prompt-side options, from one prompt's logits (length, vocab)."""
    if not extras.from_prompt:
        return {}
    all_lp = torch.log_softmax(logits[:-1].float(), dim=-1)  # row i: the distribution over prompt token i + 1
    fields: dict = {}
    if extras.target_ids is not None:
        ids = torch.tensor(
            extras.target_ids, dtype=torch.long, device=all_lp.device
        )  # a copy: wire arrays are read-only
        scored = all_lp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
        fields["target_prompt_logprobs"] = TensorData.from_numpy(scored.cpu().numpy())
    if k := extras.prompt_alt_tokens_k:
        if temperature == 0 or all_lp.shape[0] == 0:  # multinomial refuses an empty matrix
            drawn = all_lp.argmax(dim=-1, keepdim=True).expand(-1, k).contiguous()
        else:
            generator = torch.Generator(device=all_lp.device)
            generator.manual_seed((seed + ALT_SEED_SALT) % 2**63)
            probs = torch.softmax(logits[:-1].float() / temperature, dim=-1)
            drawn = torch.multinomial(probs, k, replacement=True, generator=generator)
        fields["prompt_alt_tokens"] = PromptAltTokens(
            tokens=TensorData.from_numpy(drawn.cpu().numpy().astype(np.int64)),
            logprobs=TensorData.from_numpy(all_lp.gather(1, drawn).cpu().numpy()),
        )
    return fields


def top_of_rows(logprobs: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]] | None]:
    """Per row of one step's processed logprobs, its top ks[row] (token, logprob), excluded tokens left
    out; None for rows that asked for none."""
    widest = max(ks)
    if not widest:
        return [None] * len(ks)
    values, ids = logprobs.topk(widest, dim=-1)
    return [
        [(t, v) for t, v in zip(i[:k], lp[:k]) if v > float("-inf")] if k else None
        for k, i, lp in zip(ks, ids.tolist(), values.tolist())
    ]
