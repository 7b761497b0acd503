"""Row operations on a decode batch's cache, for every kind of cache layer the model families use.

The continuous batcher (`batch_decode`) adds rows to a running batch, drops finished ones and cuts
columns that became padding for every row. HF caches hold two kinds of per-layer state, and each
operation treats them as what they are:

- **attention layers** (`keys`/`values`, batch x heads x length x dim): grow with the sequence; rows
  of different lengths are left-padded to one width. Sliding-window layers are kept as full layers
  (`new_cache`): a sliding layer trims its history to the window, which would break the batch's
  shared column layout; the window is applied by the batch-invariant attention as a mask instead.
- **linear-attention / recurrent layers** (`conv_states`/`recurrent_states`, batch x fixed size;
  Qwen3.5's gated delta net, Mamba-style mixers): one fixed-size state per row, no length axis, so
  joining rows is a concatenation and padding columns never touch them.

A hybrid layer class holding both kinds is handled as both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin


def new_cache(config) -> DynamicCache:
    """An empty cache for a sampling forward of a model with `config`: the model's own layer kinds, with
    every sliding-window attention layer replaced by a full one (see the module docstring)."""
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
            cache.layers[index] = DynamicLayer()
    unsupported = sorted({type(layer).__name__ for layer in cache.layers if not _known(layer)})
    if unsupported:
        raise ValueError(f"cache layers {unsupported} are not supported by the batched sampler")
    return cache


def supported(model: torch.nn.Module) -> str | None:
    """None if the batched sampler can run `model`, else why not: its cache layers are of kinds handled here, and
    its own forward takes the sampler's cache (a prefill of two tokens, then a decode step, as the sampler calls
    it). A model that keeps its state in a cache class of its own (MiniMax's lightning attention) refuses it, and
    is refused at load rather than at its first sample."""
    try:
        cache = new_cache(model.config)
    except (ValueError, KeyError) as exc:
        return str(exc)
    device = model.device
    tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            for step in (tokens, tokens[:, :1]):  # the prefill, then one decode step
                seen = cache.get_seq_length()
                positions = torch.arange(seen, seen + step.shape[1], device=device)[None]
                mask = torch.ones((1, seen + step.shape[1]), dtype=torch.long, device=device)
                model(input_ids=step, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    except Exception as exc:  # what the model raises is the reason it cannot be served
        return f"its forward does not run on the batched sampler's cache ({type(exc).__name__}: {exc})"
    return None


def has_states(config) -> bool:
    """Whether a model with `config` keeps linear-attention or recurrent states (a sequence summarised in a
    fixed-size state, which cannot be cut back to a prefix of it)."""
    return any(_has_states(layer) for layer in new_cache(config).layers)


def _known(layer) -> bool:
    if isinstance(layer, DynamicSlidingWindowLayer):
        return False  # (a linear-attention + sliding layer: its trimmed history cannot be batched)
    return type(layer).__name__ == "DummyLayer" or _has_kv(layer) or _has_states(layer)


def _has_kv(layer) -> bool:
    return isinstance(layer, DynamicLayer) and not isinstance(layer, DynamicSlidingWindowLayer)


def _has_states(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _states(layer) -> list[tuple[dict, int]]:
    """(dict, key) of every initialised per-row state tensor of a linear-attention layer."""
    found = []
    for index in range(layer.number_of_states):
        if layer.is_conv_states_initialized[index]:
            found.append((layer.conv_states, index))
        if layer.is_recurrent_states_initialized[index]:
            found.append((layer.recurrent_states, index))
    return found


def _kv_ready(layer) -> bool:
    return _has_kv(layer) and layer.keys is not None and layer.keys.dim() == 4


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep rows `index` (in that order, repeats allowed) of every layer, in place."""
    for layer in cache.layers:
        if _kv_ready(layer):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        if _has_states(layer):
            for states, key in _states(layer):
                states[key] = states[key][index]


def cut_left(cache: DynamicCache, columns: int) -> None:
    """Drop the first `columns` positions of every attention layer (padding for every row)."""
    if not columns:
        return
    for layer in cache.layers:
        if _kv_ready(layer):
            layer.keys, layer.values = layer.keys[:, :, columns:], layer.values[:, :, columns:]


def join(mine: DynamicCache, theirs: DynamicCache, width: int | None = None) -> None:
    """Append `theirs`' rows to `mine`, in place; attention layers are left-padded to `width` positions first
    (None: both are as long already)."""
    for own, other in zip(mine.layers, theirs.layers):
        if _kv_ready(own) or _kv_ready(other):
            own.keys = torch.cat([_pad_left(own.keys, width), _pad_left(other.keys, width)])
            own.values = torch.cat([_pad_left(own.values, width), _pad_left(other.values, width)])
        if _has_states(own):
            for (states, key), (other_states, _) in zip(_states(own), _states(other)):
                states[key] = torch.cat([states[key], other_states[key]])


def slice_rows(cache: DynamicCache, begin: int, end: int, config) -> DynamicCache:
    """A new cache holding rows begin:end of `cache` (sharing its tensors): one run of a split forward."""
    part = new_cache(config)
    for own, other in zip(part.layers, cache.layers):
        if _kv_ready(other):
            own.lazy_initialization(other.keys, other.values)
            own.keys, own.values = other.keys[begin:end], other.values[begin:end]
        if _has_states(other):
            _copy_state_flags(own, other)
            for (states, key), (other_states, _) in zip(_states(own), _states(other)):
                states[key] = other_states[key][begin:end]
    return part


RowKV = list[
    tuple[torch.Tensor, torch.Tensor] | None
]  # per cache layer, one row's (keys, values): (heads, length, dim)


def row_kv(cache: DynamicCache, row: int, first: int) -> RowKV:
    """A copy of row `row`'s keys and values from column `first` on, per layer (None: a layer without them).
    Only for models without states (`has_states`)."""
    return [
        (layer.keys[row, :, first:].clone(), layer.values[row, :, first:].clone()) if _kv_ready(layer) else None
        for layer in cache.layers
    ]


def from_rows(config, rows: list[RowKV | None], width: int) -> DynamicCache:
    """A cache of `rows` (None: no keys yet, all padding), each left-padded with zeros to `width` positions."""
    cache = new_cache(config)
    for index, layer in enumerate(cache.layers):
        sample = next((row[index] for row in rows if row is not None and row[index] is not None), None)
        if sample is None:
            continue
        keys, values = sample
        layer.lazy_initialization(keys, values)
        layer.keys = keys.new_zeros((len(rows), keys.shape[0], width, keys.shape[2]))
        layer.values = values.new_zeros((len(rows), values.shape[0], width, values.shape[2]))
        for at, row in enumerate(rows):
            if row is not None and row[index] is not None:
                length = row[index][0].shape[1]
                layer.keys[at, :, width - length :] = row[index][0]
                layer.values[at, :, width - length :] = row[index][1]
    return cache


def shift_right(cache: DynamicCache, shifts: torch.Tensor) -> None:
    """Move row i of every attention layer `shifts[i]` columns to the right, in place; the columns that come
    in on the left are zeros (padding): what makes a row padded on the right a left-padded one."""
    for layer in cache.layers:
        if _kv_ready(layer):
            columns = torch.arange(layer.keys.shape[2], device=shifts.device)
            source = (columns[None, :] - shifts[:, None]).clamp(min=0)[:, None, :, None]
            padding = (columns[None, :] < shifts[:, None])[:, None, :, None]
            for name in ("keys", "values"):
                states = getattr(layer, name)
                moved = states.gather(2, source.expand(-1, states.shape[1], -1, states.shape[3]))
                setattr(layer, name, moved.masked_fill(padding, 0.0))


def concat_rows(parts: list[DynamicCache]) -> DynamicCache:
    """One cache from caches over consecutive runs of rows (each as long as the others)."""
    whole = parts[0]
    for part in parts[1:]:
        join(whole, part)
    return whole


def _copy_state_flags(own, other) -> None:
    for attribute in (
        "is_conv_states_initialized",
        "is_recurrent_states_initialized",
        "has_previous_state",
        "conv_kernel_size",
    ):
        setattr(own, attribute, dict(getattr(other, attribute)))
    own.device, own.dtype = other.device, other.dtype
    own.conv_states, own.recurrent_states = dict(other.conv_states), dict(other.recurrent_states)


def _pad_left(states: torch.Tensor, width: int | None) -> torch.Tensor:
    """(batch, heads, length, dim) padded with zeros on the left of the length axis to `width` (None: as it is)."""
    if width is None or width == states.shape[-2]:
        return states
    return F.pad(states, (0, 0, width - states.shape[-2], 0))
