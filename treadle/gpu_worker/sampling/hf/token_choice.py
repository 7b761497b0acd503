"""Choosing the next token of many rows at once, each row with its own sampling parameters and RNG.

`processed_logprobs` turns one step's logits (rows x vocab) into log-probabilities of the
distribution each row samples from: temperature, then top-k, then top-p (nucleus), applied per row
in that order, exactly as HF's `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper`
do for a single row. Temperature 0 means greedy: a point mass on the most likely token (logprob 0).
The logprob reported for a sampled token is read from this processed distribution, so it is the
logprob of the distribution actually sampled from, which importance-sampling and PPO ratios need.
At temperature 1 with no top-k/top-p it is the model's own logprob.

`draw` samples one token per row, with one `torch.Generator` per request: a request's draws come
from its own RNG stream, so they do not depend on which other requests share the batch.

`finished` decides, after a token is appended, whether a row has ended and why (`stop` at EOS, a
stop token id, or once its text contains a stop string, the completing token kept; `length` at
max_tokens).
"""

from __future__ import annotations

import torch

from treadle.types import StopReason


def processed_logprobs(
    logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """(rows, vocab) float32 log-probabilities after each row's temperature, top-k and top-p."""
    # The parameters are Python numbers: deciding on them never waits for the device (on a GPU, a sync per step).
    scores = logits.float()
    greedy = [t == 0 for t in temperature]
    temps = [t if t > 0 else 1.0 for t in temperature]
    if any(t != 1.0 for t in temps):
        scores = scores / torch.tensor(temps, device=scores.device, dtype=scores.dtype).unsqueeze(1)
    vocab = scores.shape[-1]
    # Greedy is top-k 1 (the most likely token); -1 keeps everything.
    ks = [1 if g else (vocab if k < 0 else min(k, vocab)) for g, k in zip(greedy, top_k)]
    ps = [1.0 if g else p for g, p in zip(greedy, top_p)]
    filtered = [i for i, (k, p) in enumerate(zip(ks, ps)) if k < vocab or p < 1.0]
    if filtered:
        scores = scores.clone()
        scores[filtered] = _filter(scores[filtered], [ks[i] for i in filtered], [ps[i] for i in filtered])
    return torch.log_softmax(scores, dim=-1)


def _filter(scores: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Top-k then top-p on some rows (one sort for both); removed tokens get -inf."""
    device = scores.device
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    k = torch.tensor(ks, device=device)
    # Top-k keeps every token at least as likely as the k-th (ties at the threshold survive, as in HF).
    threshold = ordered.gather(1, (k - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < threshold, float("-inf"))
    p = torch.tensor(ps, device=device, dtype=scores.dtype).unsqueeze(1)
    # Top-p as HF computes it: in ascending order, drop tokens whose cumulative mass (including
    # themselves) is <= 1 - p, always keeping the most likely one.
    ascending = ordered.flip(-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = (cumulative <= 1 - p) & (p < 1.0)
    drop[:, -1] = False
    ordered = ascending.masked_fill(drop, float("-inf")).flip(-1)
    return torch.empty_like(scores).scatter_(1, order, ordered)


def draw(logprobs: torch.Tensor, groups: list[tuple[torch.Generator, list[int]]]) -> torch.Tensor:
    """One token per row; `groups` pairs each request's generator with its rows (in row order).

    Inverse-CDF sampling, one uniform per row from its request's generator: the token is the first whose running
    probability exceeds u times the row's total. `torch.multinomial` draws one exponential per vocabulary entry (8 rows
    of a 49k vocabulary took 7 ms of a decode step on one core, one call per request); here the RNG draws one number
    per row, and the running sums are taken in two levels, for all rows at once: the sums of `DRAW_BLOCK`-token blocks
    (float32, each over its own block), their running sum in float64, then the running sum within the chosen block.
    Every step reads one row alone (sums along it, a binary search), so a row's token depends on its logits and its
    request's stream only, never on the rows batched beside it."""
    rows, vocab = logprobs.shape
    device = logprobs.device
    probs = logprobs.exp()
    members = [i for _, rows_of in groups for i in rows_of]
    uniforms = torch.empty(rows, dtype=torch.float64, device=device)
    uniforms[torch.tensor(members, device=device)] = torch.cat(
        [torch.rand(len(rows_of), generator=g, dtype=torch.float64, device=device) for g, rows_of in groups]
    )
    full = vocab - vocab % DRAW_BLOCK
    blocks = probs[:, :full].reshape(rows, -1, DRAW_BLOCK).sum(-1)
    if full < vocab:
        blocks = torch.cat([blocks, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    running = torch.cat([blocks.new_zeros((rows, 1), dtype=torch.float64), blocks.double().cumsum(-1)], dim=1)
    total = running[:, -1:]
    # u < 1, but u * total may round up to the total: stay below it, so that the search lands on a block with mass.
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(running, target, right=True) - 1
    index = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=device)
    inside = probs.gather(1, index.clamp(max=vocab - 1)).masked_fill_(index >= vocab, 0.0).double().cumsum(-1)
    # The block's running sum may end a rounding below its float32 sum: stay below its own end, for the same reason.
    rest = torch.minimum(target - running.gather(1, block), torch.nextafter(inside[:, -1:], torch.zeros_like(total)))
    return (block * DRAW_BLOCK + torch.searchsorted(inside, rest.clamp(min=0), right=True)).squeeze(1)


# Tokens per block of `draw`'s two-level search: the first level is a few hundred sums for a 100k vocabulary, the
# second a running sum of one block.
DRAW_BLOCK = 256


def finished(
    tokens: list[int], *, stop_ids: frozenset[int], stop_strings: list[str], max_tokens: int, tokenizer
) -> StopReason | None:
    """Why the row ends after its latest token, or None while it goes on."""
    if tokens[-1] in stop_ids:
        return "stop"
    if stop_strings:
        # Only a stop string completed by the latest token can be new: decode a tail long enough to
        # hold the longest one (a character may take up to 4 byte-level tokens).
        tail = tokenizer.decode(tokens[-(4 * max(len(s) for s in stop_strings) + 1) :])
        if any(s in tail for s in stop_strings):
            return "stop"
    if len(tokens) >= max_tokens:
        return "length"
    return None
