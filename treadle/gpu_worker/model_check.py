"""The pre-flight of a model: load it as a worker would, print its profile, train two steps and sample.

`treadle models check MODEL` runs this before a worker is pointed at a model. The smoke is what a
first session does: a rank-32 LoRA adapter (every target: attention, MLP and experts), two
cross-entropy steps on random tokens, a sample from a snapshot, and the sampled tokens' logprobs
checked against the training forward's logprobs of the same tokens (the sampler/trainer agreement RL
depends on). It exits non-zero, naming what failed, when any part does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from treadle.types import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams

# Agreement of sampled-token logprobs with the training forward (max |difference| in nats): fp32 agrees
# to rounding; bf16 rounds every matmul to 8 bits of mantissa (tests/test_model_families.py measures it).
TOLERANCE = {"float32": 1e-4, "float16": 0.5, "bfloat16": 0.5}
# Nemotron-H: transformers' own cached decode of its Mamba-2 layers (the step recurrence) differs from its
# own full forward (the chunked scan) by ~3e-3 nats in fp32 on a tiny peaked model; the sampler decodes the same way.
FP32_FAMILY_TOLERANCE = {"nemotron_h": 1e-2}


def tolerance(family: str, dtype: str) -> float:
    """The largest sampled-vs-trained logprob difference (nats) a healthy model shows in `dtype`."""
    return FP32_FAMILY_TOLERANCE.get(family, TOLERANCE["float32"]) if dtype == "float32" else TOLERANCE.get(dtype, 0.5)


@dataclass
class SmokeResult:
    losses: list[float]
    sample_gap: float
    tokens_per_s: float
    seconds: float


def cross_entropy_datum(tokens: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


def forward_logprobs(engine, session_id: str, tokens: list[int]) -> np.ndarray:
    """The training forward's logprob of each token of `tokens` after the first."""
    out = engine.forward(session_id, [cross_entropy_datum(tokens)], "cross_entropy")
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def smoke(engine, *, rank: int = 32, steps: int = 2, seed: int = 0) -> SmokeResult:
    """Train `steps` steps on random tokens, sample from a snapshot, compare logprobs (see module docstring)."""
    started = time.monotonic()
    rng = np.random.default_rng(seed)
    high = min(engine.vocab_size, 32_000)

    def draw(n: int) -> list[int]:
        tokens = rng.integers(0, high, n)
        # A vision-language model refuses its image token in text (images come as image chunks).
        if engine.vision is not None:
            tokens[tokens == engine.vision.image_token_id] = engine.vision.image_token_id + 1
        return tokens.tolist()

    data = [cross_entropy_datum(draw(24)) for _ in range(4)]
    engine.create_session("check", LoraConfig(rank=rank, alpha=rank, seed=seed))
    try:
        losses = []
        for _ in range(steps):
            losses.append(engine.forward_backward("check", data, "cross_entropy").metrics["loss:sum"])
            engine.optim_step("check", AdamParams(learning_rate=1e-2))
        losses.append(engine.forward("check", data, "cross_entropy").metrics["loss:sum"])
        engine.snapshot_sampler("check", "check-sampler")
        prompt = draw(12)
        t0 = time.monotonic()
        response = engine.samplers.sample(
            "check-sampler", ModelInput.from_ints(prompt), 4, SamplingParams(max_tokens=16, seed=seed, temperature=1.0)
        )
        sampled = sum(len(s.tokens) for s in response.sequences)
        tokens_per_s = sampled / max(time.monotonic() - t0, 1e-9)
        gap = 0.0
        for seq in response.sequences:
            expected = forward_logprobs(engine, "check", prompt + seq.tokens)[len(prompt) - 1 :]
            gap = max(gap, float(np.abs(expected - np.asarray(seq.logprobs)).max()))
        engine.drop_sampler("check-sampler")
    finally:
        engine.drop_session("check")
    return SmokeResult(losses=losses, sample_gap=gap, tokens_per_s=tokens_per_s, seconds=time.monotonic() - started)


def render(profile, result: SmokeResult | None) -> str:
    """The profile (and smoke result) as the plain text `treadle models check` prints."""
    counts = profile.trainable_at_rank_32
    lines = [
        f"family        {profile.family}",
        f"dtype         {profile.dtype}",
        f"max length    {profile.max_seq_len}",
        f"layers        {profile.layers}: {', '.join(profile.attention)}"
        + (f"; {profile.experts} experts" if profile.experts else ""),
        f"lora attn     {', '.join(profile.lora_attention) or '-'} ({counts['attn']:,} params at rank 32)",
        f"lora mlp      {', '.join(profile.lora_mlp) or '-'} ({counts['mlp']:,} params at rank 32)",
        f"lora experts  {', '.join(profile.lora_experts) or '-'} ({counts['experts']:,} params at rank 32)",
        f"lora unembed  {', '.join(profile.lora_unembed) or '-'} ({counts['unembed']:,} params at rank 32)",
        f"sampler       {profile.sampler}",
        f"static decode {profile.static_decode}",
        f"vllm          {profile.vllm}",
        f"inputs        {', '.join(profile.inputs)}",
    ]
    if result is not None:
        lines += [
            f"smoke         loss {' -> '.join(f'{x:.2f}' for x in result.losses)}; sampled vs trained logprobs "
            f"max |diff| {result.sample_gap:.2e}; {result.tokens_per_s:.1f} sampled tokens/s; {result.seconds:.1f} s",
        ]
    return "\n".join(lines)


def check_result(profile, result: SmokeResult) -> list[str]:
    """What failed in a smoke run (empty: it passed)."""
    problems = []
    if not result.losses[-1] < result.losses[0]:
        problems.append(f"the loss did not fall over the training steps ({result.losses})")
    bound = tolerance(profile.family, profile.dtype)
    if not result.sample_gap <= bound:
        problems.append(f"sampled logprobs differ from the training forward's by {result.sample_gap:.3g} (> {bound})")
    return problems
