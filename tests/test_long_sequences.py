"""Long sequences (docs/scaling.md, "Long sequences"): activation checkpointing per decoder layer and logits
computed in chunks change no result, and take a fraction of the memory.

- Per family that trains (tiny configs, fp32 and bf16; Gemma 3 with its logit soft-cap set, Granite with its
  logit scaling): the loss and gradients of checkpointed layers with chunked logits against a plain forward of the
  model's whole logits; the decoder layers really ran twice.
- Every built-in loss, fp32: the same loss, logprobs and gradients as one unchunked pass without checkpointing.
- `auto` checkpoints a micro-batch over the budget and no other; the tensor memory of forward_backward on a long
  datum (from torch's profiler: deterministic, not a timing) is at most 35 % of the plain path's, with the same
  loss and gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.training.losses import LOSSES
from treadle.testing.memory import peak_tensor_bytes
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import Datum, LoraConfig, ModelInput

TRAINED = ["llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma3", "granite"]
WHOLE = 10**9  # a logits chunk larger than any micro-batch here: one pass of the projection, as without chunks
CHUNK = 7  # positions a chunk: every micro-batch here takes several, the last one partial


def datum(loss_fn: str, length: int, seed: int = 0) -> Datum:
    """A datum for `loss_fn` whose first third is a prompt (weight or advantage 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 500, length + 1)
    gate = np.where(np.arange(length) < length // 3, 0.0, rng.normal(size=length)).astype(np.float32)
    inputs: dict = {"target_tokens": tokens[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = np.abs(gate)
    else:
        inputs["logprobs"] = -rng.random(length).astype(np.float32) - 5.0
        inputs["advantages"] = gate
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (gate != 0).astype(np.float32)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs)


def session(engine: Engine, session_id: str) -> dict[str, torch.nn.Parameter]:
    """A fresh session whose LoRA B is not 0 (so that A's gradients are not 0 either)."""
    engine.create_session(session_id, LoraConfig(rank=4, seed=0))
    params = engine.trainable_parameters(session_id)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, p in params.items():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return params


def gradients(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The accumulated gradients as fp32 copies, cleared."""
    grads = {name: p.grad.float().clone() for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return grads


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """|got - want| / |want| over the whole gradient."""
    diff = sum(float((got[k] - want[k]).square().sum()) for k in want)
    return (diff / sum(float(w.square().sum()) for w in want.values())) ** 0.5


def run(engine: Engine, session_id: str, data: list[Datum], loss_fn: str, checkpointing: str, chunk: int):
    engine.memory_plan.checkpointing, engine.memory_plan.chunk = checkpointing, chunk
    return engine.forward_backward(session_id, data, loss_fn)


def layer_calls(engine: Engine) -> list[int]:
    """A counter of the calls of the first decoder layer's submodules: a checkpointed layer runs them again in the
    backward pass (up to the last one whose activations its backward needs)."""
    calls = [0]
    for module in engine.memory_plan.layers[0].children():
        module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", TRAINED)
def test_checkpointed_layers_and_chunked_logits_match_the_whole_logits(family, dtype, tmp_path):
    engine = Engine(build_tiny_model(tmp_path / family, arch=family, initializer_range=0.2), dtype=dtype)
    if family == "gemma3":
        engine._host.model.config.final_logit_softcapping = 2.0  # read by the model's forward and by the chunks
    params = session(engine, "s")
    data = [datum("cross_entropy", 40)]
    # The plain forward: the model's whole logits, a log-softmax and a gather, no treadle code on the way.
    with engine._bank.using(engine._sessions["s"].adapter, trainable=True) as model:
        ids = torch.tensor([data[0].model_input.to_ints()])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        targets = torch.from_numpy(data[0].loss_fn_inputs["target_tokens"].to_numpy())[:, None]
        weights = torch.from_numpy(data[0].loss_fn_inputs["weights"].to_numpy())
        want = -(torch.log_softmax(logits.float(), -1).gather(-1, targets)[:, 0] * weights).sum()
        want.backward()
    want_grads = gradients(params)
    calls = layer_calls(engine)
    got = run(engine, "s", data, "cross_entropy", "on", CHUNK).metrics["loss:sum"]
    got_grads, twice = gradients(params), calls[0]
    run(engine, "s", data, "cross_entropy", "off", CHUNK)
    assert twice > calls[0] - twice  # checkpointed: the layer ran again in the backward pass
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert got == pytest.approx(want.item(), rel=tolerance)
    assert relative(got_grads, want_grads) < tolerance


def test_every_loss_chunked_and_checkpointed_equals_one_plain_pass(tiny_model_dir):
    engine = Engine(tiny_model_dir, dtype="float32")
    params = session(engine, "s")
    data = [datum("x", 23, seed=1), datum("x", 40, seed=2), datum("x", 9, seed=3)]
    for loss_fn in LOSSES:
        batch = [datum(loss_fn, len(d.model_input.to_ints()), seed=i) for i, d in enumerate(data)]
        plain = run(engine, "s", batch, loss_fn, "off", WHOLE)
        plain_grads = gradients(params)
        chunked = run(engine, "s", batch, loss_fn, "on", CHUNK)
        assert chunked.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5), loss_fn
        for a, b in zip(chunked.loss_fn_outputs, plain.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5)
        assert relative(gradients(params), plain_grads) < 1e-5, loss_fn


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory) -> str:
    """The tiny Llama with 8 decoder layers and 1,024 positions: a long datum's activations outweigh the rest."""
    directory = build_tiny_model(tmp_path_factory.mktemp("deep"), arch="llama", initializer_range=0.2)
    config = AutoConfig.from_pretrained(directory)
    config.num_hidden_layers, config.max_position_embeddings = 8, 1024
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_auto_checkpoints_a_long_datum_in_a_fraction_of_the_memory(deep_model_dir):
    engine = Engine(deep_model_dir, dtype="float32", max_tokens_per_microbatch=512)
    memory = engine.memory_plan.memory
    assert memory.fits(512) and not memory.fits(513) and memory.fits(1024, checkpointed=True)
    params = session(engine, "s")
    calls = layer_calls(engine)
    engine.forward_backward("s", [datum("cross_entropy", 512)], "cross_entropy")  # within the budget: not checkpointed
    once = calls[0]
    engine.forward_backward("s", [datum("cross_entropy", 300)] * 2, "cross_entropy")  # 2 x 300 padded: over it
    assert calls[0] - once > once
    gradients(params)

    long = [datum("cross_entropy", 1024)]

    def measured(checkpointing: str, chunk: int):
        engine.memory_plan.checkpointing, engine.memory_plan.chunk = checkpointing, chunk
        with engine.device:  # the profiler sees the thread it runs on: the one the engine computes on
            out, peak = engine.device.run(
                peak_tensor_bytes, lambda: engine.forward_backward("s", long, "cross_entropy")
            )
        return out.metrics["loss:sum"], gradients(params), peak

    plain_loss, plain_grads, plain_peak = measured("off", WHOLE)
    loss, grads, peak = measured("auto", 64)
    assert loss == pytest.approx(plain_loss, rel=1e-5) and relative(grads, plain_grads) < 1e-5
    assert peak <= 0.35 * plain_peak, (peak, plain_peak)
