"""What an attention layer does by a token's position, applied by the sampler's attention from each row's own positions.

The sampler's attention (`row_invariant`, `slot_cache`) knows where each row's tokens sit (rows left-padded to
one width, or in slots from column 0); transformers' attention modules see only the batch's shared shape. Two
position rules of Llama 4 are applied there, per row:

- **chunked attention** (a layer of type "chunked_attention", chunk size C = `attention_chunk_size`): a query at
  position p sees the keys p - p % C <= k <= p, its own chunk, counted from the row's first token (as
  transformers' `chunked_overlay` counts them from a row's first unpadded token);
- **temperature tuning** (layers without RoPE, `attn_temperature_tuning`): queries scaled by
  log1p(floor((p + 1) / floor_scale)) * attn_scale + 1. The module takes p from the cache's length, which in a
  padded batch or a slot of fixed capacity is not the row's position; within the sampler's forwards
  (`own_positions`) the module leaves the scaling to the sampler's attention, which multiplies each query by
  its scale in the same dtypes (the scale in fp32), so the numbers are the module's own.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch

_TUNED: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def chunk_size(module: torch.nn.Module) -> int | None:
    """The chunk an attention module's queries see (None: the layer is not chunked)."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[module.layer_idx] == "chunked_attention":
        return int(config.attention_chunk_size)  # type: ignore[union-attr]
    return None


def tuned(module: torch.nn.Module) -> bool:
    """Whether the module's queries are scaled by their positions (Llama 4's layers without RoPE)."""
    config = getattr(module, "config", None)
    return bool(getattr(config, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def scale_queries(module: torch.nn.Module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """query (B, H, Lq, D) of queries at `positions` (B, Lq), scaled as the module scales them."""
    positions = positions.clamp(min=0).float()  # (queries on padding: their outputs are never read)
    scales = torch.log1p(torch.floor((positions + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales[:, None, :, None]).to(query.dtype)


@contextmanager
def own_positions(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's attention modules leave temperature tuning to the sampler's attention."""
    if model not in _TUNED:
        _TUNED[model] = [m for m in model.modules() if tuned(m)]
    modules = _TUNED[model]
    previous = [module.attn_temperature_tuning for module in modules]  # (a nested block leaves it off)
    for module in modules:
        module.attn_temperature_tuning = False
    try:
        yield
    finally:
        for module, value in zip(modules, previous):
            module.attn_temperature_tuning = value
