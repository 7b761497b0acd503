"""Full fine-tuning: sessions that train the base model's own weights, beside the LoRA sessions on that model.

A full session holds its own copy of every weight it trains, as fp32 master weights (their gradients and AdamW
moments live in the session's `SessionOptimizer`). The host's model and its base weights, which LoRA sessions and
the base-model sampler use, never change: each forward swaps the session's tensors into the host's model for the
call (`torch.func.functional_call`) while every LoRA layer computes its base layer alone. So a LoRA session's
numbers are bitwise those it gets alone, and a full session's are those of a model made of its weights.

Precision: the masters are fp32; a forward computes in the host's dtype. On a CPU that is fp32 and the masters are
the compute weights. Under a bf16 base (CUDA) an op casts them to a bf16 copy, runs forward and backward on it, and
adds the copy's gradients, in fp32, to the masters'; AdamW steps the masters. A trained parameter costs 16 bytes
(4 master, 4 gradient, 8 moments), plus 4 transient bytes under bf16 (the copy and its gradient): `session_bytes`.

On a sharded group (`--shard`) each rank holds its shards of the session's state: masters, gradients and moments
are DTensors placed as FSDP places the base weights (treadle.gpu_worker.model.sharding), so a session needs 1/N of
its bytes on each of N ranks. There an op copies the masters into the base weights' own shards (in place: FSDP
gathers whole weights from its buffers, whatever tensor a call passes), lets FSDP reduce-scatter their gradients
into the shards, adds those to the masters', and copies the base weights back (the kept base shards and FSDP's
gradient: 2 transient bytes each a parameter under bf16, 4 under fp32, over N). A sampler snapshot of such a session
is sharded too: every rank keeps its shards of it (`frozen_copy` of its master shards), and a forward of rank 0's
sampler with the snapshot's rows swaps them into the base weights' shards on every rank the same way
(treadle.gpu_worker.parallel.lockstep).

Which weights: every one, or every one but the embeddings (`FullConfig.train_embeddings`: the input embeddings and
the output projection, one matrix when the model ties them). Weights a session does not train are the base's.

A frozen snapshot (`frozen_copy`, for the sampler) holds the trained weights in the compute dtype; the sampler runs
it as a model of its own (`AdapterBank.using`), in runs of rows of its own in a mixed batch. Admission counts what
snapshots hold (`held_bytes`) beside the sessions' state, and admits a snapshot only if it fits
(treadle.gpu_worker.model.full_memory).

Names are the parameter names `save_pretrained` writes (`model.layers.0.mlp.up_proj.weight`); the host's model
under PEFT's wrappers shows `...up_proj.base_layer.weight`, read as the same name. On disk a session's weights are
a Hugging Face model directory (config, safetensors shards with their index when there are several, tokenizer)
that `AutoModelForCausalLM.from_pretrained` loads, the untrained weights written from the base, plus
`FULL_MARKER`, which names the trained weights.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from treadle.errors import CheckpointNotFoundError, InvalidRequestError
from treadle.gpu_worker.model.sharding import is_sharded, placed_like, rank_numel, reshard_all, whole
from treadle.types import FullConfig

FULL_MARKER = "treadle_full.json"  # {"config": FullConfig, "trained": [names]}: a full session's model directory
SHARD_INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = "2GB"
# What a model directory holds besides its weights (what `export_adapter` and the REST export copy).
MODEL_FILES = ("config.json", "generation_config.json", FULL_MARKER)


def canonical_name(path: str) -> str | None:
    """The `save_pretrained` name of a parameter path of the host's model; None for a LoRA adapter's own tensor."""
    parts = path.split(".")
    if any(part.startswith("lora_") for part in parts):
        return None
    return ".".join(part for part in parts if part != "base_layer")


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base model's parameters by `save_pretrained` name, each once (tied ones under their first name)."""
    out = {}
    for path, param in model.named_parameters():
        name = canonical_name(path)
        if name is not None:
            out[name] = param
    return out


def bindings(model: nn.Module) -> dict[str, str]:
    """Every parameter path of `model`, tied ones under each of their paths, to its `save_pretrained` name."""
    first: dict[int, str] = {}
    out = {}
    for path, param in model.named_parameters(remove_duplicate=False):
        name = canonical_name(path)
        if name is not None:
            out[path] = first.setdefault(id(param), name)
    return out


def trained_names(model: nn.Module, config: FullConfig) -> list[str]:
    """The names a session of `config` trains on `model`."""
    embeddings = {id(_weight(model.get_input_embeddings())), id(_weight(model.get_output_embeddings()))}
    return [
        name for name, param in base_parameters(model).items() if config.train_embeddings or id(param) not in embeddings
    ]


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    return None if module is None else getattr(module, "base_layer", module).weight


def session_bytes(model: nn.Module, config: FullConfig, dtype: torch.dtype) -> int:
    """Device bytes of a session's trained weights on this rank (its shards of them on a sharded group): fp32
    master, gradient and two moments, and what an op holds beside them (`bytes_per_parameter`)."""
    params = base_parameters(model)
    sharded = is_sharded(model)
    return bytes_per_parameter(dtype, sharded) * sum(
        rank_numel(params[name], sharded) for name in trained_names(model, config)
    )


def bytes_per_parameter(dtype: torch.dtype, sharded: bool) -> int:
    """16 B of state; during an op under a half-precision base also the compute copy and its gradient, and on a
    sharded rank (whatever the dtype) the base shards kept aside and the gradient FSDP reduces into them."""
    return 16 + (2 * dtype.itemsize if sharded or dtype != torch.float32 else 0)


class FullWeights:
    """A full session's trained weights (fp32 masters, trainable), or a frozen snapshot of them."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, trainable: bool, config: FullConfig):
        self.params = {name: nn.Parameter(t, requires_grad=trainable) for name, t in tensors.items()}
        self.dtype = dtype  # what the forward computes in: the host's
        self.trainable = trainable  # a session's masters; False: a snapshot
        self.config = config

    @classmethod
    def fresh(cls, model: nn.Module, config: FullConfig, dtype: torch.dtype) -> "FullWeights":
        """Masters copied from the base model's weights (on a sharded model: from this rank's shards)."""
        reshard_all(model)
        params = base_parameters(model)
        tensors = {name: params[name].detach().to(torch.float32, copy=True) for name in trained_names(model, config)}
        return cls(tensors, dtype=dtype, trainable=True, config=config)

    def frozen_copy(self) -> "FullWeights":
        """A snapshot of the weights as they are now, in the compute dtype; training on never changes it."""
        tensors = {name: p.detach().to(self.dtype, copy=True) for name, p in self.params.items()}
        return FullWeights(tensors, dtype=self.dtype, trainable=False, config=self.config)

    @property
    def state_bytes(self) -> int:
        """`session_bytes`, counted from the masters this rank holds (its shards of them on a sharded group)."""
        sharded = any(isinstance(p, DTensor) for p in self.params.values())
        local = (p.to_local() if isinstance(p, DTensor) else p for p in self.params.values())
        return bytes_per_parameter(self.dtype, sharded) * sum(t.numel() for t in local)

    @property
    def held_bytes(self) -> int:
        """What these weights hold on this rank, as admission counts it: a session's state (`state_bytes`), a
        snapshot's weights (`FullMemory.snapshot_bytes`, treadle.gpu_worker.model.full_memory)."""
        if self.trainable:
            return self.state_bytes
        local = (p.to_local() if isinstance(p, DTensor) else p for p in self.params.values())
        return sum(t.numel() * t.element_size() for t in local)

    @contextmanager
    def swapped(self, model: nn.Module, paths: dict[str, str], *, trainable: bool) -> Iterator["SwappedModel"]:
        """`model` computing with these weights in place of the base's (`paths`: `bindings(model)`). Under a
        half-precision base a trainable call runs on a copy in that dtype whose gradients are added to the
        masters' when the block ends."""
        if is_sharded(model):
            with self._in_shards(model, trainable=trainable):
                yield model  # type: ignore[misc]  # called as a SwappedModel is
            return
        compute = {
            name: p if p.dtype == self.dtype else p.detach().to(self.dtype).requires_grad_(trainable)
            for name, p in self.params.items()
        }
        tensors = {path: compute[name] for path, name in paths.items() if name in compute}
        yield SwappedModel(model, tensors)
        if trainable:
            for name, copy in compute.items():
                master = self.params[name]
                if copy is not master and copy.grad is not None:
                    grad = copy.grad.to(torch.float32)
                    master.grad = grad if master.grad is None else master.grad + grad

    @contextmanager
    def _in_shards(self, model: nn.Module, *, trainable: bool) -> Iterator[None]:
        """A sharded `model` computing with these weights: each rank's master shards copied into the base weights'
        shards for the block (every unit sharded at both ends, so that no unit is whole with the other weights).
        Trainable: the base weights require gradients, which FSDP reduce-scatters (summed over the ranks) into
        their shards; those are added to the masters' when the block ends."""
        reshard_all(model)
        base = {name: p for name, p in base_parameters(model).items() if name in self.params}
        with torch.no_grad():  # in place: FSDP all-gathers from the buffers these local tensors are views of
            kept = {name: p.to_local().clone() for name, p in base.items()}
            for name, p in base.items():
                p.to_local().copy_(self.params[name].to_local())
        for p in base.values():
            p.requires_grad_(trainable)
        try:
            yield
        finally:
            reshard_all(model)
            for name, p in base.items():
                grad, p.grad = p.grad, None
                p.requires_grad_(False)
                master = self.params[name]
                if grad is not None and master.grad is not None:
                    master.grad.add_(grad)  # in place: no third copy of the shard's gradient
                elif grad is not None:
                    master.grad = grad.to(torch.float32)
                with torch.no_grad():
                    p.to_local().copy_(kept[name])

    def load(self, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Copy the trained weights from `tensors` (a model directory's, by name); all must be there, or none is
        copied."""
        missing = sorted(set(self.params) - set(tensors))
        if missing:
            raise InvalidRequestError(f"{source}: weights missing for this session ({missing[:3]})")
        for name, param in self.params.items():
            if tuple(tensors[name].shape) != tuple(param.shape):
                raise InvalidRequestError(
                    f"{source}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
                )
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(placed_like(tensors[name].to(device=param.device, dtype=param.dtype), param))

    def whole_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every weight of the model by name, these for the trained ones, the base's for the rest, whole (on a
        sharded group gathered: every rank calls it, in the same order), on the CPU."""
        reshard_all(model)  # every rank gathers the same weights: a weight whole on one rank only gathers nothing
        tensors = {name: p.detach() for name, p in base_parameters(model).items()}
        tensors.update({name: p.detach() for name, p in self.params.items()})
        return {name: whole(t).contiguous().cpu() for name, t in tensors.items()}

    def save(self, model: nn.Module, tokenizer, directory: str | Path) -> None:
        """A Hugging Face model directory: these weights, the base's for the rest, the model's config and
        tokenizer; tied weights written once, as `save_pretrained` does."""
        self.write(self.whole_tensors(model), model, tokenizer, directory)

    def write(self, tensors: dict[str, torch.Tensor], model: nn.Module, tokenizer, directory: str | Path) -> None:
        """`save`'s directory from `whole_tensors`' result (a sharded group gathers first, then rank 0 writes)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_torch_state_dict(tensors, str(directory), max_shard_size=MAX_SHARD_SIZE, metadata={"format": "pt"})
        model.config.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
        marker = {"config": self.config.model_dump(), "trained": sorted(self.params)}
        (directory / FULL_MARKER).write_text(json.dumps(marker, indent=1))

    @classmethod
    def of_snapshot(cls, snapshot: str | Path | FullSnapshot, model: nn.Module, *, dtype: torch.dtype) -> "FullWeights":
        """A frozen snapshot from a model directory that `save` wrote (or its tensors, read), on `model`'s device (on a
        sharded model: this rank's shards of it, placed as the base weights' are)."""
        if not isinstance(snapshot, FullSnapshot):
            snapshot = FullSnapshot.read(snapshot)
        reshard_all(model)  # the base weights as their shards, which the snapshot's are placed like
        params = base_parameters(model)
        return cls(
            {
                name: placed_like(tensor.to(device=params[name].device, dtype=dtype), params[name])
                for name, tensor in snapshot.tensors.items()
            },
            dtype=dtype,
            trainable=False,
            config=snapshot.config,
        )


@dataclass
class FullSnapshot:
    """A full session's snapshot read into memory: its config and its trained weights by name, whole, on the CPU."""

    config: FullConfig
    tensors: dict[str, torch.Tensor]

    @classmethod
    def read(cls, directory: str | Path) -> "FullSnapshot":
        config, trained = read_marker(directory)
        tensors = read_weights(directory)
        return cls(config, {name: tensors[name] for name in trained})


class SwappedModel:
    """The host's model called with a session's tensors in place of base weights (what `target_logprobs` and the
    sampler call: `model(**inputs)`, `get_output_embeddings()`, `config`)."""

    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor]):
        self.model = model
        self.tensors = tensors

    def __call__(self, *args, **kwargs):
        return functional_call(self.model, self.tensors, args, kwargs, tie_weights=False, strict=False)

    def output_projection(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The output projection with the session's weights: the training forward runs the decoder through
        `__call__` and the projection on its own, chunk by chunk (treadle.gpu_worker.training.logprobs)."""
        head = self.model.get_output_embeddings()
        prefix = next(path for path, module in self.model.named_modules() if module is head) + "."
        own = {path.removeprefix(prefix): t for path, t in self.tensors.items() if path.startswith(prefix)}
        return lambda hidden: functional_call(head, own, (hidden,), tie_weights=False, strict=False)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def is_full_dir(directory: str | Path) -> bool:
    return (Path(directory) / FULL_MARKER).is_file()


def snapshot_names(source: str | Path | FullSnapshot) -> list[str] | None:
    """The trained weights' names of a full session's snapshot (its model directory, or read); None for a LoRA
    adapter's directory."""
    if isinstance(source, FullSnapshot):
        return list(source.tensors)
    return read_marker(source)[1] if is_full_dir(source) else None


def read_marker(directory: str | Path) -> tuple[FullConfig, list[str]]:
    path = Path(directory) / FULL_MARKER
    if not path.is_file():
        raise CheckpointNotFoundError(f"{directory}: no {FULL_MARKER}; not a full fine-tuning checkpoint")
    marker = json.loads(path.read_text())
    return FullConfig.model_validate(marker["config"]), list(marker["trained"])


def weight_files(directory: str | Path) -> list[str]:
    """The safetensors shards of a model directory (with their index when there are several)."""
    directory = Path(directory)
    if (directory / SHARD_INDEX).is_file():
        shards = sorted(set(json.loads((directory / SHARD_INDEX).read_text())["weight_map"].values()))
        return [SHARD_INDEX, *shards]
    return ["model.safetensors"]


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in weight_files(directory):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(Path(directory) / name)))
    return tensors


def model_dir_files(directory: str | Path) -> list[str]:
    """The files of a full session's model directory that a download or export hands over (weights, config,
    tokenizer), not the optimizer, gradient and RNG files of a training state."""
    directory = Path(directory)
    tokenizer = [p.name for p in directory.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "vocab"))]
    extra = [p.name for p in directory.iterdir() if p.name in ("merges.txt", "chat_template.jinja")]
    present = [name for name in MODEL_FILES if (directory / name).is_file()]
    return [*present, *weight_files(directory), *tokenizer, *extra]


def check_same_kind(session_full: FullConfig | None, checkpoint_full: FullConfig | None, *, source: str) -> None:
    """load_state into a live session keeps what it trains: a LoRA checkpoint into a full session (or the other
    way), or a full one that trains other weights, is refused."""
    if session_full != checkpoint_full:
        ours = "full fine-tuning" if session_full else "LoRA"
        theirs = "full fine-tuning" if checkpoint_full else "LoRA"
        raise InvalidRequestError(
            f"path: {source} holds a {theirs} state ({checkpoint_full}) and this session is {ours} ({session_full}); "
            "create a training client from it instead"
        )
