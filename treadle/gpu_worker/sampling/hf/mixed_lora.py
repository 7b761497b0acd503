"""Sampling forwards whose rows use LoRA adapters, one or many: every adapter's delta in one grouped product.

Each LoRA layer runs its base layer on the whole batch and adds the deltas (its forward is replaced
for the call). Per layer, the A and B matrices of the batch's adapters are stacked, (n, r, in) and
(n, out, r); each adapter's rows are gathered into one slot of an (n, m, in) block (a view, no copy,
when the rows already tile it); and two `torch.bmm` compute every adapter's `B(A(x)) * scaling` at
once. So a layer costs the same two products whether the batch holds one adapter or eight: 4 sessions
of 8 rows cost about what one session of 32 rows costs. The stacks are built once per set of adapters
(`AdapterStacks`) and kept until the bank's adapters change (snapshots are frozen, so their tensors
never do). Adapters of different ranks go into different stacks (one pair of products per rank).

Why not the alternatives: adding each adapter's delta over its own runs of rows costs two products per run per
layer, and PEFT's mixed batches (`adapter_names=[...]`) gather and scatter rows with Python lists, 38 % of a mixed
step (docs/benchmarks.md, "Tried and not kept").

Bit for bit: every slot is one product of m rows, m a multiple of `ROW_MULTIPLE` and large enough that
torch takes MKL's path (its own loop, another summation order, below 400 multiply-adds), and MKL
computes such a product's rows independently of m and of the other slots. A row's delta is thus the
same whichever adapters share its batch, and single-adapter sampling goes through here too (one
slot), so a request alone and the same request batched compute the same numbers. (Measured: equal to
PEFT's own forward through `F.linear` as well, which `tests/test_batch_sampling.py` checks through
the split forwards of `batch_decode`.) Sampling is inference: LoRA dropout is not applied.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.hf import row_invariant

SMALL_BMM = 400  # torch's CPU bmm computes products of fewer multiply-adds with its own loop, not MKL
KEPT_SETS = 4  # sets of adapters whose stacks are kept (each multi-adapter set holds a copy of its weights)


def plain_linear_adapters(
    bank: AdapterBank, adapters: set[str | None], besides: Callable[[LoraLayer], bool] = lambda _: False
) -> bool:
    """Whether every adapter named lives only in plain LoRA linears (no DoRA or other variant, no LoRA
    embedding, no bias on B), or in LoRA layers `besides` accepts: what `grouped_adapters` computes. A PEFT
    adapter loaded from a user's directory may not be, nor is a full session's snapshot (its rows run as a
    model of their own)."""
    if any(name in bank.full for name in adapters):
        return False
    for layer in bank.lora_layers():
        if besides(layer):
            continue
        if not isinstance(layer, LoraLinear):
            if any(name in layer.lora_embedding_A or name in layer.lora_A for name in adapters):
                return False
        elif any(
            name in layer.lora_variant or (name in layer.lora_B and layer.lora_B[name].bias is not None)
            for name in adapters
        ):
            return False
    return True


@dataclass
class Stack:
    """The A and B matrices of some adapters of one rank on one layer, stacked: one slot per adapter."""

    names: tuple[str, ...]
    a_t: torch.Tensor  # A transposed, (n, in, r): a view, as the products take it
    b_t: torch.Tensor  # B transposed, (n, r, out)
    scale: torch.Tensor  # (n, 1, 1)
    min_rows: int  # fewest rows per slot for which both products take MKL's path

    @classmethod
    def of(cls, layer: LoraLinear, names: tuple[str, ...]) -> Stack:
        a = [layer.lora_A[name].weight.detach() for name in names]
        b = [layer.lora_B[name].weight.detach() for name in names]
        # One adapter: a view of its own weights, laid out as a stacked copy would be.
        a, b = (a[0].unsqueeze(0), b[0].unsqueeze(0)) if len(names) == 1 else (torch.stack(a), torch.stack(b))
        scale = torch.tensor([layer.scaling[name] for name in names], dtype=a.dtype, device=a.device)
        rank, fan_in, fan_out = a.shape[1], a.shape[2], b.shape[1]
        min_rows = -(-SMALL_BMM // (rank * min(fan_in, fan_out)))
        return cls(names, a.transpose(1, 2), b.transpose(1, 2), scale.reshape(-1, 1, 1), min_rows)


class AdapterStacks:
    """Per set of adapters, each LoRA layer's stacks; rebuilt only when the bank's adapters change."""

    def __init__(self) -> None:
        self._version = -1
        self._sets: OrderedDict[tuple[str, ...], dict[LoraLinear, list[Stack]] | None] = OrderedDict()

    def layers(self, bank: AdapterBank, names: tuple[str, ...]) -> dict[LoraLinear, list[Stack]] | None:
        """The stacks of every LoRA layer any of `names` (sorted) targets; None if one of them is not a
        plain linear adapter (`plain_linear_adapters`)."""
        if bank.version != self._version:
            self._sets.clear()
            self._version = bank.version
        if names in self._sets:
            self._sets.move_to_end(names)
            return self._sets[names]
        found = None
        if plain_linear_adapters(bank, set(names)):
            found = {}
            for layer in bank.lora_layers():
                targeted = [name for name in names if isinstance(layer, LoraLinear) and name in layer.lora_A]
                by_rank: dict[int, list[str]] = {}
                for name in targeted:
                    by_rank.setdefault(layer.r[name], []).append(name)
                if by_rank:
                    found[layer] = [Stack.of(layer, tuple(group)) for group in by_rank.values()]
        self._sets[names] = found
        while len(self._sets) > KEPT_SETS:
            self._sets.popitem(last=False)
        return found


_STACKS: weakref.WeakKeyDictionary[AdapterBank, AdapterStacks] = weakref.WeakKeyDictionary()


def stacks_for(bank: AdapterBank, names: tuple[str, ...]) -> dict[LoraLinear, list[Stack]] | None:
    """`AdapterStacks.layers` of the bank's own cache."""
    return _STACKS.setdefault(bank, AdapterStacks()).layers(bank, names)


@dataclass
class _Slots:
    """Where a stack's rows go: token rows `source` of the flattened input fill rows `slot` of the
    (n * rows) block; `prefix` when both are 0..N-1 (the input is the block's first rows: padded with
    zero rows, or, `tiled`, already the whole block)."""

    rows: int
    source: torch.Tensor
    slot: torch.Tensor
    prefix: bool
    tiled: bool


def _slots(adapters: list[str | None], names: tuple[str, ...], per_row: int, min_rows: int, device) -> _Slots:
    """Slot k holds the tokens of adapter names[k]'s rows (each row `per_row` tokens), in order. On a CPU a slot
    has at least `min_rows` rows, a multiple of `ROW_MULTIPLE` (the module docstring); an accelerator's kernels
    have no such layouts to keep to (`invariant_layouts`)."""
    rows_of = [[row for row, name in enumerate(adapters) if name == wanted] for wanted in names]
    rows = max(len(r) for r in rows_of) * per_row
    if row_invariant.invariant_layouts(torch.device(device)):
        rows = -(-max(rows, min_rows) // row_invariant.ROW_MULTIPLE) * row_invariant.ROW_MULTIPLE
    tokens = torch.arange(per_row)
    source = torch.cat([(torch.tensor(r, dtype=torch.long)[:, None] * per_row + tokens).flatten() for r in rows_of])
    slot = torch.cat([k * rows + torch.arange(len(r) * per_row) for k, r in enumerate(rows_of)])
    everything = torch.arange(len(adapters) * per_row)
    prefix = torch.equal(source, everything) and torch.equal(slot, everything)
    return _Slots(rows, source.to(device), slot.to(device), prefix, prefix and len(slot) == len(names) * rows)


def _delta(block: torch.Tensor, stack: Stack, dtype: torch.dtype) -> torch.Tensor:
    """Every slot's LoRA delta, `B(A(x)) * scaling` of its own adapter: (n, rows, in) -> (n * rows, out)."""
    block = block if block.dtype == stack.a_t.dtype else block.to(stack.a_t.dtype)
    delta = torch.bmm(torch.bmm(block, stack.a_t), stack.b_t) * stack.scale
    delta = delta if delta.dtype == dtype else delta.to(dtype)
    return delta.view(-1, delta.shape[-1])


def _prefix_block(flat: torch.Tensor, slots: _Slots, n: int) -> torch.Tensor:
    """The (n * rows, in) block whose first rows are `flat` (`slots.prefix`): `flat` itself when it tiles the
    block, else `flat` padded with zero rows."""
    return flat if slots.tiled else F.pad(flat, (0, 0, 0, n * slots.rows - flat.shape[0]))


def _per_row(x: torch.Tensor) -> int:
    """Tokens per row of a linear's input (rows, ..., in): DeepSeek's latent attention passes (rows, 1, tokens, in)."""
    return math.prod(x.shape[1:-1])


def _add_deltas(x: torch.Tensor, output: torch.Tensor, stacks: list[Stack], slots_of) -> None:
    """output += every stack's LoRA deltas of x, each row by its own adapter; in place."""
    flat_out = output.view(-1, output.shape[-1])
    for stack in stacks:
        slots = slots_of(stack.names, _per_row(x), stack.min_rows)
        flat = x.reshape(-1, x.shape[-1])
        n = len(stack.names)
        if slots.prefix:  # adapters' runs of equal length
            block = _prefix_block(flat, slots, n)
            flat_out += _delta(block.view(n, slots.rows, flat.shape[-1]), stack, output.dtype)[: flat_out.shape[0]]
        else:
            block = flat.new_zeros(n * slots.rows, flat.shape[-1]).index_copy_(
                0, slots.slot, flat.index_select(0, slots.source)
            )
            delta = _delta(block.view(n, slots.rows, flat.shape[-1]), stack, output.dtype)
            flat_out.index_add_(0, slots.source, delta.index_select(0, slots.slot))


def _lora_forward(layer: LoraLinear, stacks: list[Stack], slots_of):
    """The layer's forward for the block: its base layer, plus the deltas. With one stack whose rows are the
    block's first ones (one adapter on every row: the usual case), the input is padded once, to the block, and
    the base layer and both products run on it: `_padded_linear` would pad it to the same multiple of
    `ROW_MULTIPLE` again, and each of a row's products is the same on any such number of rows."""
    base_layer = layer.base_layer

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(stacks) == 1 and not args and not kwargs:
            stack = stacks[0]
            slots = slots_of(stack.names, _per_row(x), stack.min_rows)
            if slots.prefix:
                flat, n = x.reshape(-1, x.shape[-1]), len(stack.names)
                block = _prefix_block(flat, slots, n)
                output = base_layer(block)
                output += _delta(block.view(n, slots.rows, flat.shape[-1]), stack, output.dtype)
                return output[: flat.shape[0]].view(*x.shape[:-1], output.shape[-1])
        output = base_layer(x, *args, **kwargs)
        _add_deltas(x, output, stacks, slots_of)
        return output

    return forward


@contextmanager
def grouped_adapters(
    bank: AdapterBank, adapters: list[str | None], layers: dict[LoraLinear, list[Stack]]
) -> Iterator[torch.nn.Module]:
    """The model to call for a batch whose row i runs with adapter `adapters[i]` (None: base), given the
    stacks of its adapters (`stacks_for`). Callers hold the device lock (each LoRA layer's forward is
    replaced on the shared model while the block runs) and disable grad."""
    device = bank.host.device
    planned: dict[tuple, _Slots] = {}  # the same slots serve every layer with the same adapters and shape

    def slots_of(names: tuple[str, ...], per_row: int, min_rows: int) -> _Slots:
        key = (names, per_row, min_rows)
        if key not in planned:
            planned[key] = _slots(adapters, names, per_row, min_rows, device)
        return planned[key]

    with forwards_replaced(bank, {layer: _lora_forward(layer, stacks, slots_of) for layer, stacks in layers.items()}):
        yield bank.host.model


@contextmanager
def forwards_replaced(bank: AdapterBank, forwards: dict) -> Iterator[None]:
    """Within the block each layer of `forwards` runs the function given for it, and every other LoRA layer its base
    layer alone (`AdapterBank.adapters_off`). An instance attribute shadows the class's forward for
    nn.Module.__call__; a forward hook would also do, but it sends every call through the module's slow path and
    computes the base layer on its own."""
    replaced = [(layer, layer.__dict__.get("forward")) for layer in forwards]
    for layer, forward in forwards.items():
        layer.forward = forward
    try:
        with bank.adapters_off() if bank.peft_model is not None else nullcontext():
            yield
    finally:
        for layer, previous in replaced:
            if previous is None:
                del layer.forward
            else:
                layer.forward = previous
