"""Differentiating only the positions a loss can have a gradient at (`LossSpec.gradient_gate`) changes no
result: per loss, the same logprobs, loss and gradients as differentiating every position, within fp
tolerance, for GRPO-shaped datums (prompt positions A = 0), SFT-shaped ones (prompt weights 0) and top-k
targets. A batch with no gated position at all takes the ungated path, so its gradients stay zero tensors."""

import dataclasses

import numpy as np
import pytest
import torch

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.training import losses
from treadle.testing.families import FAMILIES
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import Datum, LoraConfig, ModelInput

LORA = LoraConfig(rank=8, alpha=16, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir)


def batch(loss_fn: str, *, advantage: float = 1.0) -> list[Datum]:
    """Four sequences of different lengths; the first half of each is a 'prompt' whose gate input is 0."""
    rng = np.random.default_rng(0)
    data = []
    for i, length in enumerate([9, 14, 6, 11]):
        tokens = rng.integers(5, 400, length + 1)
        gate = np.zeros(length, np.float32)
        gate[length // 2 :] = advantage * (1.0 if i % 2 else -0.5)
        if loss_fn == "cross_entropy":
            inputs = {"target_tokens": tokens[1:], "weights": np.abs(gate)}
        elif loss_fn == "cross_entropy_topk":
            targets = np.stack([tokens[1:], rng.integers(5, 400, length)], axis=1)
            inputs = {"target_tokens": targets, "weights": np.abs(np.stack([gate, gate / 2], axis=1))}
        else:
            inputs = {"target_tokens": tokens[1:], "logprobs": -rng.random(length).astype(np.float32)}
            inputs["advantages"] = gate
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = (gate != 0).astype(np.float32)
        data.append(Datum(model_input=ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs))
    return data


def run(engine: Engine, session_id: str, loss_fn: str, data: list[Datum], *, gated: bool | None = None):
    """forward_backward on a fresh session; `gated` checks which path ran (the model's forward hands the
    projection its `(B, T, hidden)` states, which it skips; then the projection takes the positions with a graph,
    and, when only the gated positions have one, the others)."""
    engine.create_session(session_id, LORA)
    inputs = []
    head = engine._host.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, output: inputs.append(args[0].dim()))
    try:
        out = engine.forward_backward(session_id, data, loss_fn)
        if gated is not None:
            assert inputs == ([3, 2, 2] if gated else [3, 2])
        grads = {
            k: None if p.grad is None else p.grad.clone() for k, p in engine.trainable_parameters(session_id).items()
        }
        return out, grads
    finally:
        hook.remove()
        engine.drop_session(session_id)


@pytest.mark.parametrize(
    "loss_fn", ["cross_entropy", "cross_entropy_topk", "importance_sampling", "ppo", "cispo", "gspo"]
)
def test_gated_positions_give_the_same_results(engine, loss_fn, monkeypatch):
    name = "cross_entropy" if loss_fn == "cross_entropy_topk" else loss_fn
    assert losses.LOSSES[name].gradient_gate is not None
    data = batch(loss_fn)
    gated, gated_grads = run(engine, "gated", name, data, gated=True)
    monkeypatch.setitem(losses.LOSSES, name, dataclasses.replace(losses.LOSSES[name], gradient_gate=None))
    every, every_grads = run(engine, "every", name, data, gated=False)
    assert gated.metrics["loss:sum"] == pytest.approx(every.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    for a, b in zip(gated.loss_fn_outputs, every.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)
    assert gated_grads.keys() == every_grads.keys()
    assert any(torch.count_nonzero(g) for g in every_grads.values())  # (LoRA's A has none at init: B = 0)
    for key, grad in every_grads.items():
        torch.testing.assert_close(gated_grads[key], grad, rtol=1e-4, atol=1e-6)


def test_a_batch_with_no_gated_position_keeps_zero_gradients(engine):
    out, grads = run(engine, "flat", "importance_sampling", batch("importance_sampling", advantage=0.0), gated=False)
    assert out.metrics["loss:sum"] == 0.0
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gives_the_same_results(family, tmp_path, monkeypatch):
    """Each family's own logit post-processing (soft-capping, scaling) applies to the gated positions too."""
    engine = Engine(build_tiny_model(tmp_path / family, arch=family, initializer_range=0.2))
    data = batch("importance_sampling")
    gated, gated_grads = run(engine, "gated", "importance_sampling", data, gated=True)
    spec = losses.LOSSES["importance_sampling"]
    monkeypatch.setitem(losses.LOSSES, "importance_sampling", dataclasses.replace(spec, gradient_gate=None))
    every, every_grads = run(engine, "every", "importance_sampling", data, gated=False)
    assert gated.metrics["loss:sum"] == pytest.approx(every.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    for a, b in zip(gated.loss_fn_outputs, every.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)
    for key, grad in every_grads.items():
        torch.testing.assert_close(gated_grads[key], grad, rtol=1e-4, atol=1e-6)
