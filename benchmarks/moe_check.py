"""A mixture-of-experts model at real layer size through the whole stack: GRPO steps, sampler/trainer agreement.

scripts/gpu_check.sh runs it on a lent GPU. The GPU machine reaches no model hub, so unless `--model DIR`
names a local checkpoint (gpt-oss-20b, a Qwen3-MoE, ...), it builds one: gpt-oss-20b's layer shapes
(hidden 2880, 64 query / 8 key-value heads of 64, 32 experts of 2880 with top-4 routing, alternating
128-token sliding windows with sinks), `--layers` of its 24 layers, random bf16 weights and the tiny
512-token tokenizer. Random weights do not learn anything useful; what is measured is what a real
model shares with them: the LoRA adapter on attention and on every expert, the cost of a step, and
whether the sampler's logprobs agree with the trainer's.

Through SDK -> queue -> worker: `--steps` GRPO steps (every prompt's group sampled at once from a fresh
snapshot, group-centred rewards, one importance_sampling forward_backward per group, optim_step), then
the sampled tokens' logprobs against the trainer's forward of the same tokens. Prints one JSON line.

    .venv/bin/python benchmarks/moe_check.py [--model DIR] [--layers 4 --steps 3 --prompts 8 --samples 4 --tokens 64]
    .venv/bin/python benchmarks/moe_check.py --tiny      # the tiny gpt-oss of the family matrix, on CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.local_stack import LocalStack


def build_gpt_oss_20b_shaped(directory: Path, layers: int) -> str:
    """gpt-oss-20b's layer shapes with `layers` layers and random bf16 weights (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    from treadle.testing.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = GptOssConfig(
        num_hidden_layers=layers,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=len(tokenizer),
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def datum(tokens: list[int], prompt_len: int, sampled_logprobs: list[float], advantage: float) -> Datum:
    n = len(tokens) - 1
    mask = np.zeros(n, dtype=np.float32)
    mask[prompt_len - 1 :] = 1.0
    logprobs = np.zeros(n, dtype=np.float32)
    logprobs[prompt_len - 1 :] = sampled_logprobs
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs, "advantages": mask * advantage},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local MoE checkpoint directory (default: build gpt-oss-20b-shaped)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the built model (gpt-oss-20b has 24)")
    parser.add_argument("--tiny", action="store_true", help="the family matrix's tiny gpt-oss instead (CPU smoke)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="treadle-moe-") as tmp:
        started = time.monotonic()
        if args.model:
            model_dir = args.model
        elif args.tiny:
            from treadle.testing.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "model", arch="gpt_oss", initializer_range=0.2)
        else:
            model_dir = build_gpt_oss_20b_shaped(Path(tmp) / "model", args.layers)
        built_s = time.monotonic() - started
        stack = LocalStack([f"moe={model_dir}"], home=str(Path(tmp) / "stack"))
        stack.start(wait_for_workers=900)
        try:
            result = run(stack, args)
        finally:
            stack.stop()
    result["model_prepare_s"] = round(built_s, 1)
    print(json.dumps(result))


def run(stack: LocalStack, args) -> dict:
    client = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    training = client.create_lora_training_client("moe", rank=args.rank, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 500, 16).tolist() for _ in range(args.prompts)]
    sample_s, train_s, sampled_tokens, trained_tokens, gaps = [], [], 0, 0, []
    for step in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client(f"step-{step}")
        t0 = time.monotonic()
        futures = [
            sampler.sample(
                ModelInput.from_ints(p), args.samples, SamplingParams(max_tokens=args.tokens, seed=step * 100 + i)
            )
            for i, p in enumerate(prompts)
        ]
        groups = [f.result(timeout=1800) for f in futures]
        sample_s.append(time.monotonic() - t0)
        sampled_tokens += sum(len(s.tokens) for g in groups for s in g.sequences)
        t0 = time.monotonic()
        pending = []
        for prompt, group in zip(prompts, groups):
            rewards = np.array([len(set(s.tokens)) for s in group.sequences], dtype=np.float32)  # any signal will do
            advantages = rewards - rewards.mean()
            data = [
                datum(prompt + s.tokens, len(prompt), s.logprobs, float(a)) for s, a in zip(group.sequences, advantages)
            ]
            trained_tokens += sum(len(d.model_input.to_ints()) for d in data)
            pending.append(training.forward_backward(data, "importance_sampling"))
        pending.append(training.optim_step(AdamParams(learning_rate=1e-5)))
        for future in pending:
            future.result(timeout=1800)
        train_s.append(time.monotonic() - t0)
    # Sampler vs trainer: a fresh snapshot's samples against the trainer's forward of the same tokens.
    sampler = training.save_weights_and_get_sampling_client("final")
    for i, prompt in enumerate(prompts[:4]):
        group = sampler.sample(ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=args.tokens, seed=i)).result(
            timeout=1800
        )
        for seq in group.sequences:
            tokens = prompt + seq.tokens
            forward = training.forward(
                [
                    Datum(
                        model_input=ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
                    )
                ],
                "cross_entropy",
            ).result(timeout=1800)
            trained = forward.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
            gaps.extend(np.abs(trained - np.asarray(seq.logprobs)).tolist())
    return {
        "steps": args.steps,
        "rows_per_step": args.prompts * args.samples,
        "max_tokens": args.tokens,
        "sample_tokens_per_s": round(sampled_tokens / sum(sample_s), 1),
        "train_tokens_per_s": round(trained_tokens / sum(train_s), 1),
        "step_s": [round(a + b, 2) for a, b in zip(sample_s, train_s)],
        "sampler_vs_trainer_logprob_max": round(max(gaps), 4),
        "sampler_vs_trainer_logprob_mean": round(float(np.mean(gaps)), 5),
    }


if __name__ == "__main__":
    main()
