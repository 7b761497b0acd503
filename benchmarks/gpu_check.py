"""The GPU check (scripts/gpu_check.sh runs it): bf16 LoRA training and sampling on SmolLM2-135M-Instruct.

It prints, on one CUDA device:
1. training tokens/s of forward_backward + optim_step on one LoRA session (bf16), and the MFU that
   means against the device's bf16 dense peak (6 x parameters x tokens/s: the usual count, though a
   LoRA step skips the base weights' gradients, so the true share of the peak is lower). The worker's
   defaults (its micro-batch budget, TF32 for the fp32 LoRA products: treadle/gpu_worker/model/host.py)
   run beside 4096-token micro-batches and IEEE fp32 products, alternating rounds, with each one's peak memory;
2. sampling tokens/s of the HF and the vLLM backends, base model and a LoRA snapshot, same requests;
3. the largest |sampled logprob - trainer forward logprob| at T=1 for each backend (bf16), which
   must stay under --tolerance.

    .venv/bin/python benchmarks/gpu_check.py [--steps 20 --rows 64 --tokens 128] [--model DIR] [--samplers hf,vllm]
    .venv/bin/python benchmarks/gpu_check.py --model DIR --samplers ""    # training only

On a machine that reaches no hub, `--model` names a directory of SmolLM2's shapes with random weights
(benchmarks/random_weights.py; scripts/gpu_check.sh makes one). `--device cpu` is a smoke run of this script.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from treadle.demo.model import prepare_smollm2
from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.model_check import cross_entropy_datum
from treadle.gpu_worker.sampling.registry import SamplerOptions
from treadle.gpu_worker.sampling.vllm.sampler import VllmOptions
from treadle.types import AdamParams, LoraConfig, ModelInput, SamplingParams

# Dense bf16 peaks (TFLOP/s, no sparsity) by device name fragment.
BF16_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "B200": 2250.0,
    "GH200": 989.0,
}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in sorted(BF16_PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train(engine: Engine, steps: int, batch: int, length: int) -> float:
    """Training tokens/s over `steps` steps (after one warm-up step)."""
    rng = np.random.default_rng(0)
    data = [cross_entropy_datum(rng.integers(100, 20000, size=length).tolist()) for _ in range(batch)]
    engine.forward_backward("s", data, "cross_entropy")
    engine.optim_step("s", AdamParams(learning_rate=1e-4))
    synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.forward_backward("s", data, "cross_entropy")
        engine.optim_step("s", AdamParams(learning_rate=1e-4))
    synchronize()
    return steps * batch * (length - 1) / (time.perf_counter() - started)


def compare_training(engine: Engine, steps: int, batch: int, length: int, rounds: int = 2) -> float:
    """Training tokens/s of each setting of (micro-batch tokens, fp32 matmul precision), the worker's defaults
    last, alternating rounds of steps/rounds steps; prints each median, its ratio to 4096 tokens in IEEE fp32 and
    its peak memory. Returns the defaults' rate. On a CPU only the budget changes (TF32 is CUDA's)."""
    cuda = engine._host.device.type == "cuda"
    budget, precision = engine.max_tokens_per_microbatch, torch.backends.cuda.matmul.fp32_precision
    settings = [(4096, "none"), (budget, "none"), (4096, "tf32"), (budget, precision)] if cuda else [(4096, "none")]
    settings = list(dict.fromkeys(settings))  # on a budget of 4096 the pairs repeat
    rates: dict[tuple, list[float]] = {s: [] for s in settings}
    peaks: dict[tuple, int] = {}
    for _ in range(rounds):
        for setting in settings:
            engine.max_tokens_per_microbatch = setting[0]
            if cuda:
                torch.backends.cuda.matmul.fp32_precision = setting[1]
                torch.cuda.reset_peak_memory_stats()
            rates[setting].append(train(engine, max(1, steps // rounds), batch, length))
            peaks[setting] = torch.cuda.max_memory_allocated() if cuda else 0
    base = float(np.median(rates[settings[0]]))
    for (tokens, fp32), rate in rates.items():
        default = " (the worker's default)" if (tokens, fp32) == (budget, precision) else ""
        print(
            f"  {tokens:>6} tokens a micro-batch, fp32 matmuls {'TF32' if fp32 == 'tf32' else 'IEEE'}: "
            f"{np.median(rate):,.0f} tokens/s, {np.median(rate) / base:.2f}x"
            + (f", peak memory {peaks[tokens, fp32] / 2**30:.1f} GiB" if cuda else "")
            + default,
            flush=True,
        )
    engine.max_tokens_per_microbatch = budget
    if cuda:
        torch.backends.cuda.matmul.fp32_precision = precision
    return float(np.median(rates[settings[-1]]))


def sample_rate(engine: Engine, sampler: str | None, prompts: list[list[int]], samples: int, tokens: int) -> float:
    """Tokens/s of every prompt's request submitted at once (after a small warm-up)."""
    params = lambda i: SamplingParams(max_tokens=tokens, seed=i)  # noqa: E731
    engine.samplers.sample(sampler, ModelInput.from_ints(prompts[0]), 2, SamplingParams(max_tokens=8, seed=0))
    started = time.perf_counter()
    futures = [
        engine.samplers.sample_async(sampler, ModelInput.from_ints(p), samples, params(i))
        for i, p in enumerate(prompts)
    ]
    count = sum(len(s.tokens) for f in futures for s in f.result(timeout=600).sequences)
    return count / (time.perf_counter() - started)


def logprob_gap(engine: Engine, sampler: str, prompt: list[int]) -> float:
    """Largest |sampled - trainer forward| logprob at T=1 over a few samples of the snapshot of session s."""
    worst = 0.0
    for seq in engine.samplers.sample(
        sampler, ModelInput.from_ints(prompt), 4, SamplingParams(max_tokens=32, seed=1)
    ).sequences:
        tokens = prompt + seq.tokens
        expected = (
            engine.forward("s", [cross_entropy_datum(tokens)], "cross_entropy")
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
        worst = max(worst, float(np.abs(np.asarray(seq.logprobs) - expected[len(prompt) - 1 :]).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="measured training steps")
    parser.add_argument("--batch", type=int, default=16, help="sequences per training step")
    parser.add_argument("--length", type=int, default=1024, help="tokens per training sequence")
    parser.add_argument("--rows", type=int, default=64, help="sampled rows (8 prompts x rows/8 samples)")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens per sampled row")
    parser.add_argument("--tolerance", type=float, default=0.15, help="largest allowed logprob gap in bf16")
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct, prepared offline)")
    parser.add_argument("--samplers", default="hf,vllm", help="sampler backends to measure, comma-separated")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run of this script)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    model_dir = args.model or prepare_smollm2()
    prompts = [[1, 9690, 198, *range(300 + 10 * i, 316 + 10 * i)] for i in range(8)]
    failed = []
    for kind in args.samplers.split(","):
        t0 = time.perf_counter()
        engine = Engine(
            model_dir,
            device=args.device,
            dtype="bfloat16",
            sampler=kind or "hf",
            sampler_options=SamplerOptions(vllm=VllmOptions(gpu_memory_share=0.3)),
        )
        print(f"[{kind or 'training only'}] engine up in {time.perf_counter() - t0:.0f} s on {name}", flush=True)
        engine.create_session("s", LoraConfig(rank=32, alpha=32, seed=0))
        if kind in ("hf", ""):
            rate = compare_training(engine, args.steps, args.batch, args.length)
            params = sum(p.numel() for p in engine._host.model.parameters())
            peak = peak_tflops(name)
            mfu = f"{6 * params * rate / (peak * 1e12):.1%} of {peak:.0f} TFLOP/s" if peak else "n/a (unknown peak)"
            print(
                f"training: {rate:,.0f} tokens/s (bf16, LoRA r32, {args.batch} x {args.length} tokens/step), MFU {mfu}",
                flush=True,
            )
        else:
            train(engine, 2, 4, 128)  # the snapshot below is of a trained adapter here too
        if not kind:  # training only
            engine.close()
            continue
        engine.snapshot_sampler("s", "snap")
        base = sample_rate(engine, None, prompts, args.rows // len(prompts), args.tokens)
        lora = sample_rate(engine, "snap", prompts, args.rows // len(prompts), args.tokens)
        gap = logprob_gap(engine, "snap", prompts[0])
        print(
            f"sampling [{kind}]: base {base:,.0f} tokens/s, LoRA {lora:,.0f} tokens/s "
            f"({args.rows} rows x {args.tokens} tokens); max |sampled - trainer| logprob {gap:.3f}",
            flush=True,
        )
        if kind == "hf" and args.device == "cuda":  # the LoRA products in IEEE fp32 beside the default's
            precision = torch.backends.cuda.matmul.fp32_precision
            rates: dict[str, list[float]] = {precision: [lora], "ieee": []}
            for setting in ["ieee", precision, "ieee"]:
                torch.backends.cuda.matmul.fp32_precision = setting
                rates[setting].append(sample_rate(engine, "snap", prompts, args.rows // len(prompts), args.tokens))
            torch.backends.cuda.matmul.fp32_precision = precision
            ratio = np.median(rates[precision]) / np.median(rates["ieee"])
            print(f"  LoRA sampling, fp32 matmuls {precision} / IEEE: {ratio:.2f}x (two rounds each)", flush=True)
        if gap > args.tolerance:
            failed.append(f"{kind}: logprob gap {gap:.3f} > {args.tolerance}")
        engine.close()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if failed:
        raise SystemExit("gpu_check FAILED: " + "; ".join(failed))
    print("gpu_check passed")


if __name__ == "__main__":
    main()
