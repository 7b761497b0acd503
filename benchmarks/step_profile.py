"""Where one training step and one sampling round spend their time on a CUDA device: torch.profiler over the engine.

For each of a forward_backward + optim_step of `--batch` x `--length` tokens, and a sampling round of `--rows` rows
x `--tokens` tokens (LoRA snapshot), it prints the wall time, the time the GPU was busy (kernels' total), the
number of kernels launched, and the kernels that took the most GPU time. A busy share far below 1 with many kernels means the
step is bound by launching them from Python, not by the GPU's arithmetic.

    python benchmarks/step_profile.py --model DIR [--batch 16 --length 1024 --rows 64 --tokens 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from gpu_check import synchronize  # this folder's gpu_check.py (a script's folder is on its path)
from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.model_check import cross_entropy_datum
from treadle.types import AdamParams, LoraConfig, ModelInput, SamplingParams


def report(name: str, fn) -> None:
    fn()  # warm-up
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        fn()
        synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6
    print(
        f"\n## {name}: wall {wall * 1000:.1f} ms, GPU busy {busy * 1000:.1f} ms ({busy / wall:.0%}), {len(kernels)} kernels"
    )
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time / 1000)
    for kernel, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {sum(times):8.2f} ms  {len(times):6d} x  {kernel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: a smoke run of this script
    engine = Engine(args.model, device=device, dtype="bfloat16", sampler="hf")
    engine.create_session("s", LoraConfig(rank=32, alpha=32, seed=0))
    rng = np.random.default_rng(0)
    data = [cross_entropy_datum(rng.integers(100, 20000, size=args.length).tolist()) for _ in range(args.batch)]

    def step() -> None:
        engine.forward_backward("s", data, "cross_entropy")
        engine.optim_step("s", AdamParams(learning_rate=1e-4))

    report(f"training step, {args.batch} x {args.length} tokens", step)
    engine.snapshot_sampler("s", "snap")
    prompts = [ModelInput.from_ints(rng.integers(100, 20000, size=16).tolist()) for _ in range(8)]

    def sample() -> None:
        futures = [
            engine.samplers.sample_async(
                "snap", p, args.rows // len(prompts), SamplingParams(max_tokens=args.tokens, seed=i)
            )
            for i, p in enumerate(prompts)
        ]
        for f in futures:
            f.result(timeout=600)

    report(f"sampling, {args.rows} rows x {args.tokens} tokens (LoRA)", sample)
    engine.close()


if __name__ == "__main__":
    main()
