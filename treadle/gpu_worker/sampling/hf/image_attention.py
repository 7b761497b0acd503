"""A prefill's attention within an image, for models whose image tokens attend to each other both ways.

Gemma 3's image tokens see every token of their own image, later ones too; the rest of the sequence is causal
(transformers' Gemma 3 mask: OR(causal, same image block), and on a sliding-window layer AND(window, that),
the window bounding only how far back a query sees). The sampler's prefill attention (`row_invariant`) first
computes every query causally; the queries of each image block are then computed again over the keys up to
the block's end (`attend_within_images`). Only a prefill needs it: a decode step's token comes after every
image, and the keys and values the prefill leaves in the cache are those of the bidirectional forward.

Each block's queries are one product over that row's own keys (copied out of the padded batch), so their
numbers depend only on the row: the same alone and in a mixed batch.
"""

from __future__ import annotations

import torch


def attend_within_images(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    image_blocks: torch.Tensor,
    row_runs: list[tuple[int, int, int]],
    scaling: float,
    sliding_window: int | None,
    s_aux: torch.Tensor | None,
    softcap: float | None,
) -> None:
    """Overwrite, in `out` (B, Lq, H, Dv), the output of every query inside an image block. `image_blocks` (B, Lk):
    each key column's block (`vision.image_blocks`, on the host; -1 outside images), whose columns are the forward's
    query columns too (an image row never resumes from kept keys); `row_runs`: each row's first real column."""
    lq, lk = query.shape[2], key.shape[2]
    for begin, end, start in row_runs:
        for row in range(begin, end):
            ids = image_blocks[row]
            for block in ids[ids >= 0].unique().tolist():
                columns = (ids == block).nonzero().flatten()
                first, stop = int(columns[0]), int(columns[-1]) + 1
                out[row, first - (lk - lq) : stop - (lk - lq)] = _block_queries(
                    query[row, :, first - (lk - lq) : stop - (lk - lq)].contiguous(),
                    key[row, :, start:stop].contiguous(),
                    value[row, :, start:stop].contiguous(),
                    scaling,
                    sliding_window,
                    s_aux,
                    softcap,
                )


def _block_queries(query, key, value, scaling, sliding_window, s_aux, softcap) -> torch.Tensor:
    """Queries (H, n, D), the last n positions of a block whose keys are the last n of key (Hkv, m, D) and value
    (Hkv, m, Dv): each sees every key up to the block's end, the window's lower bound its own. -> (n, H, Dv)"""
    heads, n, dim = query.shape
    kv_heads, m = key.shape[0], key.shape[1]
    groups = heads // kv_heads
    # k @ q^T with the query heads that share a KV head as one product's columns, as the decode step takes them.
    grouped = query.reshape(kv_heads, groups, n, dim).transpose(2, 3)  # (Hkv, groups, D, n)
    scores = torch.matmul(key[:, None], grouped).transpose(2, 3) * scaling  # (Hkv, groups, n, m)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if sliding_window is not None:  # query j sits at key m - n + j: it sees keys after its own minus the window
        positions = torch.arange(m - n, m, device=query.device)[:, None]
        scores = scores.masked_fill(
            torch.arange(m, device=query.device)[None, :] <= positions - sliding_window, -torch.inf
        )
    if s_aux is not None:  # the sink: one more logit per head, in the softmax, not in the output
        sink = s_aux.reshape(kv_heads, groups, 1, 1).expand(-1, -1, n, 1).to(scores.dtype)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(weights.to(query.dtype), value[:, None])  # (Hkv, groups, n, Dv)
    return out.reshape(heads, n, value.shape[-1]).transpose(0, 1)
