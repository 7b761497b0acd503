"""Failover time: from SIGKILL of a session's worker to that session's ops flowing again.

Starts a local stack with two workers, trains a session, kills the owner at a point where some ops
lie after the last automatic checkpoint, and splits the outage into: waiting for the lease to expire
(and the survivor's next caretaker pass), loading the last checkpoint, replaying the journal, and
the first op's round trip.

    .venv/bin/python benchmarks/recovery.py [--model DIR] [--lease_ttl_s 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.local_stack import LocalStack
from treadle.testing.tiny_model import build_tiny_model


def batch(step: int, length: int) -> list[Datum]:
    toks = [(step * 11 + j * 5) % 240 + 5 for j in range(length + 1)]
    return [
        Datum(
            model_input=ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * length},
        )
    ]


def owner_pid(sc: ServiceClient, session_id: str) -> int:
    hostname = sc.ops.session_info(session_id).worker
    return next(w.pid for w in sc.ops.workers.live_workers() if w.hostname == hostname)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model dir (default: a tiny random Llama)")
    parser.add_argument("--lease_ttl_s", type=float, default=5.0)
    parser.add_argument("--checkpoint_every", type=int, default=10)
    parser.add_argument("--steps_after_checkpoint", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(f"{tmp}/tiny", arch="llama", seed=0)
        stack = LocalStack(
            [f"m={model}"],
            home=f"{tmp}/stack",
            workers=2,
            worker_args=["--lease_ttl_s", str(args.lease_ttl_s), "--checkpoint_every", str(args.checkpoint_every)],
        )
        with stack:
            sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
            tc = sc.create_lora_training_client("m", rank=8, seed=0)
            step = 0
            for _ in range(args.rounds):
                for _ in range(args.checkpoint_every + args.steps_after_checkpoint):
                    tc.forward_backward(batch(step, args.tokens), "cross_entropy")
                    last = tc.optim_step(AdamParams())
                    step += 1
                last.result()
                time.sleep(1.0)  # let the background checkpoint upload finish
                pid = owner_pid(sc, tc.session_id)
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                proc = next(p for p in stack.workers if p.pid == pid)
                proc.wait()
                stack.workers.remove(proc)
                fut = tc.forward(batch(step, args.tokens))
                fut.result()
                t_flow = time.time()
                rec = json.loads(sc.ops.session_info(tc.session_id).last_recovery)
                started = rec["at"] - rec["total_s"]
                rows.append(
                    {
                        "lease": started - t_kill,
                        "load": rec["load_s"],
                        "replay": rec["replay_s"],
                        "ops": rec["replayed_ops"],
                        "first_op": t_flow - rec["at"],
                        "total": t_flow - t_kill,
                    }
                )
                stack.start_worker()
                stack.wait_for_workers(2, 300)
    print(
        f"\nrecovery after SIGKILL (lease TTL {args.lease_ttl_s:g} s, checkpoint every {args.checkpoint_every} steps, "
        f"{args.tokens}-token batches, {'tiny model' if args.model is None else args.model})"
    )
    print(
        f"{'round':<7}{'lease wait s':>13}{'ckpt load s':>13}{'replay s':>10}{'replayed ops':>14}{'first op s':>12}{'kill->flowing s':>17}"
    )
    for i, r in enumerate(rows):
        print(
            f"{i:<7}{r['lease']:>13.2f}{r['load']:>13.3f}{r['replay']:>10.3f}{r['ops']:>14d}{r['first_op']:>12.3f}{r['total']:>17.2f}"
        )


if __name__ == "__main__":
    main()
