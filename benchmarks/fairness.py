"""Two tenants on one worker: how much a tenant that pipelines heavy work slows another's light loop.

Tenant B runs a light training loop, one step at a time (forward_backward of 4 x 32 tokens, then
optim_step, waiting for both), with a 1 x 8-token sample request every 5 steps. Tenant A pipelines
`--heavy` forward_backwards of `--heavy_rows` (16) x 256 tokens and 16 sample requests of 16 rows x 64 tokens
without waiting. On one local stack (Redis + one worker) on the tiny random model, the benchmark measures B's
loop of `--steps` steps alone, A's burst alone, then the same loop of B started with A's burst, and prints:

- B's step and small-sample latency (p50 / p95), alone and beside A;
- B's p95 step beside A in units of A's heavy op (its median compute time on the worker);
- A's throughput (heavy ops per second of wall time) alone and beside B, and their ratio; how much longer
  A's burst took beside B, against the device time B's loop needs (what no scheduler can give A back);
- the device time the worker charged to B's loop beside A (training ops, its samples' share of the decode steps,
  the device's idle waits for B's next ops: `treadle_session_device_seconds`), and those idle waits alone
  (`treadle_anticipation_seconds`), read from the worker's metrics port;
- A's share of the wall time (the device time charged to A over the burst's wall time) alone and beside B, and
  their ratio: A's throughput beside B / alone with the speed of A's own ops taken out. This VM's speed drifts by
  a few percent between two bursts a few seconds apart, which the ratio of wall times carries and this one does
  not; with a steady machine the two agree;
- where B's loop ended in A's burst (it must run beside it);
- with `--rounds N` (default 3) the phases run N times in turn, the latencies pooled, and each round's ratios;
- with `--saturate`, a fourth phase: B loops for as long as A's burst lasts. The device is then shared by
  fair turns, and A keeps only its share, whatever the scheduler does.

Whatever the scheduler, A's burst beside B takes at least as long as alone plus the device time B's loop needs,
so A's throughput beside B / alone is at most A's burst / (A's burst + B's device time): the shorter A's heavy
ops, the lower that bound. `--heavy_rows` sets their size: the scenario is meant for heavy ops of about 200 ms,
which 48 x 256 tokens take on the dev CPU (16 x 256 take 55-70 ms).

    .venv/bin/python benchmarks/fairness.py [--heavy 200] [--heavy_rows 16] [--steps 60] [--rounds 3] [--saturate]
                                            [--json] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.local_stack import LocalStack, free_port
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


def heavy_burst(tc, sampler, heavy: int, rows: int) -> float:
    """A's burst, submitted without waiting; returns its wall time in seconds (until every result is in)."""
    started = time.perf_counter()
    prompt = ModelInput.from_ints(list(range(5, 69)))
    futures, samples, every = [], 0, max(1, heavy // 16)
    for i in range(heavy):
        futures.append(tc.forward_backward(batch(rows, 256, seed=100 + i % 8), "cross_entropy"))
        if i % every == 0 and samples < 16:
            futures.append(sampler.sample(prompt, 16, SamplingParams(max_tokens=64, seed=i)))
            samples += 1
    for future in futures:
        future.result(timeout=3600)
    return time.perf_counter() - started


def beside(
    a, a_sampler, b, b_sampler, heavy: int, rows: int, steps: int
) -> tuple[tuple[list[float], list[float]], float, float]:
    """B's loop (`steps` steps; 0: for as long as A's burst lasts) started with A's burst: (B's latencies, A's
    burst in s, when B's loop ended in s from the burst's start)."""
    stop, out = threading.Event(), {}

    def loop():
        out["b"] = light_loop(b, b_sampler, stop, steps or 1_000_000)
        out["ended"] = time.perf_counter()

    thread = threading.Thread(target=loop)
    started = time.perf_counter()
    thread.start()
    a_s = heavy_burst(a, a_sampler, heavy, rows)
    stop.set()
    thread.join()
    return out["b"], a_s, out["ended"] - started


WARM_UP_HEAVY = 8  # A's heavy ops before the rounds, left out of its median


@dataclass
class DeviceTime:
    """The worker's own counts, read from its metrics port: the device held idle waiting for a session's next op
    (all sessions), and the device time charged to A's and to B's session (their training ops, their samples'
    share of the decode steps, those idle waits)."""

    idle_s: float
    a_s: float
    b_s: float

    def __sub__(self, before: DeviceTime) -> DeviceTime:
        return DeviceTime(self.idle_s - before.idle_s, self.a_s - before.a_s, self.b_s - before.b_s)


def device_time(metrics_url: str, a_session: str, b_session: str) -> DeviceTime:
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    samples = [(family.name, sample) for family in families for sample in family.samples]
    return DeviceTime(
        idle_s=sum(
            s.value for name, s in samples if name == "treadle_anticipation_seconds" and s.name.endswith("_total")
        ),
        a_s=sum(
            s.value
            for name, s in samples
            if name == "treadle_session_device_seconds" and s.labels["session"] == a_session
        ),
        b_s=sum(
            s.value
            for name, s in samples
            if name == "treadle_session_device_seconds" and s.labels["session"] == b_session
        ),
    )


@dataclass
class Round:
    """One round's phases: B's (step, sample) latencies alone and beside A, A's burst alone and beside B (s), when
    B's loop ended in A's burst (s), the worker's device-time counts over A's burst alone and beside B, and with
    `--saturate` B's step latencies looping through A's whole burst and A's throughput then / alone."""

    alone: tuple[list[float], list[float]]
    beside: tuple[list[float], list[float]]
    a_alone_s: float
    a_beside_s: float
    b_ended_s: float
    device_alone: DeviceTime
    device: DeviceTime
    saturated: tuple[list[float], float] | None


def run(
    heavy: int, steps: int, saturate: bool, rounds: int, model_dir: str | None = None, heavy_rows: int = 16
) -> dict:
    """`rounds` rounds of the phases, one after another on one stack (this VM's speed drifts by a third within
    minutes: each round's alone and beside phases are minutes apart at most); latencies pooled over the rounds."""
    done: list[Round] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir or build_tiny_model(f"{tmp}/tiny", arch="llama", seed=0)
        port = free_port()
        metrics_url = f"http://127.0.0.1:{port}/metrics"
        with LocalStack([f"tiny={model}"], home=f"{tmp}/stack", worker_args=["--metrics_port", str(port)]) as stack:
            sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
            a = sc.create_lora_training_client("tiny", rank=8, seed=0)
            b = sc.create_lora_training_client("tiny", rank=8, seed=1)
            a_sampler = a.save_weights_and_get_sampling_client("a")
            b_sampler = b.save_weights_and_get_sampling_client("b")
            light_loop(b, b_sampler, None, 10)  # warm-up: first ops, first samples
            heavy_burst(a, a_sampler, WARM_UP_HEAVY, heavy_rows)
            for _ in range(rounds):
                alone = light_loop(b, b_sampler, None, steps)
                counts = [device_time(metrics_url, a.session_id, b.session_id)]
                a_alone_s = heavy_burst(a, a_sampler, heavy, heavy_rows)
                counts.append(device_time(metrics_url, a.session_id, b.session_id))
                together, a_beside_s, b_ended_s = beside(a, a_sampler, b, b_sampler, heavy, heavy_rows, steps)
                counts.append(device_time(metrics_url, a.session_id, b.session_id))
                saturated = None
                if saturate:
                    (step_sat, _), a_sat_s, _ = beside(a, a_sampler, b, b_sampler, heavy, heavy_rows, 0)
                    saturated = (step_sat, a_alone_s / a_sat_s)
                done.append(
                    Round(
                        alone,
                        together,
                        a_alone_s,
                        a_beside_s,
                        b_ended_s,
                        counts[1] - counts[0],
                        counts[2] - counts[1],
                        saturated,
                    )
                )
            meter = Meter(sc.ops.redis)
            heavy_ms = [o.compute_s * 1000 for o in meter.session_ops(a.session_id) if o.op == "forward_backward"]
            b_ops = meter.session_ops(b.session_id)
            b_device_ms = sum(
                statistics.median(o.compute_s * 1000 for o in b_ops if o.op == op)
                for op in ("forward_backward", "optim_step")
            )
            a.stop()
            b.stop()
    heavy_op = statistics.median(heavy_ms[WARM_UP_HEAVY:])
    b_alone = ([ms for r in done for ms in r.alone[0]], [ms for r in done for ms in r.alone[1]])
    b_beside = ([ms for r in done for ms in r.beside[0]], [ms for r in done for ms in r.beside[1]])
    a_alone_s, a_beside_s = sum(r.a_alone_s for r in done), sum(r.a_beside_s for r in done)
    figures = {
        "rounds": rounds,
        "heavy_ops": heavy,
        "heavy_rows": heavy_rows,
        "heavy_op_ms_p50": heavy_op,
        "b_step_device_ms": b_device_ms,
        "a_heavy_ops_per_s_alone": rounds * heavy / a_alone_s,
        **latencies("alone", b_alone),
        **latencies("beside_a", b_beside),
        "b_step_p95_beside_a_in_heavy_ops": pct(b_beside[0], 0.95) / heavy_op,
        "b_step_p50_beside_over_alone": pct(b_beside[0], 0.5) / pct(b_alone[0], 0.5),
        "a_heavy_ops_per_s_beside_b": rounds * heavy / a_beside_s,
        "a_throughput_beside_over_alone": a_alone_s / a_beside_s,
        "a_share_of_wall_alone": sum(r.device_alone.a_s for r in done) / a_alone_s,
        "a_share_of_wall_beside_b": sum(r.device.a_s for r in done) / a_beside_s,
        # What A must give up for B's loop to run at all: B's training ops on the device, and B's samples at most
        # their latency alone (they decode on their own when A is not sampling).
        "a_burst_longer_beside_b_s": (a_beside_s - a_alone_s) / rounds,
        "b_loop_training_device_s": steps * b_device_ms / 1000,
        "b_loop_samples_alone_s": sum(b_alone[1]) / rounds / 1000,
        "idle_for_b_s": sum(r.device.idle_s for r in done) / rounds,
        "b_loop_device_s": sum(r.device.b_s for r in done) / rounds,
        "per_round_b_p50_ratio_and_a_ratio": [
            (pct(r.beside[0], 0.5) / pct(r.alone[0], 0.5), r.a_alone_s / r.a_beside_s) for r in done
        ],
        "b_loop_ended_s_of_a_burst_s": [(r.b_ended_s, r.a_beside_s) for r in done],
    }
    saturated = [r.saturated for r in done if r.saturated is not None]
    if saturated:
        steps_sat = [ms for loop, _ in saturated for ms in loop]
        figures["saturated"] = {
            "b_steps": len(steps_sat),
            "b_step_p50_over_alone": pct(steps_sat, 0.5) / pct(b_alone[0], 0.5),
            "b_step_p95_in_heavy_ops": pct(steps_sat, 0.95) / heavy_op,
            "a_throughput_over_alone": statistics.median(ratio for _, ratio in saturated),
        }
    return figures


def latencies(where: str, loop: tuple[list[float], list[float]]) -> dict:
    step, sample = loop
    return {
        f"b_step_ms_{where}": {"p50": pct(step, 0.5), "p95": pct(step, 0.95), "n": len(step)},
        f"b_sample_ms_{where}": {"p50": pct(sample, 0.5), "p95": pct(sample, 0.95), "n": len(sample)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heavy", type=int, default=200, help="A's heavy forward_backwards per burst")
    parser.add_argument(
        "--heavy_rows", type=int, default=16, help="rows of 256 tokens in A's heavy op (48: ~200 ms on the dev CPU)"
    )
    parser.add_argument("--steps", type=int, default=60, help="B's steps, alone and beside A")
    parser.add_argument("--saturate", action="store_true", help="also: B loops for as long as A's burst lasts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the phases (latencies pooled)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--model", help="model directory (default: the tiny random Llama; its token ids are 5..249)")
    args = parser.parse_args()
    if args.heavy_rows < 1:
        parser.error(f"--heavy_rows must be at least 1, got {args.heavy_rows}")
    figures = run(args.heavy, args.steps, args.saturate, args.rounds, args.model, args.heavy_rows)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"A's heavy op ({args.heavy_rows} x 256 tokens): {figures['heavy_op_ms_p50']:.1f} ms median on the worker")
    print(f"B's step holds the device {figures['b_step_device_ms']:.1f} ms")
    for what in ("b_step_ms", "b_sample_ms"):
        alone, beside_a = figures[f"{what}_alone"], figures[f"{what}_beside_a"]
        print(
            f"B {what[2:-3]:6s} p50 / p95: alone {alone['p50']:.1f} / {alone['p95']:.1f} ms (n={alone['n']}), "
            f"beside A {beside_a['p50']:.1f} / {beside_a['p95']:.1f} ms (n={beside_a['n']})"
        )
    print(
        f"B's p95 step beside A: {figures['b_step_p95_beside_a_in_heavy_ops']:.2f} of A's heavy ops; "
        f"B's p50 step beside A / alone: {figures['b_step_p50_beside_over_alone']:.2f}x"
    )
    print(
        f"A's throughput: alone {figures['a_heavy_ops_per_s_alone']:.2f} ops/s, beside B "
        f"{figures['a_heavy_ops_per_s_beside_b']:.2f} ops/s ({figures['a_throughput_beside_over_alone']:.2f}x)"
    )
    alone_share, beside_share = figures["a_share_of_wall_alone"], figures["a_share_of_wall_beside_b"]
    print(
        f"A's share of the wall time (device time charged to A / wall): alone {alone_share:.4f}, beside B "
        f"{beside_share:.4f} ({beside_share / alone_share:.3f}x: A's throughput with its ops' speed taken out)"
    )
    print(
        f"A's burst took {figures['a_burst_longer_beside_b_s']:.2f} s longer beside B; B's loop holds the device "
        f"{figures['b_loop_training_device_s']:.2f} s for its training ops and at most "
        f"{figures['b_loop_samples_alone_s']:.2f} s for its samples (their latency alone)"
    )
    print(
        f"the worker charged B's loop beside A {figures['b_loop_device_s']:.2f} s of device time (training, samples, "
        f"idle waits); the device stood idle {figures['idle_for_b_s']:.2f} s waiting for B's next ops (anticipation)"
    )
    rounds = ", ".join(f"{b:.2f}x / {a:.2f}x" for b, a in figures["per_round_b_p50_ratio_and_a_ratio"])
    print(f"per round, B's p50 beside / alone and A's throughput beside / alone: {rounds}")
    ended = ", ".join(f"{b:.1f} of {a:.1f} s" for b, a in figures["b_loop_ended_s_of_a_burst_s"])
    print(f"B's loop ended (per round, into A's burst): {ended}")
    if "saturated" in figures:
        sat = figures["saturated"]
        print(
            f"B looping through A's burst ({sat['b_steps']} steps): B p50 / alone {sat['b_step_p50_over_alone']:.2f}x, "
            f"B p95 {sat['b_step_p95_in_heavy_ops']:.2f} heavy ops, A {sat['a_throughput_over_alone']:.2f}x alone"
        )


if __name__ == "__main__":
    main()
