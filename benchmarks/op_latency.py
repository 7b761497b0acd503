"""Queue overhead of treadle: latency of a minimal op, pipelined throughput, a tiny training step and a small sample.

Each measurement starts its own local stack (redis + one worker) on a tiny random model, so the
figures are the overhead of SDK -> Redis/Celery -> worker -> result backend -> SDK, not of the model.
The tiny step (4 datums x 32 tokens, forward_backward + optim_step) is also run on an engine in the
benchmark's own process as the baseline, alternating with the step through treadle in blocks of 10; and
on a second engine that gives every op all of torch's threads (as engines did before they ran toy-sized
ops on one thread), so that the thread sizing is not what makes treadle's ratio look good. A 1 x 8-token sample
of a LoRA snapshot (a control op: through Celery, the sampler's scheduler and the delivery thread) alternates
the same way with the same sample on an in-process engine.

    .venv/bin/python benchmarks/op_latency.py [--n 300]
    .venv/bin/python benchmarks/op_latency.py --compare /path/to/other/checkout [--rounds 3]
    .venv/bin/python benchmarks/op_latency.py --threads 1   # torch threads of the worker and the in-process step

`--compare` runs the same measurements on another checkout of treadle (for example the commit
before a change: `git worktree add /tmp/before <commit>`), interleaved round by round in one run
(the machine drifts), with that checkout first on the import path of every process it starts, and
prints both with their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.local_stack import LocalStack
from treadle.testing.tiny_model import build_tiny_model

ADAM = AdamParams(learning_rate=1e-3)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def step_batch() -> list[Datum]:
    rng = np.random.default_rng(0)
    return [
        Datum(
            model_input=ModelInput.from_ints(rng.integers(5, 250, 32).tolist()),
            loss_fn_inputs={"target_tokens": rng.integers(5, 250, 32), "weights": np.ones(32, dtype=np.float32)},
        )
        for _ in range(4)
    ]


def noop_submitter(sc: ServiceClient, session_id: str):
    """A function that publishes one noop: through the op contract, or the older dict payload."""
    try:
        from treadle.queue.ops import NoopRequest
    except ImportError:  # a checkout from before the typed op contract
        return lambda: sc.ops.submit(session_id, "noop", {})
    return lambda: sc.ops.submit(session_id, NoopRequest())


def measure(n: int) -> dict[str, float]:
    """One round of every figure, on a fresh stack. The step through treadle and the same step on an
    engine in this process alternate in blocks, so both see the same machine (on a small VM the
    in-process step alone drifts by a third between runs)."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(f"{tmp}/tiny", arch="llama", seed=0)
        inprocess_step, default_threads_step = inprocess_stepper(model), inprocess_stepper(model, sized_threads=False)
        inprocess_sample = inprocess_sampler(model)
        with LocalStack([f"tiny={model}"], home=f"{tmp}/stack") as stack:
            sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
            tc = sc.create_lora_training_client("tiny", rank=8, seed=0)
            submit_noop = noop_submitter(sc, tc.session_id)
            datum = Datum(
                model_input=ModelInput.from_ints(list(range(5, 13))),
                loss_fn_inputs={"target_tokens": list(range(6, 14)), "weights": [1.0] * 8},
            )
            batch = step_batch()

            def noop():
                sc.ops.wait(submit_noop())

            def forward():
                tc.forward([datum]).result()

            def train_step():
                tc.forward_backward(batch, "cross_entropy")
                tc.optim_step(ADAM).result()

            sampler = tc.save_weights_and_get_sampling_client("op-latency")

            def sample():
                sampler.sample(SAMPLE_PROMPT, 1, SamplingParams(max_tokens=8, seed=0)).result()

            for _ in range(20):  # warm-up, left out of the figures
                noop(), forward(), train_step(), sample(), inprocess_step(), default_threads_step(), inprocess_sample()
            for name, fn in [("noop", noop), ("forward", forward)]:
                lat = [timed(fn) for _ in range(n)]
                out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = statistics.median(lat), pct(lat, 0.99)
            out["sample_p50_ms"], out["inprocess_sample_p50_ms"] = alternated([sample, inprocess_sample], n)
            out["step_p50_ms"], out["inprocess_step_p50_ms"], out["default_threads_step_p50_ms"] = alternated(
                [train_step, inprocess_step, default_threads_step], n
            )
            t0 = time.perf_counter()
            for fid in [submit_noop() for _ in range(n)]:
                sc.ops.wait(fid)
            out["noop_pipelined_ops_s"] = n / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for future in [tc.forward([datum]) for _ in range(n)]:
                future.result()
            out["forward_pipelined_ops_s"] = n / (time.perf_counter() - t0)
            tc.stop()
    return out


# The two steps alternate in blocks, with a pause after each: steps in turn made the in-process one 1.4x
# slower (torch's idle worker threads of one process spin on the cores the other one needs).
STEP_BLOCK, QUIET_S = 10, 0.2


def alternated(fns, n: int) -> list[float]:
    """Each of `fns` timed in turn, in blocks of `STEP_BLOCK` with a pause after each: their p50s in ms."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(2, n // 50)):
        for fn, block in zip(fns, times):
            block += [timed(fn) for _ in range(STEP_BLOCK)]
            time.sleep(QUIET_S)
    return [statistics.median(block) for block in times]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def inprocess_stepper(model_dir: str, sized_threads: bool = True):
    """The same 4x32 step on an engine in this process: the limit treadle's step is compared with.
    `sized_threads=False`: with every torch thread on every op, as before the engine ran toy-sized ops on one
    thread (treadle.gpu_worker.scheduling.cpu_threads), so that the sizing cannot flatter the ratio by slowing the
    baseline."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    engine = Engine(model_dir)
    if not sized_threads and hasattr(engine, "_threads"):
        engine._threads.enabled = False
    engine.create_session("s", LoraConfig(rank=8, seed=0))
    batch = step_batch()

    def step():
        engine.forward_backward("s", batch, "cross_entropy")
        engine.optim_step("s", ADAM)

    return step


SAMPLE_PROMPT = ModelInput.from_ints(list(range(5, 13)))


def inprocess_sampler(model_dir: str):
    """The same 1 x 8-token sample of a LoRA snapshot on an engine in this process."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    engine = Engine(model_dir)
    engine.create_session("s", LoraConfig(rank=8, seed=0))
    engine.snapshot_sampler("s", "snapshot")
    return lambda: engine.samplers.sample("snapshot", SAMPLE_PROMPT, 1, SamplingParams(max_tokens=8, seed=0))


def run_child(checkout: str, n: int, threads: int | None) -> dict[str, float]:
    """One round in a fresh process whose `treadle` (and its workers') comes from `checkout`."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    if threads:  # read by torch in the child (the in-process step) and in the worker it starts
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", "--n", str(n)],
        env=env,
        cwd=os.path.abspath(checkout),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"round on {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


ROWS = [
    ("noop p50 ms", "noop_p50_ms"),
    ("noop p99 ms", "noop_p99_ms"),
    ("noop pipelined ops/s", "noop_pipelined_ops_s"),
    ("forward p50 ms", "forward_p50_ms"),
    ("forward pipelined ops/s", "forward_pipelined_ops_s"),
    ("4x32 step p50 ms", "step_p50_ms"),
    ("same step in-process p50 ms", "inprocess_step_p50_ms"),
    ("  in-process, all threads p50 ms", "default_threads_step_p50_ms"),
    ("sample 1 x 8 tokens p50 ms", "sample_p50_ms"),
    ("same sample in-process p50 ms", "inprocess_sample_p50_ms"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="ops per measurement")
    parser.add_argument("--compare", metavar="CHECKOUT", help="another checkout of treadle to measure side by side")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side (interleaved with --compare)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the worker and of the in-process step (default: torch's, one per core)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.n)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"this": here, **({"other": args.compare} if args.compare else {})}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, checkout in sides.items() if r % 2 == 0 else reversed(sides.items()):
            print(f"round {r + 1}: {side} ({checkout}) ...", file=sys.stderr, flush=True)
            results[side].append(run_child(checkout, args.n, args.threads))
    for rs in results.values():
        for x in rs:
            x["step_ratio"] = x["step_p50_ms"] / x["inprocess_step_p50_ms"]
            x["step_ratio_default_threads"] = x["step_p50_ms"] / x["default_threads_step_p50_ms"]
            x["sample_ratio"] = x["sample_p50_ms"] / x["inprocess_sample_p50_ms"]
    med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in results.items()}
    print(
        f"\nop latency through treadle (one session, {args.n} ops each, loopback Redis, 1 worker, "
        f"torch threads {args.threads or 'default'}; medians of {len(results['this'])} round(s))"
    )
    head = f"{'':<30}{'this':>12}" + (f"{'other':>12}{'this/other':>12}" if args.compare else "")
    print(head)
    for label, key in ROWS:
        line = f"{label:<30}{med['this'][key]:>12.2f}"
        if args.compare:
            line += f"{med['other'][key]:>12.2f}{med['this'][key] / med['other'][key]:>11.2f}x"
        print(line)
    for side in sides:
        rounds = ", ".join(f"{x['step_ratio']:.2f}x" for x in results[side])
        print(
            f"{side}: 4x32 step through treadle / in-process (alternating) = {med[side]['step_ratio']:.2f}x "
            f"(median of the rounds: {rounds})"
        )
        rounds = ", ".join(f"{x['step_ratio_default_threads']:.2f}x" for x in results[side])
        print(
            f"{side}: ... / in-process with all threads on every op = {med[side]['step_ratio_default_threads']:.2f}x "
            f"(median of the rounds: {rounds})"
        )
        rounds = ", ".join(f"{x['sample_ratio']:.2f}x" for x in results[side])
        print(
            f"{side}: 1 x 8 sample through treadle / in-process (alternating) = {med[side]['sample_ratio']:.2f}x "
            f"(median of the rounds: {rounds})"
        )


if __name__ == "__main__":
    main()
