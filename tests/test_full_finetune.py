"""Full fine-tuning sessions through the real stack: every weight trained, beside LoRA sessions on one worker.

Against a hand-written in-process loop (`torch.optim.AdamW` on the transformers model, fp32): losses and weights
within 1e-5 relative over 10 steps, on the tiny model and (`TREADLE_REAL_MODEL=1`) on SmolLM2-135M. A full session
and two LoRA sessions interleaved each give their alone-numbers bit for bit; a full session that does not fit is
refused with the bytes it needs against the bytes free; the sampler snapshot is a model directory that
`AutoModelForCausalLM.from_pretrained` loads and that gives the session's logprobs.
"""

from __future__ import annotations

import os
import re
import tempfile
import typing

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.test_op_matrix import _batch as loss_batch
from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.errors import InsufficientMemoryError
from treadle.local_stack import LocalStack
from treadle.types import FullConfig, LossFnType

ADAM = AdamParams(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0)
STEPS = 10
OFFSET = {"full": 0, "a": 5, "b": 9}  # each session of the interleaved run trains on its own data


def batch(step: int, vocab: int = 240) -> list[Datum]:
    out = []
    for i in range(2):
        toks = [(step * 11 + i * 17 + j * 5) % vocab + 5 for j in range(17)]
        out.append(
            Datum(
                model_input=ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [0.0] * 3 + [1.0] * 13},
            )
        )
    return out


def full_need(model_dir: str) -> tuple[int, int]:
    """What the worker's admission counts for a full session of the model: its weights, gradients and moments (what
    it holds), and those plus one micro-batch's activations (what must be free)."""
    from treadle.gpu_worker.model.full_weights import session_bytes
    from treadle.gpu_worker.model.host import CPU_MICROBATCH_TOKENS, activation_bytes_per_token

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    activations = int(CPU_MICROBATCH_TOKENS * activation_bytes_per_token(model.config, torch.float32))
    state = session_bytes(model, FullConfig(), torch.float32)
    return state, state + activations


def start_stack(spec: str, home: str, extra: list[str]) -> LocalStack:
    os.environ["OMP_NUM_THREADS"] = "1"  # bitwise comparable with the in-process runs
    stack = LocalStack([spec], home=home, workers=1, worker_args=extra)
    return stack.start(wait_for_workers=180)


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir, tmp_path_factory):
    """One worker on the tiny model where one full session fits, and a second does not beside it."""
    state, need = full_need(tiny_model_dir)
    limit = need + state // 2
    stack = start_stack(
        f"tiny={tiny_model_dir}",
        str(tmp_path_factory.mktemp("full")),
        ["--checkpoint_every", "5", "--full_session_memory", str(limit)],
    )
    yield stack, limit
    stack.stop()


def client(stack: LocalStack) -> ServiceClient:
    return ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)


def reference_loop(model_dir: str, steps: int, vocab: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Full fine-tuning written by hand: the transformers model, cross-entropy summed over weighted tokens,
    gradient clipping and `torch.optim.AdamW` with the session's hyperparameters."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(
        params,
        lr=ADAM.learning_rate,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
        fused=True,  # one pass a tensor: a 135M-parameter step in a fraction of the time of the default
    )
    losses = []
    for step in range(steps):
        total = 0.0
        for datum in batch(step, vocab):
            ids = torch.tensor([datum.model_input.to_ints()])
            targets = torch.from_numpy(datum.loss_fn_inputs["target_tokens"].to_numpy()).long()
            weights = torch.from_numpy(datum.loss_fn_inputs["weights"].to_numpy())
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1).gather(-1, targets[:, None])[:, 0]
            loss = -(logprobs * weights).sum()
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, ADAM.grad_clip_norm)
        adamw.step()
        adamw.zero_grad()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def model_weights(directory: str) -> dict[str, torch.Tensor]:
    names = [n for n in os.listdir(directory) if n.startswith("model") and n.endswith(".safetensors")]
    return {k: v for n in names for k, v in load_file(os.path.join(directory, n)).items()}


def assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], rel: float) -> None:
    """Each tensor within `rel` of the reference's, relative in norm: with AdamW's eps of 1e-12 an element whose
    gradient is rounding noise moves by up to the learning rate either way, in any two summation orders."""
    for name, tensor in ours.items():
        assert torch.linalg.norm(tensor - theirs[name]) <= rel * torch.linalg.norm(theirs[name]), name


def check_against_hand_written_loop(sc: ServiceClient, model: str, model_dir: str, vocab: int) -> None:
    tc = sc.create_full_training_client(model)
    assert tc.get_info().is_lora is False
    pairs = [(tc.forward_backward(batch(s, vocab), "cross_entropy"), tc.optim_step(ADAM)) for s in range(STEPS)]
    losses = [fb.result(timeout=600).metrics["loss:sum"] for fb, _ in pairs]
    assert pairs[-1][1].result(timeout=600).metrics["step:max"] == STEPS
    ref_losses, ref_weights = reference_loop(model_dir, STEPS, vocab)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    # The sampler snapshot (fp32 on a CPU: the weights as trained) is a model directory that transformers loads
    # alone, with the session's logprobs.
    sampler = tc.save_weights_and_get_sampling_client("snap")
    prompt = batch(STEPS, vocab)[0].model_input.to_ints()
    served = sampler.compute_logprobs(ModelInput.from_ints(prompt)).result(timeout=600)
    with tempfile.TemporaryDirectory() as out:
        sc.create_rest_client().export(sampler.model_path, out, merged=True)
        trained = model_weights(out)
        assert trained.keys() <= ref_weights.keys() and "model.embed_tokens.weight" in trained
        assert_close(trained, ref_weights, 1e-5)
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        logits = exported(input_ids=torch.tensor([prompt])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    np.testing.assert_allclose(served[1:], expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    sample = sampler.sample(ModelInput.from_ints(prompt[:4]), 2, _greedy(6)).result(timeout=600)
    assert [len(s.tokens) for s in sample.sequences] == [6, 6]
    tc.stop()


def _greedy(max_tokens: int):
    from treadle.types import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=1, seed=3)


def test_full_session_matches_a_hand_written_adamw_loop_tiny(tiny_stack, tiny_model_dir):
    stack, _ = tiny_stack
    check_against_hand_written_loop(client(stack), "tiny", tiny_model_dir, vocab=240)


@pytest.mark.skipif(os.environ.get("TREADLE_REAL_MODEL") != "1", reason="set TREADLE_REAL_MODEL=1 to train SmolLM2")
def test_full_session_matches_a_hand_written_adamw_loop_smollm2(tmp_path):
    from treadle.demo.model import prepare_smollm2

    model_dir = prepare_smollm2()
    # Automatic checkpoints of a 135M-parameter session write 1.6 GB each: none in these 10 steps. Admission counts
    # the activations of a whole micro-batch (2.8 MB a token, estimated): 1024 tokens, not the CPU's default 4096.
    extra = ["--checkpoint_every", "100", "--max_tokens_per_microbatch", "1024"]
    stack = start_stack(f"smol={model_dir}", str(tmp_path), extra)
    try:
        check_against_hand_written_loop(client(stack), "smol", model_dir, vocab=20000)
    finally:
        stack.stop()


def alone(model_dir: str, steps: int) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """Each session's losses and final weights when it is the only session of an in-process engine."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    torch.set_num_threads(1)
    engine = Engine(model_dir)
    out = {}
    for name, lora, full in (
        ("full", LoraConfig(), FullConfig()),
        ("a", LoraConfig(rank=4, seed=1), None),
        ("b", LoraConfig(rank=8, seed=2), None),
    ):
        engine.create_session(name, lora, full=full)
        losses = []
        for step in range(steps):
            losses.append(
                engine.forward_backward(name, batch(step + OFFSET[name]), "cross_entropy").metrics["loss:sum"]
            )
            engine.optim_step(name, ADAM)
        out[name] = (losses, {k: p.detach().clone() for k, p in engine.trainable_parameters(name).items()})
        engine.drop_session(name)
    engine.close()
    return out


def saved_tensors(sc: ServiceClient, path: str) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        sc.create_rest_client().download(path, tmp)
        names = [n for n in os.listdir(tmp) if n.endswith(".safetensors") and n.startswith(("model", "adapter"))]
        return {k: v for n in names for k, v in load_file(os.path.join(tmp, n)).items()}


def test_full_and_lora_sessions_interleaved_give_their_alone_numbers(tiny_stack, tiny_model_dir):
    stack, limit = tiny_stack
    sc = client(stack)
    steps = 4
    sessions = {
        "full": sc.create_full_training_client("tiny"),
        "a": sc.create_lora_training_client("tiny", rank=4, seed=1),
        "b": sc.create_lora_training_client("tiny", rank=8, seed=2),
    }
    futures: dict[str, list] = {name: [] for name in sessions}
    for step in range(steps):
        for name, tc in sessions.items():
            futures[name].append(tc.forward_backward(batch(step + OFFSET[name]), "cross_entropy"))
            tc.optim_step(ADAM)
        if step == 1:
            # A second full session does not fit beside the first: refused with the bytes, and nothing else moves.
            state, need = full_need(tiny_model_dir)
            with pytest.raises(InsufficientMemoryError) as refused:
                sc.create_full_training_client("tiny")
            held = sc.ops.session_info(sessions["full"].session_id).memory_bytes
            assert f"needs {need} bytes" in str(refused.value)
            # Held: the session's state, and the fp32 snapshot (4 of its 16 bytes a parameter) of the first test's
            # session if the worker's sampler cache holds it still.
            holding = int(re.search(r"less (\d+) held", str(refused.value))[1])
            assert holding - held in (0, state // 4)
            assert f"{limit - holding} bytes are free" in str(refused.value)
    # Metering counts each session by the memory its trained weights hold, times its ops' seconds.
    state, _ = full_need(tiny_model_dir)
    assert sc.ops.session_info(sessions["full"].session_id).memory_bytes == state
    for tc in sessions.values():
        usage, memory = tc.get_usage(), sc.ops.session_info(tc.session_id).memory_bytes
        assert usage.memory_gib_s == pytest.approx(memory / 2**30 * usage.compute_s, rel=1e-6)
    expected = alone(tiny_model_dir, steps)
    for name, tc in sessions.items():
        assert [f.result(timeout=300).metrics["loss:sum"] for f in futures[name]] == expected[name][0], name
        saved = saved_tensors(sc, tc.save_state("end").result(timeout=300).path)
        for key, tensor in expected[name][1].items():
            assert torch.equal(saved[key], tensor), (name, key)
        tc.stop()


def test_full_session_trains_with_every_loss(tiny_stack):
    stack, _ = tiny_stack
    tc = client(stack).create_full_training_client("tiny", train_embeddings=False)
    for loss_fn in typing.get_args(LossFnType):
        probe = tc.forward(loss_batch("cross_entropy"), "cross_entropy").result(timeout=60)
        data = loss_batch(loss_fn, [o["logprobs"].to_numpy() for o in probe.loss_fn_outputs])
        before = sum(o["logprobs"].to_numpy().sum() for o in probe.loss_fn_outputs)
        tc.forward_backward(data, loss_fn)
        tc.optim_step(AdamParams(learning_rate=2e-3))
        after = tc.forward(loss_batch("cross_entropy"), "cross_entropy").result(timeout=60)
        assert sum(o["logprobs"].to_numpy().sum() for o in after.loss_fn_outputs) > before, loss_fn
    saved = saved_tensors(client(stack), tc.save_state("frozen-embeddings").result(timeout=60).path)
    assert "model.embed_tokens.weight" in saved  # the directory is a whole model; the embeddings are the base's
    tc.stop()


def test_a_follower_rank_builds_the_full_session_its_rank_0_admitted(tiny_model_dir):
    """Rank 0 admits a full session for its whole device group; a follower that refused one rank 0 had made (its own
    free memory a little lower) would take the group down each time the session came back to it."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    engine = Engine(tiny_model_dir, full_session_memory=1)  # one byte: no full session fits
    try:
        with pytest.raises(InsufficientMemoryError):
            engine.create_session("refused", LoraConfig(rank=4), full=FullConfig())
        engine.full_memory.decides = False  # as treadle.gpu_worker.parallel.device_group sets it on a follower
        engine.create_session("replica", LoraConfig(rank=4), full=FullConfig())
        assert engine.step("replica") == 0
    finally:
        engine.close()
