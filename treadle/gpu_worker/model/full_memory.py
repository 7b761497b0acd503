"""Admission of an engine's full fine-tuning sessions and their sampler snapshots: what each needs, what is free.

A full session needs its state (`full_weights.session_bytes`) and the activations of one micro-batch; a snapshot its
weights in the compute dtype. What they hold is counted on this rank (its shards on a sharded group), and on a
device group rank 0 decides for every rank (`decides`).
"""

from __future__ import annotations

from typing import Iterable

import psutil
import torch

from treadle.errors import InsufficientMemoryError, InvalidRequestError
from treadle.gpu_worker.model.full_weights import FullWeights, base_parameters, session_bytes
from treadle.gpu_worker.model.host import ModelHost, activation_bytes_per_token
from treadle.gpu_worker.model.sharding import rank_numel
from treadle.types import FullConfig


class FullMemory:
    """Admission of an engine's full sessions and their snapshots: a session is made only if its state
    (`session_bytes`) and the activations of one micro-batch of `budget_tokens` fit what is free, a snapshot only if
    its weights do (`snapshot_bytes`). Free: `limit` bytes less what the full sessions and snapshots hold
    (`FullWeights.held_bytes`), or (limit 0) the device's free memory, the host's available memory on a CPU."""

    def __init__(self, host: ModelHost, budget_tokens: int, limit: int, *, sharded: bool = False):
        self.host = host
        self.budget_tokens = budget_tokens
        self.limit = limit
        self.sharded = sharded  # the host's weights are shards (`--shard`): so are a full session's, on each rank
        self.decides = True  # False on a device group's follower ranks: rank 0 admits for the group

    def session_bytes(self, config: FullConfig) -> int:
        return session_bytes(self.host.model, config, self.host.dtype)

    def free(self, held: int) -> int:
        if self.limit:
            return max(0, self.limit - held)
        if self.host.device.type == "cuda":  # what the driver has free, and what torch's allocator holds unused
            unused = torch.cuda.memory_reserved(self.host.device) - torch.cuda.memory_allocated(self.host.device)
            return int(torch.cuda.mem_get_info(self.host.device)[0] + unused)
        return int(psutil.virtual_memory().available)

    def admitted(self, config: FullConfig, held: int) -> "FullWeights":
        """A new session's weights, if it fits; else `InsufficientMemoryError` with the bytes it needs and the bytes
        free. `held`: the state bytes of the full sessions the engine holds (less one it replaces)."""
        state = self.session_bytes(config)
        activations = int(self.budget_tokens * activation_bytes_per_token(self.host.model.config, self.host.dtype))
        need, free = state + activations, self.free(held)
        if self.decides and need > free:
            raise InsufficientMemoryError(
                f"full fine-tuning of {self.host.name}: needs {need} bytes{self._per_rank} "
                f"({state} for weights, gradients and AdamW "
                f"moments, {activations} for activations of {self.budget_tokens} tokens), {free} bytes are free "
                f"({self._free_of(held)}); train a LoRA adapter, or use a worker with more memory"
            )
        return FullWeights.fresh(self.host.model, config, self.host.dtype)

    @property
    def _per_rank(self) -> str:
        return " per rank" if self.sharded else ""

    def _free_of(self, held: int) -> str:
        """What `free(held)` is counted from, as an error says it."""
        if self.limit:
            return f"--full_session_memory less {held} held by full sessions and their sampler snapshots"
        return str(self.host.device)

    def snapshot_bytes(self, names: Iterable[str]) -> int:
        """Device bytes of a frozen snapshot of the weights `names` on this rank (its shards of them on a sharded
        group), in the compute dtype."""
        params = base_parameters(self.host.model)
        return self.host.dtype.itemsize * sum(rank_numel(params[name], self.sharded) for name in names)

    def check_snapshot(self, sampler_path: str, sampler_id: str, *, names: list[str] | None, held: int) -> None:
        """A full snapshot (`names`: the weights it holds; None: a LoRA adapter) is a model of its own, which the vllm
        sampler (sent LoRA adapters only) does not serve, admitted only if its weights fit what is free."""
        if names is None:
            return
        if sampler_path == "vllm":
            raise InvalidRequestError(
                f"sampler_id: {sampler_id!r} is a full fine-tuning snapshot, which the vllm sampler does not serve; "
                "sample it on a worker started with --sampler hf"
            )
        need, free = self.snapshot_bytes(names), self.free(held)
        if self.decides and need > free:
            raise InsufficientMemoryError(
                f"sampler_id: {sampler_id!r}: a full fine-tuning snapshot of {self.host.name} needs {need} bytes"
                f"{self._per_rank} (its trained weights in {str(self.host.dtype).removeprefix('torch.')}), {free} "
                f"bytes are free ({self._free_of(held)}); sample it on a worker with more memory"
            )
