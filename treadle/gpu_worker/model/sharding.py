"""The base model of a sharded device group (`treadle worker --devices N --shard`): FSDP2 over the group's ranks.

`fully_shard` runs once per model, at load, before any LoRA adapter exists: each decoder layer is one unit
and the root (embeddings, final norm, output projection) another. Every base weight then lives on its rank as
a 1/N dim-0 shard (a DTensor), and a unit's whole weights exist only while its forward (or its backward's
recomputation of inputs' gradients) runs: FSDP all-gathers them in the unit's pre-forward hook and frees
them after (the root's stay whole until the end of the forward's backward, or of the op). PEFT wraps the
sharded base modules afterwards, as on one device: a LoRA layer keeps its base `Linear` (whose weight FSDP
swaps between shard and whole), and its A and B are plain tensors that FSDP never saw. Adapters are therefore
created, switched and removed with no re-wrap, exactly as on one device, and the group replicates and
all-reduces them as the replicated group does (docs/scaling.md says why replicated).

A full fine-tuning session on a sharded group trains these weights themselves, each rank its shards: its fp32
masters, gradients and AdamW moments are DTensors placed as the base parameters are (treadle.gpu_worker.model.
full_weights). FSDP reduce-scatters the gradients of base weights that require them into each rank's shards; the
losses are sums over tokens, so the shards' gradients are summed over the ranks, not averaged.

Every all-gather is a collective: every rank must run the same units in the same order (forward, backward,
no-grad forward), whatever data it holds. The group's ops see to that (treadle.gpu_worker.parallel.distributed).
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from treadle.gpu_worker.model.lora_targets import decoder_layers

log = logging.getLogger("treadle.worker")


def shard_model(model: nn.Module, device: torch.device) -> None:
    """Shard `model`'s (frozen) weights over the default process group's ranks: one unit per decoder layer, one
    for the rest; the shards move to `device` (a rank's own GPU, or the CPU)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        # Freed after forward, gathered again for backward: one layer's whole weights at a time.
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # The root keeps its weights whole after its forward until its backward ends (or `reshard_all`): a loss may
    # call the output projection itself after the model's forward.
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # full sessions' gradients: a sum over the ranks, as the losses are
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def reshard_all(model: nn.Module) -> None:
    """Free every unit's gathered weights (no collective). The ranks of a group call it so that all start each
    op with every unit sharded (treadle.gpu_worker.parallel.lockstep): a rank that reads its state dict alone
    (rank 0 saving an adapter) reshards the root, and a unit whole on one rank but not on another would skip an
    all-gather the others enter."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather: every rank must call it), or `tensor` itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def placed_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor as `like` holds it: this rank's shard of it when `like` is a DTensor (cut here, no
    collective: every rank holds the whole tensor), else `tensor` itself."""
    if not isinstance(like, DTensor):
        return tensor
    return distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def rank_numel(param: torch.Tensor, sharded: bool) -> int:
    """Elements of a base weight that this rank holds as its shard when `sharded` (dim 0 cut into chunks of
    ceil(rows / N), as `fully_shard` cuts it), whether `param` is that shard or the whole weight a forward gathered."""
    if not sharded:
        return param.numel()
    rows, ranks = param.shape[0], dist.get_world_size()
    chunk = -(-rows // ranks)
    return max(0, min(chunk, rows - dist.get_rank() * chunk)) * (param.numel() // max(rows, 1))


@dataclass(frozen=True)
class ParameterBytes:
    """Base-model parameter bytes on this rank: its shards, the whole model's, the largest unit gathered at once."""

    local: int
    whole: int
    largest_unit: int

    def line(self) -> str:
        return (
            f"base parameters on this rank {self.local} B of {self.whole} B, "
            f"largest unit gathered at once {self.largest_unit} B"
        )


def parameter_bytes(model: nn.Module) -> ParameterBytes:
    """What `model`'s base weights (its DTensors when sharded, all its parameters when not) take on this rank."""
    local = whole = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            local += p.to_local().numel() * p.element_size()
            whole += p.numel() * p.element_size()
        elif not is_sharded(model):
            local += p.numel() * p.element_size()
            whole += p.numel() * p.element_size()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    largest = max((_unit_bytes(unit) for unit in units), default=whole)
    return ParameterBytes(local=local, whole=whole, largest_unit=largest)


def _unit_bytes(unit: nn.Module) -> int:
    """Whole bytes of the parameters this FSDP unit gathers (those of nested units are theirs)."""
    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return sum(
        p.numel() * p.element_size() for p in unit.parameters() if isinstance(p, DTensor) and id(p) not in nested
    )


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: the allocator's peak on CUDA, the peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def log_memory(model: nn.Module, device: torch.device, when: str) -> None:
    """One line a rank logs at load and after its first optimizer step: its parameter bytes and peak memory."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    peak = peak_memory_bytes(device) / (1 << 20)
    log.info("rank %d %s: %s; peak memory %.1f MiB", rank, when, parameter_bytes(model).line(), peak)
