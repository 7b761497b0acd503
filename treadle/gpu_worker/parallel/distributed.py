"""Data parallelism over a device group: `GroupEngine` on rank 0, `execute` on the other ranks.

Strategy: data parallelism, DDP's semantics written out by hand. Every rank holds a replica of every session
(adapter, AdamW moments, pending gradients) and either the whole base model (replicated) or its 1/N shards
(`--shard`: FSDP2, treadle.gpu_worker.model.sharding). A `forward_backward` batch is split into contiguous
shards of about equal token counts, one per rank; each rank runs the engine's own forward/backward on its
shard, and the new gradients are summed (`all_reduce(SUM)`, one flat buffer per call) into every replica's
pending gradients. treadle's losses are sums over tokens, so the summed shard gradients are the whole batch's
gradient, as on one device, and so is the loss (the sum of the shard losses). `optim_step` then runs on every
rank on identical gradients: clipping sees the global norm, and the replicas stay identical, so rank 0's copy
is the session. The adapters are never FSDP's: a treadle engine adds, switches and removes LoRA adapters per
session on one shared PeftModel, and FSDP wraps a fixed set of parameters (the frozen base weights only).

A full fine-tuning session is replicated the same way on a replicated group: every rank holds its fp32 weights,
gradients and moments (`trainable_parameters` are its weights), so a group fits what one device of it fits. On a
sharded group each rank holds its shards of them instead (DTensors, treadle.gpu_worker.model.full_weights): FSDP
sums their gradients over the ranks in each backward, `optim_step` runs on every rank at once (clipping gathers
the global norm), and `save_state` gathers them whole, every rank taking part (docs/scaling.md).

What runs where: session lifecycle, training and `load_state` run on every rank (rank 0 first for the calls that
can be refused, so a refused request reaches no follower); rank 0 alone reads a loaded checkpoint's files, and the
followers, on its host or others, receive its tensors by broadcast (treadle.gpu_worker.parallel.broadcast);
`save_state` writes rank 0's replica (a sharded session's gathered), the same PEFT adapter and optimizer files as a
one-device worker; sampling, samplers and every other read run on rank 0 alone (the other ranks hold no samplers). On
a sharded group every rank still takes part in each of those forwards, with an idle pass (treadle.gpu_worker.parallel.
lockstep), and a full session's snapshot is the exception: every rank makes (or loads, from the tensors rank 0 read)
its own shards of it when rank 0 does, keyed by rank 0's name for it, swaps them in for the forwards rank 0 announces
with it, takes part in the gathers of its `save_sampler_weights`, and frees them once rank 0 has dropped it and no
request needs it.
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack
from functools import partial
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from treadle.gpu_worker.model.full_weights import FullSnapshot, is_full_dir
from treadle.gpu_worker.model.sharding import is_sharded, log_memory
from treadle.gpu_worker.parallel.broadcast import checkpoint_call, share_checkpoint, share_snapshot, snapshot_call
from treadle.gpu_worker.parallel.lockstep import Mirror, end_of_op, idle_pass, rounds_of
from treadle.gpu_worker.training.state import TrainingState, read_checkpoint, write_state
from treadle.gpu_worker.training.validation import check_loss, prepare_data
from treadle.queue.ops import (
    CreateSessionRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    OptimStepRequest,
    SaveStateRequest,
)
from treadle.types import WIRE, AdamParams, Datum, ForwardBackwardOutput, FullConfig, LoraConfig, OptimStepResponse

T = TypeVar("T")
_RUNS = {cls.op: cls for cls in (ForwardRequest, ForwardBackwardRequest)}


def split_by_tokens(lengths: list[int], ranks: int) -> list[list[int]]:
    """Contiguous shards of datum indices, one per rank, of about equal token counts (a datum whole).

    A datum goes to the rank whose share of the batch's tokens holds the datum's midpoint.
    """
    shards: list[list[int]] = [[] for _ in range(ranks)]
    total, start = sum(lengths), 0
    for index, length in enumerate(lengths):
        shards[min(ranks - 1, int(ranks * (start + length / 2) / total))].append(index)
        start += length
    return shards


def run_shard(engine, session_id: str, request: ForwardRequest, idle: int = 0) -> ForwardBackwardOutput | None:
    """This rank's share of a data-parallel forward(_backward); gradients summed over all ranks after.
    `idle`: idle passes to run after its own micro-batches (a sharded group's lockstep)."""
    params = engine.trainable_parameters(session_id)
    # A sharded full session's gradients are summed over the ranks by FSDP, into each rank's shards, during each
    # backward; every other session's are summed here, the call's apart from the pending ones.
    summed_here = request.stateful and not holds_shards(params)
    pending = {name: p.grad for name, p in params.items()}
    if summed_here:
        for p in params.values():
            p.grad = None
    run = engine.forward_backward if request.stateful else engine.forward
    # A rank with no datum still takes part in the sum (and, sharded, in every unit's collectives).
    out = run(session_id, request.data, request.loss_fn, request.loss_fn_config) if request.data else None
    for _ in range(idle):
        idle_pass(engine, engine._session(session_id).adapter, backward=request.stateful)
    end_of_op(engine)
    if not summed_here:
        return out
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params.values()])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for name, p in params.items():
        grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        p.grad = grad.clone() if pending[name] is None else pending[name] + grad
    return out


def holds_shards(params: dict[str, torch.Tensor]) -> bool:
    """Whether a session's trained tensors are each rank's shards (a full session on a sharded group)."""
    return any(isinstance(p, DTensor) for p in params.values())


_LOGGED: set[int] = set()


def log_first_step(engine) -> None:
    """A sharded rank's parameter bytes and peak memory after its first optimizer step (once per model)."""
    if id(engine) not in _LOGGED and is_sharded(engine._host.model):
        _LOGGED.add(id(engine))
        log_memory(engine._host.model, engine._host.device, f"{engine.base_model} after the first step")


def execute(engines: dict, call: dict) -> dict | None:
    """A follower runs one call from rank 0 on its replica; the answer is what rank 0 gathers (None: a call
    rank 0 does not wait for)."""
    engine, name = engines[call["model"]], call["call"]
    if name == "mirror":  # with the snapshot rank 0's forward computes with, if any (`GroupEngine._announce`)
        snapshot = call.get("snapshot")
        idle_pass(engine, engine.samplers.adapter(snapshot) if snapshot else None, backward=False)
        end_of_op(engine)
        return None
    session_id, snapshot = call.get("session_id"), call.get("snapshot")
    if name in _RUNS:
        out = run_shard(engine, session_id, _RUNS[name].decode(call["request"]), call["idle"])
        return {"output": out.model_dump(mode="json", context=WIRE) if out is not None else None}
    if name == OptimStepRequest.op:
        engine.optim_step(session_id, OptimStepRequest.decode(call["request"]).adam_params)
        log_first_step(engine)
    elif name == CreateSessionRequest.op:
        full = FullConfig.model_validate(call["full"]) if call.get("full") else None
        engine.create_session(session_id, LoraConfig.model_validate(call["lora"]), full=full)
    elif name == "drop_session":
        engine.drop_session(session_id)
    elif name == SaveStateRequest.op:
        gather_state(engine, session_id, include_optimizer=call["include_optimizer"])
    elif name == LoadStateRequest.op:  # the checkpoint rank 0 has read, by broadcast: its files may be on another host
        read = share_checkpoint(None, call["checkpoint"], engine._host.device)
        engine.load_state(session_id, read, with_optimizer=call["with_optimizer"])
    elif name == "snapshot_sampler":  # a follower's samplers are keyed by rank 0's names for them
        engine.snapshot_sampler(session_id, snapshot)
    elif name == "load_sampler":
        engine.load_sampler(snapshot, share_snapshot(None, call["full"], engine._host.device))
    elif name == "drop_sampler":
        engine.drop_sampler(snapshot)
    elif name == "save_sampler_weights":  # the gathers of rank 0's `FullWeights.save`, whose results it writes
        engine._bank.full[engine.samplers.adapter(snapshot)].whole_tensors(engine._host.model)
    else:
        raise ValueError(f"call: unknown {name!r}")
    return {}


def gather_state(engine, session_id: str, *, include_optimizer: bool) -> tuple[dict[str, torch.Tensor], TrainingState]:
    """A sharded full session's weights and state whole, as `Engine.save_state` writes them: every rank runs the same
    gathers in the same order (the weights, then the optimizer's moments and gradients); rank 0 alone writes."""
    session = engine._session(session_id)
    tensors = engine._bank.full[session.adapter].whole_tensors(engine._host.model)
    return tensors, session.state(engine.base_model, include_optimizer=include_optimizer)


def write_gathered(
    engine, session_id: str, directory: str, gathered: tuple[dict[str, torch.Tensor], TrainingState]
) -> None:
    """Rank 0 writes what `gather_state` gathered: the files `Engine.save_state` writes."""
    tensors, state = gathered
    engine._bank.full[engine._session(session_id).adapter].write(
        tensors, engine._host.model, engine.tokenizer, directory
    )
    write_state(directory, state)


class GroupEngine:
    """Rank 0's engine in a device group: replicates session state, splits training batches.

    Anything not defined here (sampling, samplers, save_state, step, limits, the tokenizer) is rank 0's
    own engine's, through `__getattr__`.
    """

    def __init__(self, local, model: str, group):
        self._local = local
        self._model = model
        self._group = group
        self.ranks = group.size
        # Calls reach the followers in the order rank 0 runs them, and on a sharded group no forward of rank 0's
        # may come between a call's sending and its end: every call holds the device.
        self._lock = local.device
        self._mirror = Mirror(local._host.model, self._announce, group.fail) if group.shard else None

    def _announce(self) -> None:
        # The full snapshot rank 0 swapped into its shards for this forward (None: the base weights'): each follower
        # swaps in its own shards of it.
        message = {"call": "mirror", "model": self._model, "snapshot": self._local._bank.swapped}
        self._group.send([message] * (self.ranks - 1))

    def _group_op(self) -> ExitStack:
        """The block of a group op: rank 0's forwards in it are its own share, announced to no follower."""
        stack = ExitStack()
        stack.enter_context(self._lock)
        if self._mirror is not None:
            stack.enter_context(self._mirror.group_op())
        return stack

    def __getattr__(self, name: str):
        return getattr(self._local, name)

    def _replicate(self, name: str, **fields) -> None:
        message = {"call": name, "model": self._model, **fields}
        self._group.call([message] * (self.ranks - 1))

    # ------------------------------------------------------------ sessions

    def create_session(self, session_id: str, lora: LoraConfig, full: FullConfig | None = None) -> None:
        if lora.seed is None:  # every replica must start from the same initialisation
            lora = lora.model_copy(update={"seed": secrets.randbits(31)})
        with self._group_op():
            self._local.create_session(session_id, lora, full=full)
            self._replicate(
                "create_session",
                session_id=session_id,
                lora=lora.model_dump(mode="json"),
                full=full.model_dump(mode="json") if full else None,
            )

    def drop_session(self, session_id: str) -> None:
        with self._group_op():
            self._local.drop_session(session_id)
            self._replicate("drop_session", session_id=session_id)

    def load_state(self, session_id: str, directory: str, *, with_optimizer: bool) -> None:
        """Rank 0 reads the checkpoint and loads it first (a refused load reaches no follower); the followers receive
        the tensors it read (treadle.gpu_worker.parallel.broadcast), never its files."""
        read = read_checkpoint(directory, with_optimizer)
        with self._group_op():
            self._local.load_state(session_id, read, with_optimizer=with_optimizer)
            call = checkpoint_call(read, list(self._local.trainable_parameters(session_id)))
            share = partial(share_checkpoint, read, call, self._local._host.device)
            self._together(
                share, LoadStateRequest.op, session_id=session_id, with_optimizer=with_optimizer, checkpoint=call
            )

    # ------------------------------------------------------------ training

    def forward(
        self, session_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> ForwardBackwardOutput:
        return self._data_parallel(ForwardRequest, session_id, data, loss_fn, loss_fn_config)

    def forward_backward(
        self, session_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> ForwardBackwardOutput:
        return self._data_parallel(ForwardBackwardRequest, session_id, data, loss_fn, loss_fn_config)

    def _data_parallel(
        self,
        request_cls: type[ForwardRequest],
        session_id: str,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict | None,
    ) -> ForwardBackwardOutput:
        with self._group_op():
            # The whole batch is checked here, before any rank runs: a refused request changes no replica.
            self._local.step(session_id)  # raises for an unknown session
            check_loss(loss_fn, loss_fn_config)
            prepared = prepare_data(
                data, loss_fn, max_seq_len=self._local.max_seq_len, vocab_size=self._local.vocab_size
            )
            split = split_by_tokens([d.length for d in prepared], self.ranks)
            shards = [
                request_cls(data=[data[i] for i in shard], loss_fn=loss_fn, loss_fn_config=loss_fn_config)
                for shard in split
            ]
            idle = [0] * self.ranks
            if self._mirror is not None:
                rounds = rounds_of(
                    [[prepared[i].length for i in s] for s in split], self._local.max_tokens_per_microbatch
                )
                idle = [max(rounds) - r for r in rounds]
            try:
                self._group.send(
                    [
                        {
                            "call": request_cls.op,
                            "model": self._model,
                            "session_id": session_id,
                            "request": shard.encode().decode(),
                            "idle": rank_idle,
                        }
                        for shard, rank_idle in zip(shards[1:], idle[1:])
                    ]
                )
                outputs = [run_shard(self._local, session_id, shards[0], idle[0])]
                outputs += [
                    ForwardBackwardOutput.model_validate(r["output"]) if r["output"] else None
                    for r in self._group.receive()
                ]
            except Exception as exc:  # a rank failed mid-call: the replicas can no longer be trusted
                self._group.fail(f"{request_cls.op} on session {session_id}: {exc!r}")
            done = [out for out in outputs if out is not None]
            return ForwardBackwardOutput(
                loss_fn_outputs=[o for out in done for o in out.loss_fn_outputs],
                metrics={"loss:sum": sum(out.metrics["loss:sum"] for out in done)},
            )

    def optim_step(self, session_id: str, params: AdamParams) -> OptimStepResponse:
        with self._group_op():
            self._local.step(session_id)  # raises for an unknown session, before any rank steps
            request = OptimStepRequest(adam_params=params).encode().decode()
            # Every rank at once: a sharded session's clipping takes the global norm of its shards' gradients.
            step = partial(self._local.optim_step, session_id, params)
            response = self._together(step, OptimStepRequest.op, session_id=session_id, request=request)
            log_first_step(self._local)
            return response

    def save_state(self, session_id: str, directory: str, *, include_optimizer: bool = True) -> None:
        """Rank 0's replica, as a one-device worker writes it; a sharded session's gathered whole first, every rank
        taking part (`gather_state`)."""
        if not holds_shards(self._local.trainable_parameters(session_id)):
            return self._local.save_state(session_id, directory, include_optimizer=include_optimizer)
        with self._group_op():
            gather = partial(self._lock.run, gather_state, self._local, session_id, include_optimizer=include_optimizer)
            gathered = self._together(
                gather, SaveStateRequest.op, session_id=session_id, include_optimizer=include_optimizer
            )
        # Written once every rank has left the gathers: a write that fails (a full disk) fails this op, not the group.
        with self._lock:
            self._lock.run(write_gathered, self._local, session_id, directory, gathered)

    def _together(self, local: Callable[[], T], name: str, **fields) -> T:
        """`local()` on rank 0 while every follower runs call `name`: a call whose collectives every rank enters."""
        self._group.send([{"call": name, "model": self._model, **fields}] * (self.ranks - 1))
        try:
            result = local()
        except Exception as exc:  # the followers are in the call: the replicas can no longer be trusted
            self._group.fail(f"{name} on {fields.get('session_id') or fields.get('snapshot')}: {exc!r}")
        self._group.receive()
        return result

    # ------------------------------------------------------------ samplers

    def snapshot_sampler(self, session_id: str, sampler_id: str) -> None:
        """Rank 0's snapshot; a full session's on a sharded group is made on every rank, each of its own shards."""
        with self._lock:
            self._local.snapshot_sampler(session_id, sampler_id)  # first: a refused snapshot reaches no follower
            if (snapshot := self._sharded_snapshot(sampler_id)) is not None:
                self._replicate("snapshot_sampler", session_id=session_id, snapshot=snapshot)

    def load_sampler(self, sampler_id: str, adapter_dir: str) -> None:
        """Rank 0's sampler; a full session's snapshot on a sharded group is loaded on every rank, from the tensors rank
        0 read (treadle.gpu_worker.parallel.broadcast)."""
        read = FullSnapshot.read(adapter_dir) if self._mirror is not None and is_full_dir(adapter_dir) else None
        with self._lock:
            self._local.load_sampler(sampler_id, read or adapter_dir)  # first: a refused load reaches no follower
            if read is not None and (snapshot := self._sharded_snapshot(sampler_id)) is not None:
                call = snapshot_call(read)
                share = partial(share_snapshot, read, call, self._local._host.device)
                self._together(share, "load_sampler", snapshot=snapshot, full=call)

    def drop_sampler(self, sampler_id: str) -> None:
        with self._lock:
            snapshot = self._sharded_snapshot(sampler_id)
            self._local.drop_sampler(sampler_id)
            if snapshot is not None:  # the followers keep their shards until rank 0's last forward with them is done
                drop = partial(self._replicate, "drop_sampler", snapshot=snapshot)
                self._local.samplers.backend.when_unused(snapshot, drop)

    def save_sampler_weights(self, sampler_id: str, directory: str) -> None:
        """Rank 0's sampler as a one-device worker writes it; a sharded full snapshot gathered whole first, every
        rank taking part."""
        if (snapshot := self._sharded_snapshot(sampler_id)) is None:
            return self._local.save_sampler_weights(sampler_id, directory)
        weights, host = self._local._bank.full[snapshot], self._local._host
        with self._group_op():
            tensors = self._together(
                partial(self._lock.run, weights.whole_tensors, host.model), "save_sampler_weights", snapshot=snapshot
            )
        with self._lock:  # as `save_state`: a write that fails fails this op alone
            self._lock.run(weights.write, tensors, host.model, host.tokenizer, directory)

    def _sharded_snapshot(self, sampler_id: str) -> str | None:
        """Rank 0's name for the sampler if it is a full session's snapshot on a sharded group (each rank holds its
        shards of it, under that name), else None."""
        adapter = self._local.samplers.adapter(sampler_id)
        return adapter if self._mirror is not None and adapter in self._local._bank.full else None
