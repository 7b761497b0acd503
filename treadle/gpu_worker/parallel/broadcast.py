"""A checkpoint rank 0 has read, sent to every rank of its device group over torch.distributed.

A group can span hosts, and only rank 0 reaches the store: a follower can read neither the store nor the directory
rank 0 downloads a checkpoint into. So rank 0 reads the files into tensors (`read_checkpoint`, `FullSnapshot.read`),
the call tells the followers only what tensors to expect (names, dtypes, shapes: JSON), and the tensors travel by
broadcast on the group's process group (gloo on CPUs, NCCL on GPUs), in the call's order, packed per dtype into
buffers of at most `BUCKET_BYTES` (a larger tensor alone), so a rank's device holds one buffer at a time. Every rank
then applies the same tensors the same way (`Engine.load_state`, `Engine.load_sampler`); a sharded rank keeps its
shards of them (`placed_like`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from treadle.gpu_worker.model.full_weights import FullSnapshot
from treadle.gpu_worker.training.state import Checkpoint, state_from_meta, state_meta
from treadle.types import FullConfig

BUCKET_BYTES = 64 << 20

Specs = list[tuple[str, str, list[int]]]  # (name, dtype, shape) per tensor, in broadcast order


def specs_of(tensors: dict[str, torch.Tensor]) -> Specs:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]


def _buckets(specs: Specs) -> list[list[int]]:
    """Runs of consecutive tensors of one dtype whose bytes fit a bucket together."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, name, shape) in enumerate(specs):
        nbytes = math.prod(shape) * getattr(torch, name).itemsize
        if not buckets or name != dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size, dtype = 0, name
        buckets[-1].append(i)
        size += nbytes
    return buckets


def broadcast(tensors: dict[str, torch.Tensor] | None, specs: Specs, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0 sends `tensors` (None elsewhere); every rank returns them by name, on the CPU, in `specs`' order."""
    out: dict[str, torch.Tensor] = {}
    for bucket in _buckets(specs):
        sizes = [math.prod(specs[i][2]) for i in bucket]
        if tensors is not None:
            flat = torch.cat([tensors[specs[i][0]].reshape(-1) for i in bucket]).to(device)
        else:
            flat = torch.empty(sum(sizes), dtype=getattr(torch, specs[bucket[0]][1]), device=device)
        dist.broadcast(flat, src=0)
        if tensors is None:
            for i, part in zip(bucket, flat.cpu().split(sizes)):
                out[specs[i][0]] = part.view(specs[i][2])
    return out if tensors is None else {name: tensors[name] for name, _, _ in specs}


def checkpoint_call(read: Checkpoint, weights: list[str]) -> dict:
    """The JSON a load_state call carries for `read`, whose `weights` (the session's, by name) travel with it."""
    state = read.state
    return {
        "meta": state_meta(state),
        "weights": specs_of({name: read.weights[name] for name in weights}),
        "optimizer": specs_of(state.optimizer) if state.optimizer is not None else None,
        "gradients": specs_of(state.gradients),
        "rng": specs_of(state.rng),
        "source": read.source,
    }


def share_checkpoint(read: Checkpoint | None, call: dict, device: torch.device) -> Checkpoint:
    """Rank 0 sends the checkpoint it has read (`read`; None on the other ranks), in the order `checkpoint_call`
    lists; every rank returns it."""
    if read is not None:
        state = read.state
        broadcast(read.weights, call["weights"], device)
        if state.optimizer is not None:
            broadcast(state.optimizer, call["optimizer"], device)
        broadcast(state.gradients, call["gradients"], device)
        broadcast(state.rng, call["rng"], device)
        return read
    weights = broadcast(None, call["weights"], device)
    optimizer = broadcast(None, call["optimizer"], device) if call["optimizer"] is not None else None
    gradients, rng = broadcast(None, call["gradients"], device), broadcast(None, call["rng"], device)
    state = state_from_meta(call["meta"], optimizer=optimizer, gradients=gradients, rng=rng)
    return Checkpoint(state, weights, source=call["source"])


def snapshot_call(snapshot: FullSnapshot) -> dict:
    """The JSON a load_sampler call carries for a full session's snapshot, whose tensors travel with it."""
    return {"config": snapshot.config.model_dump(mode="json"), "tensors": specs_of(snapshot.tensors)}


def share_snapshot(snapshot: FullSnapshot | None, call: dict, device: torch.device) -> FullSnapshot:
    """Rank 0 sends the snapshot it has read (`snapshot`; None on the other ranks); every rank returns it."""
    tensors = broadcast(snapshot.tensors if snapshot is not None else None, call["tensors"], device)
    return snapshot or FullSnapshot(FullConfig.model_validate(call["config"]), tensors)
