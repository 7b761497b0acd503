"""A KV cache of fixed shape for the static-shape decode path: one slot of `capacity` positions per row.

Why fixed: a decode step that a GPU replays as a captured CUDA graph must see the same tensors, of the
same shapes, at every step. The dynamic path (`batch_decode`) left-pads rows to one width, concatenates
newcomers and cuts columns; here every attention layer holds K and V of shape (rows, kv_heads,
capacity, head_dim), allocated once per bucket, and a row is a slot:

- its positions are the slot's first columns, from 0 (no left padding: a row's key `j` sits in column
  `j`, whatever the other rows hold);
- a decode step writes each row's new key and value at its own length (`slot_lengths`, a device
  tensor: one scatter per layer, no host arithmetic), and the attention masks every column past it;
- a row joins by copying its prefilled K and V into its slot's first columns, and leaves by being
  marked free (a free slot keeps computing garbage that nothing reads; zeroing is not needed because
  a masked weight is an exact 0 times a finite value).

The attention (`slot_attention`, registered with HF's attention interface as `treadle_slots`) scores every column, masks those past the row's length (and before its sliding window), and reads the
values. On a CPU it keeps the sampler's batch invariance (`row_invariant`): every row's products have the
same shapes whatever the other rows are, and columns past a row's end add exact zeros at the end of its
sums, so a row's numbers depend on neither the bucket's row count nor its capacity: w @ v is taken in
blocks of `KEY_MULTIPLE` keys from column 0, added in order in fp32 (one product over the whole
capacity would order its reduction by the capacity). On an accelerator w @ v is one product.

Linear-attention and Mamba layers have slots of their own (`state_slots`, which this cache presents to
them), so hybrid families take this path as well (`static_path` says which families take it).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface, DynamicCache

from treadle.gpu_worker.sampling.hf import cache_rows, expert_table, position_rules
from treadle.gpu_worker.sampling.hf import row_invariant
from treadle.gpu_worker.sampling.hf.row_invariant import KEY_MULTIPLE
from treadle.gpu_worker.sampling.hf.state_slots import StateSlots

IMPLEMENTATION = "treadle_slots"


def static_path(model: torch.nn.Module, expert_targets: list[str]) -> str:
    """ "yes" if the model's decode steps take the static-shape path, else "no: " and why not; shown by `treadle
    models check` and docs/models.md. A MoE model's expert adapters are stacked per row and expert (`expert_table`);
    an experts module of a kind the table does not know is named, its adapters' rows decode dynamically."""
    failure = _decode_failure(model)
    if failure is not None:
        return f"no: its decode step does not run on slots ({failure})"
    if unknown := expert_table.unstackable(model, expert_targets):
        return f"yes, but rows of adapters on the expert weights of {', '.join(unknown)} decode dynamically"
    return "yes"


def _decode_failure(model: torch.nn.Module) -> str | None:
    """None if the model's decode step runs on slots as `SlotBatch` runs it (a prefill of two tokens on the dynamic
    path's cache, placed in a slot, then one step), else what it raised. A model whose layers call on their cache
    what the slots do not present (`state_slots` presents what HF's linear-attention and Mamba mixers call) takes
    the dynamic path, named here, rather than failing at its first sample."""
    device = model.device
    tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
    cache, slots = cache_rows.new_cache(model.config), SlotCache(1, KEY_MULTIPLE)
    lengths = torch.full((1,), 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            model(input_ids=tokens, position_ids=torch.arange(2, device=device)[None], cache=cache, use_cache=True)
            slots.fill_rows(cache, torch.zeros(1, dtype=torch.long, device=device), [2], 2)
            with attending(model):
                model(
                    input_ids=tokens[:, :1],
                    position_ids=lengths[:, None],
                    cache=slots,
                    use_cache=True,
                    slot_lengths=lengths,
                    logits_to_keep=1,
                )
    except Exception as exc:  # what the model raises is the reason it takes the dynamic path
        return f"{type(exc).__name__}: {exc}"
    return None


@contextmanager
def attending(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention layers call the slots' attention within the block."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        with position_rules.own_positions(model):
            yield
    finally:
        config._attn_implementation = previous


class SlotCache(StateSlots):
    """Per attention layer, K and V of shape (rows, kv_heads, capacity, dim), made on the first `fill`; per
    recurrent layer, its states (`StateSlots`).

    HF's attention modules call `update` with each step's new key and value; it writes them at each row's
    `slot_lengths` (passed to the model call, which hands its keyword arguments to the cache) and returns the
    whole buffers."""

    def __init__(self, rows: int, capacity: int):
        super().__init__(rows)
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def fill(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy rows of a prefill's K and V, (n, kv_heads, length, dim), into the first `length` columns of
        `slots` (n,)."""
        if layer not in self.keys:
            self._allocate(layer, keys, values.shape[1], values.shape[3])
        length = keys.shape[2]
        self.keys[layer][slots, :, :length] = keys
        self.values[layer][slots, :, :length] = values

    def fill_rows(self, cache: DynamicCache, slots: torch.Tensor, lengths: list[int], width: int) -> None:
        """Copy the rows of a prefill's cache (left-padded to `width` positions, row i's prompt `lengths[i]` long)
        into `slots`: their K and V into the slots' first columns, their states (`StateSlots`) whole."""
        for layer, kv in enumerate(cache.layers):
            if cache_rows._has_states(kv):
                self.fill_states(layer, slots, kv.conv_states, kv.recurrent_states)
            if not cache_rows._kv_ready(kv):
                continue
            for length in set(lengths):
                index = torch.tensor([i for i, n in enumerate(lengths) if n == length], device=slots.device)
                self.fill(
                    layer, slots[index], kv.keys[index, :, width - length :], kv.values[index, :, width - length :]
                )

    def move(self, other: SlotCache) -> None:
        """Copy every slot of `other` (a smaller bucket) into the same slots here."""
        self.move_states(other)
        for layer, keys in other.keys.items():
            rows, _, capacity, _ = keys.shape
            if layer not in self.keys:
                shape = other.values[layer].shape
                self._allocate(layer, keys, shape[1], shape[3])
            self.keys[layer][:rows, :, :capacity] = keys
            self.values[layer][:rows, :, :capacity] = other.values[layer]

    def _allocate(self, layer: int, like: torch.Tensor, value_heads: int, value_dim: int) -> None:
        """Zeroed K and V of one layer, marked as static addresses: a captured step writes and reads them in place
        (an input a graph mutates that is not static makes CUDA graph trees skip the graph)."""
        keys = like.new_zeros((self.rows, like.shape[1], self.capacity, like.shape[3]))
        values = like.new_zeros((self.rows, value_heads, self.capacity, value_dim))
        torch._dynamo.mark_static_address(keys)
        torch._dynamo.mark_static_address(values)
        self.keys[layer], self.values[layer] = keys, values

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict | None = None, **_):
        """Write one step's (rows, kv_heads, 1, dim) key and value at each row's length; returns the buffers."""
        lengths = (kwargs or {})["slot_lengths"]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.scatter_(2, lengths.view(-1, 1, 1, 1).expand(-1, keys.shape[1], 1, keys.shape[3]), key.to(keys.dtype))
        values.scatter_(
            2, lengths.view(-1, 1, 1, 1).expand(-1, values.shape[1], 1, values.shape[3]), value.to(values.dtype)
        )
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity


def slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    s_aux: torch.Tensor | None,
    softcap: float | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One query per row over its slot: query (R, H, 1, D), key (R, Hkv, C, D), value (R, Hkv, C, Dv), the query
    at position `lengths[r]` (its key already written there) -> (R, 1, H, Dv). Sliding windows, chunks, sinks and
    soft-capping as `row_invariant._rows_attention` applies them."""
    rows, heads, _, dim = query.shape
    kv_heads, capacity = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # k @ q^T: the query heads sharing a KV head are one product's columns (as `row_invariant._decode_attention`).
    scores = torch.matmul(key, query.reshape(rows, kv_heads, groups, dim).transpose(2, 3)).transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    columns = torch.arange(capacity, device=query.device)
    visible = columns <= lengths[:, None]
    if sliding_window is not None:  # a query at position p sees keys p - window < k <= p
        visible = visible & (columns > lengths[:, None] - sliding_window)
    if chunk is not None:  # and keys of its own chunk only
        visible = visible & (columns >= (lengths - lengths % chunk)[:, None])
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if s_aux is not None:  # the sink: in the softmax, not in the output
        sink = s_aux.reshape(1, kv_heads, groups, 1).expand(rows, -1, -1, 1).to(scores.dtype)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights = weights.to(query.dtype)
    if not row_invariant.invariant_layouts(query.device):
        return torch.matmul(weights, value).reshape(rows, 1, heads, value.shape[-1])
    out = query.new_zeros((rows, kv_heads, groups, value.shape[-1]), dtype=torch.float32)
    for begin in range(0, capacity, KEY_MULTIPLE):  # capacity is a multiple of KEY_MULTIPLE (`slot_batch`)
        out += torch.matmul(weights[..., begin : begin + KEY_MULTIPLE], value[:, :, begin : begin + KEY_MULTIPLE])
    return out.to(query.dtype).reshape(rows, 1, heads, value.shape[-1])


def _slots_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    slot_lengths: torch.Tensor | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """HF attention interface for a static-shape decode step (the model call passes `slot_lengths`)."""
    if slot_lengths is None or query.shape[2] != 1:
        raise RuntimeError(f"{IMPLEMENTATION} attention runs decode steps given slot_lengths only")
    if position_rules.tuned(module):
        query = position_rules.scale_queries(module, query, slot_lengths[:, None])
    chunk = position_rules.chunk_size(module)
    return slot_attention(query, key, value, slot_lengths, scaling, sliding_window, s_aux, softcap, chunk), None


AttentionInterface.register(IMPLEMENTATION, _slots_attention)
