"""Expert adapters of a static-shape decode step as stacked static weights, indexed per row and routed expert.

An adapter trained on a MoE block's 3-D expert tensors (PEFT's `target_parameters`, `ParamWrapper`) gives every
expert e its own rank-r update of the tensor: PEFT's `get_delta_factors` returns lhs (E, p, r) and rhs (E, r, q)
with the expert's weight changed by `scaling * lhs[e] @ rhs[e]` (A rows e*r ... (e + 1)*r, B columns e, E + e, ...
interleaved). PEFT folds that into the weight before the experts run, which is one forward per adapter. Here the
weight stays the base one and each routed (token, expert) pair adds its own adapter's delta to the projection's
output, in the forward's terms: `x @ left[a, e] @ right[a, e]`, where the experts compute `x @ W[e]` (gpt-oss,
Llama 4: left = lhs, right = rhs * scaling) or `x @ W[e]^T` (Qwen3-MoE, DeepSeek-V3: left = rhs^T, right =
lhs^T * scaling). Per expert tensor, once, in buffers of fixed shape:

- `left`: ((slots + 1) x E, in, rank), `right`: ((slots + 1) x E, rank, out), slot a's expert e at a x E + e,
  padded with zeros to the table's rank; the last slot stays zero: the base model's rows, and rows of an adapter
  without expert weights, add exact zeros.

A step gathers each pair's factors by `slot x E + expert` (the slot from the step's `adapter_slots`, the expert
from the router) and takes two batched products, of fixed shapes whatever the routing: no loop over experts, no
host read. The delta goes in where the base product is taken, before gpt-oss's clamped, interleaved gate: the
experts' forward is replaced for the step (`forwards`), like `lora_table` replaces LoRA linears' forwards. Two
kinds of experts module are known: those of transformers' `use_experts_implementation` (Qwen3-MoE, gpt-oss,
DeepSeek-V3), whose base products here are its `grouped_mm` implementation's (sorted by expert, grouped
products), and Llama 4's, which runs every expert on every token (router-scaled inputs, one `bmm`). Another
experts class is not stacked (`unstackable`): rows of adapters on its weights decode on the dynamic path.
"""

from __future__ import annotations

from typing import Any, Callable, TypeGuard

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from transformers.integrations.moe import _grouped_linear
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

from treadle.gpu_worker.model.adapters import AdapterBank

FIRST = ("gate_up_proj", "up_proj")  # the experts' first projection (gated or not)
LAST = "down_proj"


def stackable(module: nn.Module) -> bool:
    """Whether the table can add expert deltas to `module`'s forward (module: the experts, not a PEFT wrapper)."""
    return isinstance(module, Llama4TextExperts) or hasattr(module, "has_gate")


def stackable_wrapper(layer: object) -> TypeGuard[ParamWrapper]:
    """Whether a LoRA layer is an expert tensor's `ParamWrapper` the table stacks."""
    return (
        isinstance(layer, ParamWrapper) and layer.parameter_name in (*FIRST, LAST) and stackable(layer.get_base_layer())
    )


def unstackable(model: nn.Module, expert_targets: list[str]) -> list[str]:
    """The class names of `model`'s experts modules whose 3-D weights `expert_targets` name and the table cannot
    stack (their adapters' rows decode dynamically)."""
    names = []
    for name, module in model.named_modules():
        owned = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
        if any(path.endswith(t) for path in owned for t in expert_targets) and not stackable(module):
            names.append(type(module).__name__)
    return sorted(set(names))


class ExpertTable:
    """Per expert tensor an adapter can target, the stacked per-expert factors of the adapters in the table's slots
    (the slots of `lora_table.LoraTable`, which owns this table)."""

    def __init__(self, bank: AdapterBank, slots: int, min_rank: int):
        self.bank = bank
        self.slots = slots
        self.min_rank = min_rank
        self.rank = 0
        self.held: dict[int, str] = {}  # slot -> adapter with expert weights
        self.index: torch.Tensor | None = None  # (rows,) each row's slot, the base model's the last (zero) one
        self._left: dict[ParamWrapper, torch.Tensor] = {}
        self._right: dict[ParamWrapper, torch.Tensor] = {}
        self._forwards: dict[nn.Module, Callable] = {}

    def write(self, slot: int, adapter: str) -> None:
        """Copy `adapter`'s expert factors into `slot` (zeros where it has none), growing the buffers if needed."""
        self.held.pop(slot, None)
        wrappers = _wrappers(self.bank)
        ranks = [w.r[adapter] for w in wrappers if adapter in w.lora_A]
        if ranks:
            rank = 1 << (max(max(ranks), self.min_rank) - 1).bit_length()
            if rank > self.rank or set(wrappers) != set(self._left):
                self._allocate(wrappers, max(rank, self.rank))
            self.held[slot] = adapter
        self._copy(slot, adapter)

    def select(self, adapter_slots: torch.Tensor) -> None:
        """Set the step's per-row slots from its (rows,) adapter slots (-1: none); traced into the step's graph."""
        self.index = torch.where(adapter_slots < 0, self.slots, adapter_slots) if self._left else None

    def forwards(self) -> dict[nn.Module, Callable]:
        """The experts modules' forwards for the step: base products plus the rows' deltas. Made once per buffer
        shape: a compiled step guards on them."""
        if not self._forwards:
            by_module: dict[nn.Module, dict[str, ParamWrapper]] = {}
            for wrapper in self._left:
                by_module.setdefault(wrapper.get_base_layer(), {})[wrapper.parameter_name] = wrapper
            for module, wrappers in by_module.items():
                first = next((wrappers[name] for name in FIRST if name in wrappers), None)
                factors = [(self._left[w], self._right[w]) if w else None for w in (first, wrappers.get(LAST))]
                make = _llama4_forward if isinstance(module, Llama4TextExperts) else _grouped_forward
                self._forwards[module] = make(module, self, *factors)
        return self._forwards

    # ------------------------------------------------------------ internals

    def _allocate(self, wrappers: list[ParamWrapper], rank: int) -> None:
        """New zeroed buffers of `rank` per expert, the adapters already held copied in again."""
        self.rank, self._left, self._right, self._forwards = rank, {}, {}, {}
        for wrapper in wrappers:
            left, right = _factors_shape(wrapper)
            param = wrapper.get_param()
            rows = (self.slots + 1) * wrapper.num_experts
            self._left[wrapper] = _static(param.new_zeros(rows, left, rank))
            self._right[wrapper] = _static(param.new_zeros(rows, rank, right))
        for slot, adapter in self.held.items():
            self._copy(slot, adapter)

    def _copy(self, slot: int, adapter: str) -> None:
        for wrapper, left in self._left.items():
            right, experts = self._right[wrapper], wrapper.num_experts
            rows = slice(slot * experts, (slot + 1) * experts)
            left[rows].zero_()
            right[rows].zero_()
            if adapter in wrapper.lora_A:
                lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                if not _input_on_left(wrapper):  # x @ W[e]^T: the delta is x @ rhs^T @ lhs^T
                    lhs, rhs = rhs.transpose(1, 2), lhs.transpose(1, 2)
                rank = lhs.shape[2]
                left[rows, :, :rank] = lhs.detach()
                right[rows, :rank] = rhs.detach() * scaling


def _wrappers(bank: AdapterBank) -> list[ParamWrapper]:
    if bank.peft_model is None:
        return []
    return [layer for layer in bank.lora_layers() if stackable_wrapper(layer)]


def _input_on_left(wrapper: ParamWrapper) -> bool:
    """Whether the experts compute `x @ W[e]` with this tensor (else `x @ W[e]^T`)."""
    module = wrapper.get_base_layer()
    return isinstance(module, Llama4TextExperts) or bool(getattr(module, "is_transposed", False))


def _factors_shape(wrapper: ParamWrapper) -> tuple[int, int]:
    """(in, out) of the forward's product with the tensor of one expert."""
    _, first, second = wrapper.get_param().shape
    return (first, second) if _input_on_left(wrapper) else (second, first)


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a buffer a captured step reads in place (`lora_table.static_address`)."""
    torch._dynamo.mark_static_address(tensor)
    return tensor


Factors = tuple[torch.Tensor, torch.Tensor] | None  # an expert tensor's (left, right); None: not adapted


def _plus_delta(out: torch.Tensor, x: torch.Tensor, pairs: torch.Tensor, factors: Factors) -> torch.Tensor:
    """out (S, out) plus each pair's delta: x (S, in) times its left[pairs[s]] (in, r) and right[pairs[s]] (r, out)."""
    if factors is None:
        return out
    left, right = factors
    delta = torch.bmm(torch.bmm(x.unsqueeze(1).to(left.dtype), left[pairs]), right[pairs])
    return out + delta.squeeze(1).to(out.dtype)


def _grouped_forward(module: Any, table: ExpertTable, first: Factors, last: Factors) -> Callable:
    """The forward of a `use_experts_implementation` experts module: its `grouped_mm` implementation (tokens sorted
    by expert, one grouped product per projection) with each pair's delta added to both projections."""
    experts = module.num_experts
    has_gate, has_bias, transposed = module.has_gate, module.has_bias, module.is_transposed

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        assert table.index is not None
        top_k, tokens, width = top_k_index.shape[-1], hidden_states.shape[0], hidden_states.shape[-1]
        expert_ids, order = torch.sort(top_k_index.reshape(-1))
        token_of = order // top_k
        x = hidden_states[token_of]
        pairs = table.index[token_of] * experts + expert_ids
        # As transformers' grouped_mm implementation counts tokens per expert: histc, not bincount (CUDA graphs).
        counts = expert_ids.float() if x.device.type in ("cpu", "mps") else expert_ids.int()
        offsets = torch.cumsum(torch.histc(counts, bins=experts, min=0, max=experts - 1), dim=0, dtype=torch.int32)
        weight = module.gate_up_proj if has_gate else module.up_proj
        bias = (module.gate_up_proj_bias if has_gate else module.up_proj_bias)[expert_ids] if has_bias else None
        out = _plus_delta(_grouped_linear(x, weight, offsets, bias=bias, is_transposed=transposed), x, pairs, first)
        out = module._apply_gate(out) if has_gate else module.act_fn(out)
        bias = module.down_proj_bias[expert_ids] if has_bias else None
        down = _grouped_linear(out, module.down_proj, offsets, bias=bias, is_transposed=transposed)
        out = _plus_delta(down, out, pairs, last)
        if module.has_post_expert_norm:
            out = module.post_expert_norm(out)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(tokens, top_k, width).sum(dim=1).to(hidden_states.dtype)

    return forward


def _llama4_forward(module: Any, table: ExpertTable, first: Factors, last: Factors) -> Callable:
    """The forward of Llama 4's experts: every expert on every token's router-scaled input ((E x tokens, hidden),
    expert-major), plus each (token, expert) pair's delta."""
    experts = module.num_experts

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        assert table.index is not None
        width = hidden_states.shape[-1]
        x = hidden_states.view(experts, -1, width)
        tokens = x.shape[1]
        pairs = (table.index[None, :] * experts + torch.arange(experts, device=x.device)[:, None]).reshape(-1)
        gate_up = _plus_delta(torch.bmm(x, module.gate_up_proj).view(experts * tokens, -1), hidden_states, pairs, first)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = up * module.act_fn(gate)
        out = torch.bmm(hidden.view(experts, tokens, -1), module.down_proj).view(experts * tokens, -1)
        return _plus_delta(out, hidden, pairs, last)

    return forward
