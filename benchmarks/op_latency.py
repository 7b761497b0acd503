"""Queue overhead of treadle: round-trip latency of a minimal op and pipelined throughput of one session.

Starts its own local stack (redis + one worker) on a tiny random model, so the figures are the
overhead of SDK -> Celery/Redis -> worker -> result backend -> SDK, not of the model.

    .venv/bin/python benchmarks/op_latency.py [--n 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from treadle import Datum, ModelInput, ServiceClient
from treadle.local_stack import LocalStack
from treadle.testing.tiny_model import build_tiny_model


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=300, help="ops per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(f"{tmp}/tiny", arch="llama", seed=0)
        with LocalStack([f"tiny={model}"], home=f"{tmp}/stack") as stack:
            sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
            tc = sc.create_lora_training_client("tiny", rank=8, seed=0)
            datum = Datum(model_input=ModelInput.from_ints(list(range(5, 13))),
                          loss_fn_inputs={"target_tokens": list(range(6, 14)), "weights": [1.0] * 8})
            ops = sc.ops

            def noop():
                return ops.wait(ops.submit(tc.session_id, "noop", {}))

            def forward():
                return tc.forward([datum]).result()

            for _ in range(20):  # warm-up, left out of the figures
                noop(), forward()
            rows = []
            for name, fn in [("noop (queue only)", noop), ("forward, 8 tokens", forward)]:
                lat = []
                for _ in range(args.n):
                    t0 = time.perf_counter()
                    fn()
                    lat.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                if name.startswith("noop"):
                    ids = [ops.submit(tc.session_id, "noop", {}) for _ in range(args.n)]
                    for i in ids:
                        ops.wait(i)
                else:
                    futs = [tc.forward([datum]) for _ in range(args.n)]
                    for f in futs:
                        f.result()
                rate = args.n / (time.perf_counter() - t0)
                rows.append((name, statistics.median(lat), pct(lat, 0.99), rate, 1000 / statistics.median(lat)))
            tc.stop()
    print(f"\nop latency through treadle (one session, {args.n} ops each, loopback Redis, 1 worker)")
    print(f"{'op':<22}{'p50 ms':>9}{'p99 ms':>9}{'pipelined ops/s':>17}{'sequential ops/s':>18}{'pipelining gain':>17}")
    for name, p50, p99, rate, seq_rate in rows:
        print(f"{name:<22}{p50:>9.2f}{p99:>9.2f}{rate:>17.1f}{seq_rate:>18.1f}{rate / seq_rate:>16.2f}x")


if __name__ == "__main__":
    main()
