"""Peak memory of forward_backward on one long datum: the plain path against checkpointed layers and chunked logits.

One datum of `--tokens` tokens (seeded random ids; cross_entropy, every weight 1) runs through
`Engine.forward_backward` on SmolLM2-135M-Instruct in fp32 with a LoRA adapter of rank 32 on every linear
layer. Two settings, each in a fresh process of its own so that neither inherits the other's heap:

- `plain`: no activation checkpointing, and the output projection over all positions at once (one chunk): the
  memory of the path without either technique;
- `long`: every decoder layer checkpointed and the logits in chunks (the worker's defaults for a datum longer
  than its 4,096-token budget).

The peak is that of the tensors forward_backward holds alive at once beyond what was alive before it (the
weights, the adapter, after a short op has run), from torch's profiler (`treadle/testing/memory.py` says why not tracemalloc). The
process's resident high-water mark over the op (VmHWM after a reset, less the resident set before) is printed
beside it: it also counts malloc's slack and the profiler's own records. The loss and the adapter's gradients of
the two settings are compared (relative differences; the gradients as |a - b| / |b| over all of the adapter's).

    .venv/bin/python benchmarks/long_sequence.py [--tokens 8192] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SETTINGS = {"plain": ("off", False), "long": ("on", True)}  # name -> (activation_checkpointing, chunked logits)


def resident_bytes(field: str) -> int:
    """`field` of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def child(args) -> None:
    """One setting in this process: the op's peaks, its loss, and the gradients (saved to `args.out`)."""
    import ctypes
    import gc

    import numpy as np
    import torch

    from treadle.gpu_worker.engine import Engine
    from treadle.testing.memory import peak_tensor_bytes
    from treadle.types import Datum, LoraConfig, ModelInput, TensorData

    torch.set_num_threads(args.threads)
    checkpointing, chunked = SETTINGS[args.child]
    engine = Engine(args.model_dir, dtype="float32", activation_checkpointing=checkpointing)
    if not chunked:
        engine.memory_plan.chunk = args.tokens
    engine.create_session("s", LoraConfig(rank=32, seed=0))
    ids = np.random.default_rng(0).integers(0, engine.vocab_size, args.tokens + 1)

    def datum(length: int) -> Datum:
        return Datum(
            model_input=ModelInput.from_ints(ids[:length].tolist()),
            loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(ids[1 : length + 1]),
                "weights": TensorData.from_numpy(np.ones(length, dtype=np.float32)),
            },
        )

    # A short op first: it touches every weight (mapped from the file, resident only once read) and makes the
    # gradients' tensors, so the figures below are the long op's own.
    engine.forward_backward("s", [datum(16)], "cross_entropy")
    for p in engine.trainable_parameters("s").values():
        p.grad = None
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = resident_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the resident set now
    started = time.perf_counter()
    with engine.device:  # the profiler records its own thread: run the op where the engine computes
        result, peak = engine.device.run(
            peak_tensor_bytes, lambda: engine.forward_backward("s", [datum(args.tokens)], "cross_entropy")
        )
    seconds = time.perf_counter() - started
    grads = {name: p.grad.numpy() for name, p in engine.trainable_parameters("s").items() if p.grad is not None}
    np.savez(args.out, **grads)
    report = dict(peak=peak, rss=resident_bytes("VmHWM") - before, loss=result.metrics["loss:sum"], seconds=seconds)
    print(json.dumps(report), flush=True)


def run_setting(args, name: str, out: str) -> dict:
    command = [sys.executable, __file__, "--child", name, "--out", out, "--tokens", str(args.tokens)]
    command += ["--threads", str(args.threads), "--model_dir", args.model_dir]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model_dir", default=None, help="default: SmolLM2-135M-Instruct, prepared offline")
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from treadle.demo.model import prepare_smollm2

    args.model_dir = args.model_dir or prepare_smollm2()
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_setting(args, name, os.path.join(tmp, f"{name}.npz")) for name in SETTINGS}
        plain, long = (np.load(os.path.join(tmp, f"{name}.npz")) for name in SETTINGS)
        # Over the whole gradient (LoRA's B starts at 0, so every A's gradient is 0 at the first step).
        diff = np.sqrt(sum(float(np.sum((long[k] - plain[k]) ** 2)) for k in plain.files))
        grad_diff = diff / np.sqrt(sum(float(np.sum(plain[k] ** 2)) for k in plain.files))
    gib = 2.0**30
    print(f"one datum of {args.tokens} tokens, SmolLM2-135M-Instruct fp32, LoRA r32, {args.threads} threads")
    print("| setting | tensor peak GiB | resident peak GiB | loss | s |")
    print("|---|---|---|---|---|")
    for name, run in runs.items():
        print(
            f"| {name} | {run['peak'] / gib:.2f} | {run['rss'] / gib:.2f} | {run['loss']:.4f} | {run['seconds']:.1f} |"
        )
    p, q = runs["plain"], runs["long"]
    print(f"tensor peak long / plain: {q['peak'] / p['peak']:.3f}; resident peak: {q['rss'] / p['rss']:.3f}")
    print(f"loss relative difference {abs(q['loss'] - p['loss']) / abs(p['loss']):.1e}; gradients {grad_diff:.1e}")


if __name__ == "__main__":
    main()
