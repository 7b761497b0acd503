"""Many LoRA adapters on one base model: a single `PeftModel` whose adapters are keyed by name.

Every training session and every frozen sampler snapshot is one named adapter here. Sessions share
the base weights; each adapter has its own tensors, so a session never sees another's weights or
gradients (only the active adapter takes part in a forward pass). The `PeftModel` is created with
the first adapter and kept afterwards, even when every adapter is gone.

A full fine-tuning session and its snapshots are named weights here too (`full`, `treadle.gpu_worker.model.
full_weights`): the sampler and the training forward ask for a name whatever it holds.

Adapter names are internal (`adapter_<n>`): user ids may contain characters that module names may
not. Tensors are addressed by *portable* names, the parameter name without the adapter segment
(`...q_proj.lora_A.weight`), which is exactly the key format of a PEFT `adapter_model.safetensors`.
"""

from __future__ import annotations

import copy
import secrets
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import peft
import torch
from peft.tuners.lora import LoraLayer
from peft.utils import AuxiliaryTrainingWrapper, get_peft_model_state_dict, load_peft_weights
from safetensors.torch import save_file
from torch import nn

from treadle.errors import CheckpointNotFoundError, InvalidRequestError
from treadle.gpu_worker.model import full_weights
from treadle.gpu_worker.model.full_weights import FullSnapshot, FullWeights
from treadle.gpu_worker.model.lora_targets import LoraTargets, check_requested
from treadle.gpu_worker.model.host import ModelHost
from treadle.types import LoraConfig


def peft_lora_config(lora: LoraConfig, base_model: str, targets: LoraTargets) -> peft.LoraConfig:
    """The PEFT config of a session's adapter: train_attn/train_mlp/train_unembed resolved to `targets`,
    the parts of this model they name (`lora_targets`); 3-D expert weights through `target_parameters`."""
    flags = dict(attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed)
    check_requested(targets, **flags, vision=lora.train_vision, model_name=base_model)
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,  # dropout would make steps depend on RNG state; Tinker has none
        target_modules=targets.modules(**flags, vision=lora.train_vision),
        exclude_modules=targets.exclude(vision=lora.train_vision) or None,
        target_parameters=targets.parameters(mlp=lora.train_mlp) or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


class AdapterBank:
    """Named LoRA adapters on the host's model; the model to call for a given adapter (or the base)."""

    def __init__(self, host: ModelHost):
        self.host = host
        self.peft_model: peft.PeftModel | None = None
        self._counter = 0
        # (adapter, trainable) of the last activation: `using` skips a repeat, and a switch only touches these two
        # adapters' tensors (`_activate`). None: unknown, the next activation goes through PEFT's set_adapter.
        self._active: tuple[str, bool] | None = None
        self._lora_layers: list[LoraLayer] | None = None  # found once per set of adapters, see `lora_layers`
        self._switchable: bool | None = None  # `switchable`, found once per set of adapters
        self._tensors: dict[str, list[torch.Tensor]] = {}  # `adapter_tensors` per adapter, found once per set
        self.version = 0  # bumped whenever an adapter is added or removed (what caches of adapter tensors key on)
        self.full: dict[str, FullWeights] = {}  # full fine-tuning sessions and their snapshots, by name
        self._bindings: tuple[int, dict[str, str]] | None = None  # (version, `full_weights.bindings` of the model)
        # The full weights a forward computes with (within `using`), which a sharded group's followers swap in too.
        self.swapped: str | None = None

    def lora_config(self, lora: LoraConfig) -> peft.LoraConfig:
        """The PEFT config of a new session's adapter on this model."""
        return peft_lora_config(lora, self.host.name, self.host.targets)

    def new_name(self) -> str:
        self._counter += 1
        return f"adapter_{self._counter}"

    def add(self, name: str, config: peft.LoraConfig, seed: int | None = None) -> None:
        """Add an adapter with PEFT's init (A random, B zero), reproducible for a given seed.

        The init runs on a forked RNG, so adding an adapter never moves the process's global RNG.
        """
        devices = [self.host.device] if self.host.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            # peft warns when lm_head is tied to the embeddings; the engine never merges in place and
            # the merged export unties them first.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
            torch.manual_seed(seed if seed is not None else secrets.randbits(63))
            if self.peft_model is None:
                self.peft_model = peft.get_peft_model(self.host.model, config, adapter_name=name)
                self.peft_model.eval()
            else:
                self.peft_model.add_adapter(name, config)
        self._adapters_changed()  # PEFT leaves a new adapter's tensors trainable: the activation sets every flag
        self._activate(name, trainable=False)  # frozen until a training op activates it

    def add_full(self, name: str, weights: FullWeights) -> None:
        """A full session's weights (or a snapshot of them) under `name`."""
        self.full[name] = weights

    def remove(self, name: str) -> None:
        if self.full.pop(name, None) is not None:
            return
        with warnings.catch_warnings():  # peft warns when the active adapter goes; every op re-activates its own
            warnings.simplefilter("ignore", UserWarning)
            self.peft_model.delete_adapter(name)
        self._adapters_changed()  # PEFT may have made another adapter active

    def config(self, name: str) -> peft.LoraConfig:
        return self.peft_model.peft_config[name]

    def parameters(self, name: str) -> dict[str, nn.Parameter]:
        """The adapter's parameters by portable name, in a stable order (a full session's: by model name)."""
        if name in self.full:
            return self.full[name].params
        segment = f".{name}."
        return {
            param_name.replace(segment, "."): param
            for param_name, param in self.peft_model.named_parameters()
            if segment in param_name
        }

    def copy_weights(self, name: str, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Copy tensors (by portable name) into an adapter; every key must match, or nothing is copied."""
        params = self.parameters(name)
        missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        if missing or unexpected:
            raise InvalidRequestError(
                f"{source}: adapter tensors do not match (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        for key, param in params.items():
            if tuple(tensors[key].shape) != tuple(param.shape):
                raise InvalidRequestError(
                    f"{source}: {key} has shape {tuple(tensors[key].shape)}, expected {tuple(param.shape)}"
                )
        with torch.no_grad():
            for key, param in params.items():
                param.copy_(tensors[key].to(device=param.device, dtype=param.dtype))

    def add_copy(self, name: str, source: str) -> None:
        """A new frozen adapter holding a copy of `source`'s tensors at this moment."""
        if source in self.full:
            self.add_full(name, self.full[source].frozen_copy())
            return
        self.add(name, self.config(source))
        self.copy_weights(name, {k: p.detach() for k, p in self.parameters(source).items()}, source=source)

    def add_from_dir(self, name: str, source: str | Path | FullSnapshot) -> None:
        """A new frozen adapter from a PEFT adapter directory (adapter_config.json + adapter_model.*), or a full
        session's snapshot from its model directory or its tensors (`FullSnapshot`)."""
        if isinstance(source, FullSnapshot) or full_weights.is_full_dir(source):
            self.add_full(name, FullWeights.of_snapshot(source, self.host.model, dtype=self.host.dtype))
            return
        if not (Path(source) / "adapter_config.json").is_file():
            raise CheckpointNotFoundError(f"{source}: no adapter_config.json; not a PEFT adapter directory")
        self.add(name, peft.LoraConfig.from_pretrained(str(source)))
        try:
            self.copy_weights(name, load_peft_weights(str(source), device="cpu"), source=str(source))
        except Exception:
            self.remove(name)
            raise

    def load_weights(self, name: str, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Copy the weights of a saved state (`save`'s directory, read) into adapter `name`; every key must match."""
        if name in self.full:
            self.full[name].load(tensors, source=source)
        else:
            self.copy_weights(name, tensors, source=source)

    def save(self, name: str, directory: str | Path) -> None:
        """Write the adapter as a PEFT directory that `PeftModel.from_pretrained` loads (a full session's weights: a
        model directory that `AutoModelForCausalLM.from_pretrained` loads)."""
        if name in self.full:
            self.full[name].save(self.host.model, self.host.tokenizer, directory)
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # lm_head is a LoRA target, not a trained embedding: never write the base weight.
        tensors = get_peft_model_state_dict(self.peft_model, adapter_name=name, save_embedding_layers=False)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors")
        )
        config = copy.deepcopy(self.config(name))
        config.inference_mode = True
        config.base_model_name_or_path = self.host.name
        config.save_pretrained(str(directory))

    @contextmanager
    def using(self, name: str | None, *, trainable: bool) -> Iterator[nn.Module]:
        """The model to call with adapter `name` active (None: the bare base model; a full session's name: the base
        model computing with its weights, every LoRA layer off)."""
        if name in self.full:
            with self.adapters_off() if self.peft_model is not None else nullcontext():
                with self.full[name].swapped(self.host.model, self._full_bindings(), trainable=trainable) as model:
                    self.swapped = name
                    try:
                        yield model  # type: ignore[misc]  # called as the model is
                    finally:
                        self.swapped = None
            return
        if name is None:
            # The host's model itself, not the PeftModel: PeftModel's forward looks up its active adapter's
            # config, and once the last adapter is removed that name is gone (PEFT leaves it set), so a
            # base pass through it fails. The LoRA layers sit inside the host's model; switched off, each
            # computes its base layer alone.
            if self.peft_model is None:
                yield self.host.model
            else:
                with self.adapters_off():
                    yield self.host.model
            return
        self._activate(name, trainable=trainable)
        yield self.peft_model

    def _full_bindings(self) -> dict[str, str]:
        """`full_weights.bindings` of the host's model, found again when adapters wrap other modules."""
        if self._bindings is None or self._bindings[0] != self.version:
            self._bindings = (self.version, full_weights.bindings(self.host.model))
        return self._bindings[1]

    def lora_layers(self) -> list[LoraLayer]:
        """The model's LoRA layers (PEFT's wrappers of the targeted modules)."""
        if self._lora_layers is None:
            self._lora_layers = [m for m in self.peft_model.modules() if isinstance(m, LoraLayer)]
        return self._lora_layers

    @contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Within the block every LoRA layer computes its base layer alone. PEFT's `disable_adapter()` does
        this too, but first builds a status report of every layer (`get_model_status`): a third of a
        SmolLM2 decode step (py-spy), and it leaves the active adapter trainable when it ends. Here it is
        the flag each layer's forward reads, and nothing else changes."""
        layers = self.lora_layers()
        for layer in layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in layers:
                layer._disable_adapters = False

    def _adapters_changed(self) -> None:
        """Forget what was found for the old set of adapters (an adapter may target modules no other adapter has),
        and which one is active: the next activation goes through PEFT's set_adapter."""
        self._lora_layers = self._switchable = self._active = None
        self._tensors = {}
        self.version += 1

    def _tensors_of(self, name: str) -> list[torch.Tensor]:
        if name not in self._tensors:
            self._tensors[name] = adapter_tensors(self.lora_layers(), name)
        return self._tensors[name]

    def _activate(self, name: str, *, trainable: bool) -> None:
        """Make `name` the active adapter, its tensors trainable or frozen (every other adapter's frozen).

        PEFT's `set_adapter` walks every module of the model and sets the flags of every adapter's tensors: 0.5 ms
        on the tiny model with two adapters, 1.2 ms with eight, and it grows with layers and adapters, paid twice
        whenever two sessions take turns. Only the adapter that was active can have trainable tensors, so a switch
        (`switch_adapter`) freezes that one's, sets the new one's, and marks it active in the LoRA layers."""
        if self._active == (name, trainable):
            return
        if self._switchable is None:
            self._switchable = switchable(self.peft_model)
        if self._active is None or not self._switchable:
            self.peft_model.set_adapter(name, inference_mode=not trainable)
        else:
            previous = self._tensors_of(self._active[0])
            switch_adapter(self.peft_model, self.lora_layers(), previous, name, self._tensors_of(name), trainable)
        self._active = (name, trainable)


def switchable(model: peft.PeftModel) -> bool:
    """Whether `switch_adapter` can stand in for PEFT's `set_adapter` on this model: a LoRA model with no
    auxiliary trainable modules (`modules_to_save`, trainable tokens), none of its LoRA layers merged."""
    return isinstance(model.base_model, peft.LoraModel) and not any(
        isinstance(m, AuxiliaryTrainingWrapper) or (isinstance(m, LoraLayer) and m.merged) for m in model.modules()
    )


def adapter_tensors(layers: list[LoraLayer], name: str) -> list[torch.Tensor]:
    """The tensors of adapter `name` whose flags PEFT's `set_adapter` sets: those in the layers' adapter dicts
    (`adapter_layer_names`: lora_A, lora_B, their embedding and DoRA counterparts)."""
    found = []
    for layer in layers:
        for attribute in layer.adapter_layer_names:
            tensors = getattr(layer, attribute)
            if name in tensors:
                held = tensors[name]
                found.extend([held] if isinstance(held, torch.Tensor) else held.parameters())
    return found


def switch_adapter(
    model: peft.PeftModel,
    layers: list[LoraLayer],
    previous: list[torch.Tensor],
    name: str,
    tensors: list[torch.Tensor],
    trainable: bool,
) -> None:
    """What `model.set_adapter(name, inference_mode=not trainable)` does to a `switchable` model whose adapters are
    all frozen but the one that was active (`previous`: its `adapter_tensors`; `tensors`: `name`'s): `previous`
    frozen, `tensors` trainable or not (those PEFT keeps frozen, e.g. LoRA-FA's A, kept frozen), `name` active in
    every LoRA layer (BaseTunerLayer.set_adapter), in the tuner and in the model. `tests/test_adapter_switch.py`
    holds it to PEFT's result."""
    for group, flag in ((previous, False), (tensors, trainable)):
        for tensor in group:
            if tensor.is_leaf:
                tensor.requires_grad_(flag)
    for layer in layers:
        if layer.frozen_peft_weight_names:
            layer._freeze_non_trainable_peft_weights([name])
        layer._active_adapter = [name]
    model.base_model.active_adapter = name
    model.active_adapter = name
