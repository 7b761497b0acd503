"""Switching the active adapter between sessions (`AdapterBank._activate`): the bank's own switch, which touches
only the two adapters involved, must leave every model family exactly as PEFT's `set_adapter` would."""

from __future__ import annotations

import random

import peft
import pytest
from peft.tuners.tuners_utils import BaseTunerLayer

from treadle.gpu_worker.model.adapters import AdapterBank, switchable
from treadle.gpu_worker.model.host import ModelHost
from treadle.testing.families import FAMILIES
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import LoraConfig


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("switch")
    return {family: build_tiny_model(root / family, arch=family) for family in FAMILIES}


def adapter_state(model: peft.PeftModel) -> dict:
    """What `set_adapter` sets: every parameter's requires_grad, each LoRA layer's active adapters, the model's."""
    return {
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "layers": {name: list(m.active_adapters) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)},
        "model": (model.active_adapter, model.base_model.active_adapter),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_switch_leaves_the_model_as_peft_set_adapter_would(family, dtype, family_dirs):
    bank = AdapterBank(ModelHost(family_dirs[family], dtype=dtype))
    names = [bank.new_name() for _ in range(3)]
    for seed, name in enumerate(names):
        bank.add(name, bank.lora_config(LoraConfig(rank=4)), seed=seed)
    assert switchable(bank.peft_model)  # else every activation below would be PEFT's own, and prove nothing
    chooser, switches = random.Random(0), 0
    for _ in range(16):
        name, trainable = chooser.choice(names), chooser.random() < 0.7
        switches += bank._active is not None and bank._active != (name, trainable)
        with bank.using(name, trainable=trainable) as model:
            assert model is bank.peft_model
        ours = adapter_state(bank.peft_model)
        assert {p for p, grad in ours["requires_grad"].items() if grad} == (
            {p for p in ours["requires_grad"] if f".{name}." in p} if trainable else set()
        )
        bank.peft_model.set_adapter(name, inference_mode=not trainable)
        assert adapter_state(bank.peft_model) == ours
    assert switches >= 8


def test_a_model_with_modules_to_save_switches_through_peft(family_dirs):
    """An adapter that trains whole modules (`modules_to_save`, as a user's PEFT directory may) has tensors outside
    the LoRA layers: the bank leaves such a model's switches to PEFT."""
    bank = AdapterBank(ModelHost(family_dirs["llama"], dtype="float32"))
    first, second = bank.new_name(), bank.new_name()
    bank.add(first, bank.lora_config(LoraConfig(rank=4, train_unembed=False)), seed=0)
    bank.add(second, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), seed=1)
    assert not switchable(bank.peft_model)
    for name in (first, second, first):
        with bank.using(name, trainable=True):
            pass
        ours = adapter_state(bank.peft_model)
        bank.peft_model.set_adapter(name, inference_mode=False)
        assert adapter_state(bank.peft_model) == ours
