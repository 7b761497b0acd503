"""Batch-invariant sampling forwards: a row's numbers never depend on which other rows share its batch.

Why: the scheduler batches whatever is pending, so which requests share a forward depends on timing.
If a row's logits moved with its neighbours (in the last bits), the same seeded request would give
different logprobs, and now and then different tokens, from one run to the next, and a resumed or
repeated RL run would no longer reproduce the uninterrupted one bit for bit. Measured on CPU (MKL),
two things make a row depend on its neighbours, and both are removed here:

1. Attention over a padded KV cache: SDPA's reduction over key positions changes with the padding
   and, with more than one thread, with the batch size. A decode step (one query per row) attends
   in one batched matmul / softmax / matmul over the whole left-padded cache, padding masked to
   -inf, however many prompt lengths share the step. What made a row's numbers move with the
   padding was where its keys sat relative to the kernels' lanes and blocks, and each product is
   laid out so that it does not: the scores are taken as k @ q^T (a key's score is then the same
   wherever the key sits); the softmax, which sums in 8-lane vectors from the first column, runs
   on scores padded on the left with -inf to a multiple of `KEY_MULTIPLE` columns, so a key's column
   modulo 64 is fixed by its distance from the end, the same alone and batched, and masked keys add
   exact zeros; the values are taken as w @ v in blocks of `KEY_MULTIPLE` keys aligned from the end
   (each block one product of the same shape alone and batched), and the blocks' products are added
   in order from the left in fp32, so the blocks of padding before a row's keys add exact zeros.
   (One w @ v over the whole cache orders its reduction over keys by the cache's width on AVX-512:
   always with one query head per KV head, past a few hundred keys with more.) A cache shorter than
   `KEY_MULTIPLE` is padded, so that no product falls under torch's own small-matmul loop (another
   summation order). Measured with MKL on AVX-512 with AMX (Sapphire Rapids);
   `tests/test_grouped_sampling.py` checks it. (MKL, oneDNN and ATen held to AVX2 on the latter,
   `MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`, keep the attention
   invariant up to ~1500 keys but not whole forwards: no stand-in for an AVX2 host.) Prefills
   (many queries per row; alone the row has fewer) group rows by their left padding (runs of
   consecutive rows with the same first real column) and each group attends over its own unpadded
   keys.
2. Matmuls whose row count is not a multiple of `ROW_MULTIPLE` take other MKL kernels (another
   summation order) for the remainder rows. Every `F.linear` of a sampling forward is padded with
   zero rows to a multiple of `ROW_MULTIPLE` (8; 4 already sufficed on the AVX2 machine measured).
3. A prefill's queries take a decode step's arithmetic (`_prefill_as_decode`): each query is computed as
   the one new token of a decode step over the keys up to its own would be, alone. Its scores come from
   k @ q^T with the query's own heads as the product's only columns (with more columns, such as every
   query of the prompt at once, MKL sums over the head dimension in another order), its keys sit
   right-aligned from its own position in blocks of `KEY_MULTIPLE`, and its w @ v is added block by
   block from the left. So a position's numbers, its logits and the keys and values it leaves in the
   cache, are the same whether a whole prefill, the prefill of a suffix over kept keys and values, or a
   decode step computed them: what lets the sampler resume a prompt from KV kept from an earlier request
   (`prefix_cache`) and still give, bit for bit, what a whole prefill gives. (A plain prefill's
   attention differs from a decode step's in the last bits, and from one prompt split to the next.) It
   costs about 2-3x a plain prefill's attention (many small products).

`tests/test_batch_sampling.py` checks the result: a request alone and the same request batched with
others give bit-identical logprobs. Accelerators (cuBLAS, flash kernels) make no such promise whatever the
layout; there rows agree to floating-point tolerance only, and the layouts of 1. and 2. are not taken
(`invariant_layouts`): they would only add operators, each a kernel launch, to a decode step bound by
launches. There a decode step attends in one product over the unpadded cache, linears are not padded, and a
prefill attends per group of rows in one product over their keys.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from treadle.gpu_worker.sampling.hf import position_rules
from treadle.gpu_worker.sampling.hf.image_attention import attend_within_images

ROW_MULTIPLE = 8
KEY_MULTIPLE = 64  # see 1. above
PREFILL_SCORES = 1 << 24  # scores held at once by `_prefill_as_decode` (64 MB in fp32): it runs queries in chunks
IMPLEMENTATION = "treadle_rows"

_original_linear = F.linear
_sampler_threads: set[int] = set()  # threads inside `invariant_forward`; others get the plain F.linear
_patch_lock = threading.Lock()


def invariant_layouts(device: torch.device) -> bool:
    """Whether sampling forwards on `device` take the layouts of 1. and 2. above: on CPUs, where they make a row's
    numbers its own (measured with MKL); not on accelerators, where no layout does."""
    return device.type == "cpu"


def _padded_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if threading.get_ident() not in _sampler_threads or input.dim() == 0:
        return _original_linear(input, weight, bias)
    flat = input.reshape(-1, input.shape[-1])
    missing = -flat.shape[0] % ROW_MULTIPLE
    if not missing:
        return _original_linear(input, weight, bias)
    out = _original_linear(torch.cat([flat, flat.new_zeros(missing, flat.shape[1])]), weight, bias)
    return out[: flat.shape[0]].reshape(*input.shape[:-1], out.shape[-1])


def row_runs(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, first real column) of each run of consecutive rows of a left-padded 2-D
    attention mask that share their first real column."""
    starts = (mask.cumsum(dim=1) == 0).sum(dim=1).tolist()
    runs: list[tuple[int, int, int]] = []
    for row, start in enumerate(starts):
        if runs and runs[-1][2] == start:
            runs[-1] = (runs[-1][0], row + 1, start)
        else:
            runs.append((row, row + 1, start))
    return runs


def first_columns(mask: torch.Tensor) -> torch.Tensor:
    """Each row's first real column in a left-padded 2-D attention mask."""
    return (mask.cumsum(dim=1) == 0).sum(dim=1)


def _rows_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    row_runs: list[tuple[int, int, int]] | None = None,
    row_starts: torch.Tensor | None = None,
    decode_masks: dict | None = None,
    image_blocks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """HF attention interface: query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) -> (B, Lq, H, Dv), None.

    Every attention variant the model families use is applied here, as the model's own attention does:
    a sliding window (a query at position p sees keys p - window < k <= p: Gemma 3, gpt-oss, OLMo 3),
    attention sinks (one learned logit per head that takes part in the softmax and is then dropped:
    gpt-oss), logit soft-capping (Gemma 2), value heads narrower than query heads (DeepSeek's latent
    attention), Llama 4's chunks and position-scaled queries (`position_rules`), and a prefill's image tokens
    that attend both ways within their image (`image_blocks`: Gemma 3, `image_attention`). The cache always
    holds every position (`cache_rows`), so the window and the chunk are masks.
    """
    chunk = position_rules.chunk_size(module)
    if row_starts is not None and query.shape[2] == 1:
        if position_rules.tuned(module):
            query = position_rules.scale_queries(module, query, (key.shape[2] - 1 - row_starts)[:, None])
        masks = {} if decode_masks is None else decode_masks
        invariant = invariant_layouts(query.device)
        out = _decode_attention(
            query, key, value, row_starts, scaling, (sliding_window, chunk), s_aux, softcap, masks, invariant
        )
        return out, None
    if row_runs is None:
        raise RuntimeError(f"{IMPLEMENTATION} attention needs row_runs (only sampling forwards use it)")
    if position_rules.tuned(module):
        query = position_rules.scale_queries(module, query, _prefill_positions(row_runs, query, key))
    limits = (sliding_window, chunk)
    prefill = _prefill_as_decode if invariant_layouts(query.device) else _prefill_attention
    out = prefill(query, key, value, row_runs, scaling, limits, s_aux, softcap)
    if image_blocks is not None:
        attend_within_images(out, query, key, value, image_blocks, row_runs, scaling, sliding_window, s_aux, softcap)
    return out, None


def _prefill_positions(row_runs: list[tuple[int, int, int]], query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(B, Lq): each query's position in its row (negative on the left padding)."""
    starts = torch.tensor([start for begin, end, start in row_runs for _ in range(begin, end)], device=query.device)
    columns = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)
    return columns[None, :] - starts[:, None]


def _prefill_attention(query, key, value, row_runs, scaling, limits, s_aux, softcap) -> torch.Tensor:
    """Many queries per row: each run of rows with the same left padding attends over its own unpadded keys.
    `limits`: the layer's (sliding window, chunk), each None where it has none."""
    sliding_window, chunk = limits
    groups = query.shape[1] // key.shape[1]
    lq, lk = query.shape[2], key.shape[2]
    out = query.new_zeros((*query.shape[:3], value.shape[-1]))
    for begin, end, start in row_runs:
        first_query = max(0, start - (lk - lq))  # queries before it sit on padding: their output stays 0
        first_position = lk - lq + first_query - start  # of the first query; key b sits on column start + b
        first_key = start
        if lq - first_query == 1:  # one query: its window and its chunk are a slice
            if sliding_window is not None:
                first_key = max(first_key, lk - sliding_window)
            if chunk is not None:
                first_key = max(first_key, start + first_position - first_position % chunk)
        q = query[begin:end, :, first_query:]
        k = key[begin:end, :, first_key:].repeat_interleave(groups, dim=1)
        v = value[begin:end, :, first_key:].repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if q.shape[2] > 1:
            queries = torch.arange(first_position, first_position + q.shape[2], device=q.device)[:, None]
            keys = torch.arange(k.shape[2], device=q.device)[None, :]
            visible = keys <= queries
            if sliding_window is not None:
                visible &= keys > queries - sliding_window
            if chunk is not None:
                visible &= keys >= queries - queries % chunk
            scores = scores.masked_fill(~visible, float("-inf"))
        if s_aux is not None:  # the sink: one more logit per head, in the softmax, not in the output
            sink = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)
            weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        out[begin:end, :, first_query:] = torch.matmul(weights.to(q.dtype), v)
    return out.transpose(1, 2).contiguous()


def _decode_attention(query, key, value, row_starts, scaling, limits, s_aux, softcap, masks, invariant) -> torch.Tensor:
    """One query per row, every row in one call: `_rows_attention`'s arithmetic for a decode step, over
    the left-padded cache whose row b starts at column `row_starts[b]` (see 1. in the module docstring).
    `limits`: the layer's (sliding window, chunk). `masks` holds the step's masked columns, the same for every
    layer with the same cache and limits. Not `invariant` (an accelerator): no padding, and w @ v in one product."""
    batch, heads, _, dim = query.shape
    kv_heads, lk = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    sliding_window, chunk = limits
    mask_key = (lk, *limits)  # before a short cache is padded: row_starts moves with it
    # A short cache is padded (a small copy): products under 400 multiply-adds take torch's loop.
    if invariant and lk < KEY_MULTIPLE:
        key, value = F.pad(key, (0, 0, KEY_MULTIPLE - lk, 0)), F.pad(value, (0, 0, KEY_MULTIPLE - lk, 0))
        row_starts, lk = row_starts + KEY_MULTIPLE - lk, KEY_MULTIPLE
    width = -(-lk // KEY_MULTIPLE) * KEY_MULTIPLE if invariant else lk
    # k @ q^T: the query heads that share a KV head are one product's columns (no repeated copy of the
    # cache), and each key's score comes out the same wherever the key sits in the cache.
    scores = torch.matmul(key, query.reshape(batch, kv_heads, groups, dim).transpose(2, 3)).transpose(2, 3)
    scores = scores * scaling
    if width > lk:
        scores = F.pad(scores, (width - lk, 0), value=float("-inf"))  # (B, Hkv, groups, width)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask_key not in masks:
        columns = torch.arange(width, device=query.device)
        visible = columns >= (width - lk + row_starts)[:, None]
        if sliding_window is not None:  # the query sits on the last column: it sees the window's last keys
            visible &= columns >= width - sliding_window
        if chunk is not None:  # and its chunk's keys up to its own: position % chunk + 1 of them
            visible &= columns >= (width - 1 - (lk - 1 - row_starts) % chunk)[:, None]
        masks[mask_key] = ~visible[:, None, None, :]
    scores = scores.masked_fill(masks[mask_key], float("-inf"))
    if s_aux is not None:  # the sink, in the softmax, not in the output; last, on a column fixed alone and batched
        sink = s_aux.reshape(1, kv_heads, groups, 1).expand(batch, -1, -1, 1).to(scores.dtype)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights = weights.to(query.dtype)  # (B, Hkv, groups, width); column width - lk holds key 0
    if not invariant:
        return torch.matmul(weights, value).reshape(batch, 1, heads, value.shape[-1])
    # w @ v in blocks of `KEY_MULTIPLE` keys aligned from the end (1. in the module docstring), added
    # in order from the left in fp32; each block is a view of the cache but the first, partial one.
    out = query.new_zeros((batch, kv_heads, groups, value.shape[-1]), dtype=torch.float32)
    first = lk % KEY_MULTIPLE
    if first:
        out += torch.matmul(weights[..., :KEY_MULTIPLE], F.pad(value[:, :, :first], (0, 0, KEY_MULTIPLE - first, 0)))
    for key in range(first, lk, KEY_MULTIPLE):
        column = width - lk + key
        out += torch.matmul(weights[..., column : column + KEY_MULTIPLE], value[:, :, key : key + KEY_MULTIPLE])
    return out.to(query.dtype).reshape(batch, 1, heads, value.shape[-1])


def _prefill_as_decode(query, key, value, row_runs, scaling, limits, s_aux, softcap) -> torch.Tensor:
    """A prefill's attention with each query computed as `_decode_attention` computes the one query of a row
    whose cache ends at the query's own key (3. in the module docstring). Rows of a run start at the same
    column; the queries before it sit on padding (output 0), those after a row's last real token attend
    whatever is there (their output is never read). -> (B, Lq, H, Dv)"""
    lq, lk = query.shape[2], key.shape[2]
    out = query.new_zeros((query.shape[0], lq, query.shape[1], value.shape[-1]))
    for begin, end, start in row_runs:
        first_query = max(0, start - (lk - lq))  # query a sits on column lk - lq + a
        chunk = max(1, PREFILL_SCORES // (query.shape[1] * (2 * (lk - start) + KEY_MULTIPLE)))
        for row in range(begin, end):
            for first in range(first_query, lq, chunk):
                last = min(lq, first + chunk)
                seen = lk - lq + last - start  # keys of the chunk's last query, its own included
                out[row, first:last] = _queries_as_decode(
                    query[row, :, first:last],
                    key[row, :, start : start + seen],
                    value[row, :, start : start + seen],
                    scaling,
                    limits,
                    s_aux,
                    softcap,
                )
    return out


def _queries_as_decode(query, key, value, scaling, limits, s_aux, softcap) -> torch.Tensor:
    """Queries (H, n, D) of one row, query j seeing keys 0 .. m - n + j of key (Hkv, m, D) and value (Hkv, m, Dv),
    each as `_decode_attention` alone over those keys; `limits`: the layer's (sliding window, chunk). -> (n, H, Dv)"""
    sliding_window, chunk = limits
    heads, n, dim = query.shape
    positions = torch.arange(key.shape[1] - n, key.shape[1], device=query.device)  # of the queries
    kv_heads, short = key.shape[0], max(0, KEY_MULTIPLE - key.shape[1])
    if short:  # as a decode step pads a short cache (masked below): products this small take torch's own loop
        key, value = F.pad(key, (0, 0, short, 0)), F.pad(value, (0, 0, short, 0))
    m, groups = key.shape[1], heads // kv_heads
    width = -(-m // KEY_MULTIPLE) * KEY_MULTIPLE  # the widest query's decode width
    own = m - n  # the first query's own key
    # Per query, k @ q^T with its own heads as the columns: a batch of the decode step's products over the keys.
    per_query = query.reshape(kv_heads, groups, n, dim).transpose(1, 2).contiguous()  # (Hkv, n, groups, D)
    scores = torch.stack(
        [torch.bmm(key[h].expand(n, m, dim), per_query[h].transpose(1, 2)) for h in range(kv_heads)]
    )  # (Hkv, n, m, groups)
    scores = scores.permute(0, 3, 1, 2) * scaling  # (Hkv, groups, n, m)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores[..., :short] = float("-inf")
    # Skewed: row j holds keys 0 .. own + j right-aligned in `width` columns, -inf before (masked keys).
    padded = F.pad(scores, (width, 0), value=float("-inf")).contiguous()
    strides = padded.stride()
    scores = padded.as_strided(
        (kv_heads, groups, n, width), (strides[0], strides[1], width + m + 1, 1), padded.storage_offset() + own + 1
    )
    if sliding_window is not None and sliding_window < width:  # the query sees the window's last keys
        scores = scores.clone()
        scores[..., : width - sliding_window] = float("-inf")
    if chunk is not None:  # the query sees its chunk's keys up to its own: position % chunk + 1 of them
        hidden = torch.arange(width, device=query.device)[None, :] < (width - 1 - positions % chunk)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    if s_aux is not None:  # the sink, last, as a decode step puts it
        sink = s_aux.reshape(kv_heads, groups, 1, 1).expand(-1, -1, n, 1).to(scores.dtype)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights = weights.to(query.dtype).permute(0, 2, 1, 3)  # (Hkv, n, groups, width)
    # w @ v per block of `KEY_MULTIPLE` keys aligned from each query's own key (a strided view of the values,
    # padded with zeros before key 0), added in order from the left in fp32; a block before a query's first key
    # would add exact zeros, so it starts at the first query that sees one.
    padded_values = F.pad(value, (0, 0, width, 0)).contiguous()  # (Hkv, width + m, Dv)
    rows, columns = padded_values.stride()[1:]
    out = torch.zeros((kv_heads, n, groups, value.shape[-1]), dtype=torch.float32, device=query.device)
    for block in range(width // KEY_MULTIPLE - 1, -1, -1):
        first = max(0, KEY_MULTIPLE * block - own)
        if first >= n:
            continue
        key_0 = own + 1 + width - KEY_MULTIPLE * (block + 1) + first  # row of query `first`'s block in the values
        window = slice(width - KEY_MULTIPLE * (block + 1), width - KEY_MULTIPLE * block)
        for h in range(kv_heads):
            blocks = padded_values[h].as_strided(
                (n - first, KEY_MULTIPLE, value.shape[-1]),
                (rows, rows, columns),
                padded_values[h].storage_offset() + key_0 * rows,
            )
            out[h, first:] += torch.bmm(weights[h, first:, :, window], blocks)
    return out.to(query.dtype).permute(1, 0, 2, 3).reshape(n, heads, value.shape[-1])


AttentionInterface.register(IMPLEMENTATION, _rows_attention)


@contextmanager
def invariant_forward(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, this thread's forwards of `model` are batch-invariant; the caller passes
    `row_runs=row_runs(attention_mask)` to the model call, or in a decode step (one new token per row)
    `row_starts=first_columns(attention_mask)` and `decode_masks={}` (filled by the first layer, read by the
    others). Callers hold the device lock."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    if not invariant_layouts(model.device):
        try:
            with position_rules.own_positions(model):
                yield
        finally:
            config._attn_implementation = previous
        return
    with _patch_lock:
        # nn.Linear looks F.linear up at call time; other threads pass straight through, and the
        # plain function is back once no sampling forward runs.
        _sampler_threads.add(threading.get_ident())
        F.linear = _padded_linear
    try:
        with position_rules.own_positions(model):
            yield
    finally:
        with _patch_lock:
            _sampler_threads.discard(threading.get_ident())
            if not _sampler_threads:
                F.linear = _original_linear
        config._attn_implementation = previous
