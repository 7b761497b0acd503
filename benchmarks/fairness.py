"""Two tenants on one worker: how much a tenant that pipelines heavy work slows another's light loop.

Tenant B runs a light training loop, one step at a time (forward_backward of 4 x 32 tokens, then
optim_step, waiting for both), with a 1 x 8-token sample request every 5 steps. Tenant A pipelines
`--heavy` forward_backwards of 16 x 256 tokens and 16 sample requests of 16 rows x 64 tokens without
waiting. The benchmark measures B alone, A alone, then both together (B's loop runs for as long as A has
work queued), on one local stack (Redis + one worker) on the tiny random model, and prints:

- B's step and small-sample latency (p50 / p95), alone and beside A;
- B's p95 step beside A in units of A's heavy op (its median compute time on the worker);
- A's throughput (heavy ops per second of wall time) alone and beside B, and their ratio;
- the device time of one B step, and the share of the device B would hold were its steps beside A as quick as
  1.5x alone: B's loop runs the whole time A's burst does, so A keeps at most the rest. B's latency and A's
  throughput trade against each other; fair turns give B its ops right after the one running, no sooner.

    .venv/bin/python benchmarks/fairness.py [--heavy 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import numpy as np

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.local_stack import LocalStack
from treadle.metering import Meter
from treadle.testing.tiny_model import build_tiny_model

ADAM = AdamParams(learning_rate=1e-4)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def batch(rows: int, length: int, seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        Datum(
            model_input=ModelInput.from_ints(rng.integers(5, 250, length).tolist()),
            loss_fn_inputs={
                "target_tokens": rng.integers(5, 250, length),
                "weights": np.ones(length, dtype=np.float32),
            },
        )
        for _ in range(rows)
    ]


def light_loop(tc, sampler, stop: threading.Event | None, steps: int) -> tuple[list[float], list[float]]:
    """B's loop: `steps` steps, or until `stop` is set; (step latencies, sample latencies) in ms."""
    step_ms, sample_ms, light = [], [], batch(4, 32, seed=1)
    prompt = ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12])
    for i in range(steps):
        if stop is not None and stop.is_set():
            break
        started = time.perf_counter()
        tc.forward_backward(light, "cross_entropy")
        tc.optim_step(ADAM).result(timeout=600)
        step_ms.append((time.perf_counter() - started) * 1000)
        if i % 5 == 4:
            started = time.perf_counter()
            sampler.sample(prompt, 1, SamplingParams(max_tokens=8, seed=i)).result(timeout=600)
            sample_ms.append((time.perf_counter() - started) * 1000)
    return step_ms, sample_ms


def heavy_burst(tc, sampler, heavy: int) -> float:
    """A's burst, submitted without waiting; returns its wall time in seconds (until every result is in)."""
    started = time.perf_counter()
    prompt = ModelInput.from_ints(list(range(5, 69)))
    futures, samples, every = [], 0, max(1, heavy // 16)
    for i in range(heavy):
        futures.append(tc.forward_backward(batch(16, 256, seed=100 + i % 8), "cross_entropy"))
        if i % every == 0 and samples < 16:
            futures.append(sampler.sample(prompt, 16, SamplingParams(max_tokens=64, seed=i)))
            samples += 1
    for future in futures:
        future.result(timeout=3600)
    return time.perf_counter() - started


def run(heavy: int, alone_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(f"{tmp}/tiny", arch="llama", seed=0)
        with LocalStack([f"tiny={model}"], home=f"{tmp}/stack") as stack:
            sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
            a = sc.create_lora_training_client("tiny", rank=8, seed=0)
            b = sc.create_lora_training_client("tiny", rank=8, seed=1)
            a_sampler = a.save_weights_and_get_sampling_client("a")
            b_sampler = b.save_weights_and_get_sampling_client("b")
            light_loop(b, b_sampler, None, 10)  # warm-up: first ops, first samples
            heavy_burst(a, a_sampler, 8)

            b_alone = light_loop(b, b_sampler, None, alone_steps)
            a_alone_s = heavy_burst(a, a_sampler, heavy)
            heavy_ms = [
                o.compute_s * 1000 for o in Meter(sc.ops.redis).session_ops(a.session_id) if o.op == "forward_backward"
            ][-heavy:]

            b_ops = Meter(sc.ops.redis).session_ops(b.session_id)
            b_device_ms = sum(
                statistics.median(o.compute_s * 1000 for o in b_ops if o.op == op)
                for op in ("forward_backward", "optim_step")
            )
            stop, together = threading.Event(), {}
            loop = threading.Thread(target=lambda: together.update(b=light_loop(b, b_sampler, stop, 1_000_000)))
            loop.start()
            a_together_s = heavy_burst(a, a_sampler, heavy)
            stop.set()
            loop.join()
            a.stop()
            b.stop()
    (step_alone, sample_alone), (step_beside, sample_beside) = b_alone, together["b"]
    heavy_op = statistics.median(heavy_ms)
    return {
        "heavy_ops": heavy,
        "heavy_op_ms_p50": heavy_op,
        "b_step_ms_alone": {"p50": pct(step_alone, 0.5), "p95": pct(step_alone, 0.95), "n": len(step_alone)},
        "b_step_ms_beside_a": {"p50": pct(step_beside, 0.5), "p95": pct(step_beside, 0.95), "n": len(step_beside)},
        "b_sample_ms_alone": {"p50": pct(sample_alone, 0.5), "p95": pct(sample_alone, 0.95), "n": len(sample_alone)},
        "b_sample_ms_beside_a": {
            "p50": pct(sample_beside, 0.5),
            "p95": pct(sample_beside, 0.95),
            "n": len(sample_beside),
        },
        "b_step_device_ms": b_device_ms,
        # B at 1.5x its alone p50, one step after another, would hold the device this much of the time; A could
        # keep at most the rest of its throughput (see the module docstring)
        "b_device_share_at_1_5x_alone": b_device_ms / (1.5 * pct(step_alone, 0.5)),
        "b_step_p95_beside_a_in_heavy_ops": pct(step_beside, 0.95) / heavy_op,
        "b_step_p50_beside_over_alone": pct(step_beside, 0.5) / pct(step_alone, 0.5),
        "a_heavy_ops_per_s_alone": heavy / a_alone_s,
        "a_heavy_ops_per_s_beside_b": heavy / a_together_s,
        "a_throughput_beside_over_alone": a_alone_s / a_together_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heavy", type=int, default=200, help="A's heavy forward_backwards per burst")
    parser.add_argument("--alone_steps", type=int, default=60, help="B's steps when alone")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = run(args.heavy, args.alone_steps)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"A's heavy op (16 x 256 tokens): {figures['heavy_op_ms_p50']:.1f} ms median on the worker")
    for what in ("b_step_ms", "b_sample_ms"):
        alone, beside = figures[f"{what}_alone"], figures[f"{what}_beside_a"]
        print(
            f"B {what[2:-3]:6s} p50 / p95: alone {alone['p50']:.1f} / {alone['p95']:.1f} ms (n={alone['n']}), "
            f"beside A {beside['p50']:.1f} / {beside['p95']:.1f} ms (n={beside['n']})"
        )
    print(
        f"B's p95 step beside A: {figures['b_step_p95_beside_a_in_heavy_ops']:.2f} of A's heavy ops; "
        f"B's p50 step beside A / alone: {figures['b_step_p50_beside_over_alone']:.2f}x"
    )
    print(
        f"B's step holds the device {figures['b_step_device_ms']:.1f} ms: at 1.5x its alone p50, step after step, "
        f"{figures['b_device_share_at_1_5x_alone']:.0%} of the device, which A would lose"
    )
    print(
        f"A's throughput: alone {figures['a_heavy_ops_per_s_alone']:.2f} ops/s, beside B "
        f"{figures['a_heavy_ops_per_s_beside_b']:.2f} ops/s ({figures['a_throughput_beside_over_alone']:.2f}x)"
    )


if __name__ == "__main__":
    main()
