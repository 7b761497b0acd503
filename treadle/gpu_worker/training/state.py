"""The on-disk layout of a session's training state (what the checkpoint store moves around).

    adapter_model.safetensors, adapter_config.json   the LoRA adapter (PeftModel.from_pretrained loads it); a full
                                                     session's: a model directory instead (`full_weights`)
    optimizer.safetensors                            Adam moments and step per parameter (if saved)
    gradients.safetensors                            gradients accumulated but not yet applied (if any),
                                                     so a checkpoint between forward_backward and
                                                     optim_step loses nothing
    rng_state.safetensors                            torch RNG state(s) of the process
    engine_state.json                                step count, LoRA or full config, base model, format

Files are plain safetensors and JSON: nothing is pickled. `read_checkpoint` reads a directory into a `Checkpoint`,
the tensors that `Engine.load_state` applies (on a device group rank 0 alone reads it, and its followers receive its
tensors: treadle.gpu_worker.parallel.broadcast).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.utils import load_peft_weights
from safetensors.torch import load_file, save_file

from treadle.errors import CheckpointNotFoundError, InvalidRequestError
from treadle.gpu_worker.model import full_weights
from treadle.types import FullConfig, LoraConfig

FORMAT_VERSION = 1
ENGINE_STATE = "engine_state.json"
OPTIMIZER = "optimizer.safetensors"
GRADIENTS = "gradients.safetensors"
RNG_STATE = "rng_state.safetensors"


@dataclass
class TrainingState:
    base_model: str
    lora: LoraConfig
    step: int
    optimizer: dict[str, torch.Tensor] | None  # None: saved without optimizer
    gradients: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    full: FullConfig | None = None  # set for a full fine-tuning session


@dataclass
class Checkpoint:
    """A training state read into memory: `TrainingState` and the session's weights by name (a LoRA adapter's portable
    names; a full session's, the model directory's)."""

    state: TrainingState
    weights: dict[str, torch.Tensor]
    source: str  # where it was read from, for errors


def capture_rng() -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda:{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["cpu"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda:"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def write_state(directory: str | Path, state: TrainingState) -> None:
    """Write everything but the adapter files (the adapter bank writes those into the same directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if state.optimizer is not None:
        save_file(state.optimizer, str(directory / OPTIMIZER))
    if state.gradients:
        save_file(state.gradients, str(directory / GRADIENTS))
    save_file(state.rng, str(directory / RNG_STATE))
    meta = {"format": FORMAT_VERSION, **state_meta(state)}
    (directory / ENGINE_STATE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def read_state(directory: str | Path, *, with_optimizer: bool) -> TrainingState:
    """Read a state directory; asking for the optimizer of a state saved without one is an error."""
    directory = Path(directory)
    meta_path = directory / ENGINE_STATE
    if not meta_path.is_file():
        raise CheckpointNotFoundError(f"{directory}: no {ENGINE_STATE}; not a treadle training state")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise InvalidRequestError(
            f"{meta_path}: format {meta.get('format')!r}, this worker reads format {FORMAT_VERSION}"
        )
    optimizer = None
    if with_optimizer:
        if not meta["has_optimizer"] or not (directory / OPTIMIZER).is_file():
            raise InvalidRequestError(
                f"{directory}: saved without optimizer state, so it cannot be loaded with the optimizer; load weights only"
            )
        optimizer = load_file(str(directory / OPTIMIZER))
    gradients = load_file(str(directory / GRADIENTS)) if meta["has_gradients"] else {}
    rng = load_file(str(directory / RNG_STATE)) if (directory / RNG_STATE).is_file() else {}
    return state_from_meta(meta, optimizer=optimizer, gradients=gradients, rng=rng)


def read_checkpoint(directory: str | Path, with_optimizer: bool) -> Checkpoint:
    """A state directory (`read_state`) with its session's weights, on the CPU."""
    state = read_state(directory, with_optimizer=with_optimizer)
    if state.full is not None:
        weights = full_weights.read_weights(directory)
    else:
        weights = load_peft_weights(str(directory), device="cpu")
    return Checkpoint(state, weights, source=str(directory))


def state_meta(state: TrainingState) -> dict:
    """What a state holds beside its tensors, as JSON."""
    return {
        "base_model": state.base_model,
        "lora": state.lora.model_dump(),
        "full": state.full.model_dump() if state.full else None,
        "step": state.step,
        "has_optimizer": state.optimizer is not None,
        "has_gradients": bool(state.gradients),
    }


def state_from_meta(
    meta: dict,
    *,
    optimizer: dict[str, torch.Tensor] | None,
    gradients: dict[str, torch.Tensor],
    rng: dict[str, torch.Tensor],
) -> TrainingState:
    return TrainingState(
        base_model=meta["base_model"],
        lora=LoraConfig.model_validate(meta["lora"]),
        step=int(meta["step"]),
        optimizer=optimizer,
        gradients=gradients,
        rng=rng,
        full=FullConfig.model_validate(meta["full"]) if meta.get("full") else None,
    )
