"""The adapters of a static-shape decode step as stacked static weights, indexed per row.

A captured CUDA graph replays the same kernels on the same tensors, so the adapters of a step cannot
be chosen by Python (`mixed_lora` groups rows by adapter on the host and picks stacks per set of
adapters). Here each LoRA linear layer holds, once, the A and B matrices of up to `slots` adapters
side by side, in buffers of fixed shape:

- `a`: (in, slots x rank), adapter k's A transposed in columns k x rank ... (k + 1) x rank;
- `b`: (slots x rank, out), adapter k's B transposed, times its scaling, in the same rows;

padded with zeros to the table's rank (an adapter of a smaller rank, or a layer an adapter does not
target, contributes exact zeros). A step computes every row's delta as `((x @ a) * mask) @ b`, where
`mask` (rows, slots x rank) is 1 on the columns of the row's own adapter and 0 elsewhere (all 0 for
the base model): one pair of products per layer, whatever the mix of adapters, computed from the
step's `adapter_slots` device tensor inside the graph. The extra work is small: for 8 slots of rank
32, x @ a is a (rows, in) x (in, 256) product beside the base layer's (rows, in) x (in, out).

A new snapshot is copied into a free slot (or the least recently used slot no running row uses) in
place, so a graph captured earlier reads it without being captured again. Plain LoRA linears are
stacked here (`mixed_lora.plain_linear_adapters`), and an adapter's weights on MoE expert tensors in
the same slot by `expert_table`; a request on any other adapter (DoRA, a LoRA embedding) takes the
dynamic path.

With a `fixed_rank` (the deterministic mode, `slot_batch`) a row's delta depends on its adapter alone: the buffers
(the expert tensors' too) keep that rank (an adapter of a larger one is not held), and the second product is one per
slot, `torch.bmm` over the slots' (rows, rank) x (rank, out), summed over the slots (the other slots add exact zeros).
A single product over every slot's columns would add a row's own columns at an offset set by its slot, and on a GPU
its reduction over them may group them by that offset.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

import torch
from peft.tuners.lora import Linear as LoraLinear

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.hf.expert_table import ExpertTable, stackable_wrapper
from treadle.gpu_worker.sampling.hf.mixed_lora import forwards_replaced, plain_linear_adapters

SLOTS = 8  # adapters one table holds; a step's rows use at most this many
MIN_RANK = 8


def static_address(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a buffer that steps read or write in place: a captured graph then uses it where it is, instead of
    copying it into a placeholder of its own at every replay."""
    torch._dynamo.mark_static_address(tensor)
    return tensor


class LoraTable:
    """Per LoRA linear layer of the bank's model, the stacked A and B of the adapters in the table's slots; their
    expert weights in `experts`, slot for slot."""

    def __init__(self, bank: AdapterBank, slots: int = SLOTS, fixed_rank: int | None = None):
        self.bank = bank
        self.slots = slots
        self.fixed_rank = fixed_rank
        self.rank = 0
        self.names: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.mask: torch.Tensor | None = None  # (rows, slots x rank) of the step being traced or run
        self._a: dict[LoraLinear, torch.Tensor] = {}
        self._b: dict[LoraLinear, torch.Tensor] = {}
        self._forwards: dict[LoraLinear, object] = {}
        self._version = bank.version
        self.experts = ExpertTable(bank, slots, fixed_rank or MIN_RANK)

    def can_hold(self, adapter: str | None) -> bool:
        """Whether rows of `adapter` can run here (None, the base model, always can)."""
        if adapter is None:
            return True
        fits = self.fixed_rank is None or self.bank.config(adapter).r <= self.fixed_rank
        return fits and plain_linear_adapters(self.bank, {adapter}, besides=stackable_wrapper)

    def slot(self, adapter: str | None, busy: set[str]) -> int:
        """The slot of `adapter` (-1: the base model), copying it in if it is not there; `busy` are the adapters of
        running rows, whose slots are not taken. Raises LookupError when every slot is busy."""
        if adapter is None:
            return -1
        self._forget_removed()
        if adapter in self.names:
            self.names.move_to_end(adapter)
            return self.names[adapter]
        rank = self.fixed_rank or max(self.bank.config(adapter).r, MIN_RANK)
        if rank > self.rank:
            self._grow(1 << (rank - 1).bit_length())
        free = sorted(set(range(self.slots)) - set(self.names.values()))
        if not free:
            idle = next((name for name in self.names if name not in busy), None)
            if idle is None:
                raise LookupError(f"every one of the {self.slots} adapter slots is in use")
            free = [self.names.pop(idle)]
        self._write(free[0], adapter)
        self.names[adapter] = free[0]
        return free[0]

    def select(self, adapter_slots: torch.Tensor) -> None:
        """Set the step's per-row mask from its (rows,) adapter slots (-1: none); traced into the step's graph."""
        columns = torch.arange(self.slots * self.rank, device=adapter_slots.device) // max(self.rank, 1)
        self.mask = (columns == adapter_slots[:, None]).to(next(iter(self._a.values())).dtype) if self._a else None
        self.experts.select(adapter_slots)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block every LoRA linear of the table computes its base layer plus the rows' deltas, so do the
        experts modules of stacked expert tensors (`ExpertTable.forwards`), and every other LoRA layer its base layer
        alone (`AdapterBank.adapters_off`). The forwards are made once per table
        shape: a compiled step guards on them, so new function objects at every step would trace it again."""
        layers = [layer for layer in _layers(self.bank) if isinstance(layer, LoraLinear)]
        for layer in layers:
            if layer not in self._forwards:
                self._forwards[layer] = self._forward(layer)
        forwards = {layer: self._forwards[layer] for layer in layers} | self.experts.forwards()
        with forwards_replaced(self.bank, forwards):
            yield

    # ------------------------------------------------------------ internals

    def _forward(self, layer):
        base_layer = layer.base_layer
        a, b = self._a.get(layer), self._b.get(layer)
        if a is None:
            return base_layer.forward

        slots, rank = self.slots, self.rank

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            output = base_layer(x, *args, **kwargs)
            assert self.mask is not None
            # x is (rows, tokens, in): one token per row, or every cached position of a row (DeepSeek's latent
            # attention expands its whole cache through kv_b_proj), each token masked by its row's adapter.
            flat = x.reshape(x.shape[0], -1, x.shape[-1]).to(a.dtype)
            masked = torch.matmul(flat, a) * self.mask[:, None]
            if self.fixed_rank is None:
                delta = torch.matmul(masked, b)
            else:  # one product per slot (the module docstring)
                per_slot = masked.view(-1, slots, rank).transpose(0, 1)
                delta = torch.bmm(per_slot, b.view(slots, rank, -1)).sum(0)
            return output + delta.to(output.dtype).view(output.shape)

        return forward

    def _grow(self, rank: int) -> None:
        """New buffers of `rank` per slot, the adapters already held copied in again."""
        held = list(self.names.items())
        self.rank, self._a, self._b, self._forwards = rank, {}, {}, {}
        for layer in _layers(self.bank):
            if isinstance(layer, LoraLinear):
                dtype = next(iter(layer.lora_A.values())).weight.dtype if layer.lora_A else layer.weight.dtype
                device = layer.base_layer.weight.device
                fan_in, fan_out = layer.in_features, layer.out_features
                self._a[layer] = static_address(torch.zeros(fan_in, self.slots * rank, dtype=dtype, device=device))
                self._b[layer] = static_address(torch.zeros(self.slots * rank, fan_out, dtype=dtype, device=device))
        for name, slot in held:
            self._write(slot, name)

    def _write(self, slot: int, adapter: str) -> None:
        self.experts.write(slot, adapter)
        columns = slice(slot * self.rank, (slot + 1) * self.rank)
        for layer, a in self._a.items():
            b = self._b[layer]
            a[:, columns].zero_()
            b[columns].zero_()
            if adapter in layer.lora_A:
                rank = layer.r[adapter]
                a[:, slot * self.rank : slot * self.rank + rank] = layer.lora_A[adapter].weight.detach().t()
                b[slot * self.rank : slot * self.rank + rank] = (
                    layer.lora_B[adapter].weight.detach().t() * layer.scaling[adapter]
                )

    def _forget_removed(self) -> None:
        """After the bank's adapters changed: free the slots of adapters it no longer has (a retired snapshot's
        name may come back new), and make buffers for LoRA layers that a new adapter added."""
        if self.bank.version == self._version:
            return
        self._version = self.bank.version
        present = set(self.bank.peft_model.peft_config) if self.bank.peft_model is not None else set()
        for name in [n for n in self.names if n not in present]:
            del self.names[name]
        if self.rank and {layer for layer in _layers(self.bank) if isinstance(layer, LoraLinear)} != set(self._a):
            self._grow(self.rank)


def _layers(bank: AdapterBank) -> list:
    return bank.lora_layers() if bank.peft_model is not None else []
