"""`treadle status`: what it reads from Redis (registries, queues, metering) and the command itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from treadle.metering import Meter, OpUsage
from treadle.queue import names
from treadle.queue.sessions import SessionRecord, SessionRegistry
from treadle.queue.workers import ServedModel, WorkerAnnouncement, WorkerRegistry
from treadle.status import collect_status, queue_depth, render
from treadle.types import FullConfig


def test_queue_depth_counts_every_priority_list(redis_client):
    redis_client.rpush("treadle.m.tiny", b"a", b"b")
    redis_client.rpush("treadle.m.tiny\x06\x163", b"c")
    assert queue_depth(redis_client, "treadle.m.tiny") == 3
    assert queue_depth(redis_client, "treadle.m.other") == 0


def test_status_of_a_dead_worker_queued_ops_and_usage(redis_client):
    WorkerRegistry(redis_client).announce(
        WorkerAnnouncement(
            hostname="w-live@h",
            pid=42,
            started_at=time.time() - 120,
            sessions=["s-other"],
            models=[ServedModel(name="tiny", path="/m", max_seq_len=64, vocab_size=100)],
        )
    )
    sessions = SessionRegistry(redis_client)
    sessions.create(
        SessionRecord(
            session_id="s-1",
            run_id="r-1",
            base_model="tiny",
            owner="alice",
            worker="w-gone@h",
            applied=2,
            step=1,
            checkpoint="treadle://r-1/weights/auto-2",
            checkpoint_seq=2,
            full=FullConfig(),  # a full fine-tuning session: status shows it by its memory
            memory_bytes=3 * 2**30,
        )
    )
    sessions.create(SessionRecord(session_id="s-old", run_id="r-2", base_model="tiny", status="stopped"))
    redis_client.hset(names.session_key("s-1"), "next_seq", 5)
    redis_client.rpush(names.session_queue("s-1"), b"m3", b"m4", b"m5")
    Meter(redis_client).record(OpUsage(session_id="s-1", op_id="2", op="optim_step", owner="alice", compute_s=0.1))
    Meter(redis_client).record(
        OpUsage(session_id="s-1", op_id="2", op="optim_step", owner="alice", compute_s=0.1)
    )  # a replay
    Meter(redis_client).record(
        OpUsage(
            session_id="s-1", op_id="1", op="forward_backward", owner="alice", trained_tokens=30, at=time.time() - 5
        )
    )

    report = collect_status(redis_client)
    workers = {w.hostname: w for w in report.workers}
    assert workers["w-live@h"].alive and workers["w-live@h"].models == ["tiny"]
    assert not workers["w-gone@h"].alive  # named by an active session, no heartbeat
    [s] = report.sessions  # the stopped one is left out
    assert (s.owner, s.applied, s.step, s.submitted, s.queued_ops, s.last_op) == ("alice", 2, 1, 5, 3, "optim_step")
    assert s.usage.trained_tokens == 30 and s.last_checkpoint == "treadle://r-1/weights/auto-2"
    assert {q.queue: q.depth for q in report.queues} == {"treadle.m.tiny": 0, "treadle.s.s-1": 3}
    assert "s-old" in {s.session_id for s in collect_status(redis_client, include_stopped=True).sessions}
    text = render(report)
    assert "w-gone@h  NO" in text and "treadle://r-1/weights/auto-2 (seq 2)" in text
    header, row = next(
        lines for lines in zip(text.splitlines(), text.splitlines()[1:]) if lines[0].startswith("SESSION")
    )
    assert row.split()[header.split().index("STEP")] == "1"
    assert (s.kind, s.memory_bytes) == ("full", 3 * 2**30)
    assert row.split()[header.split().index("KIND")] == "full" and "3072MiB" in row.split()


def test_treadle_status_json_on_the_live_stack(stack, service_client):
    from treadle import types as rt

    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    ids = [5, 6, 7, 8, 9]
    datum = rt.Datum(
        model_input=rt.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 4}
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result(timeout=120)
        tc.optim_step(rt.AdamParams(learning_rate=1e-3)).result(timeout=60)
    env = {**os.environ, "TREADLE_BROKER_URL": stack.broker_url}
    out = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    mine = next(s for s in report["sessions"] if s["session_id"] == tc.session_id)
    assert mine["applied"] >= 6 and mine["queued_ops"] == 0 and mine["owner"] is None
    assert mine["step"] == 3  # three optim_steps
    # A session created from its checkpoint goes on from step 3, before it runs any op.
    resumed = service_client.create_training_client_from_state(tc.save_state("s3").result(timeout=60).path)
    out = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert next(s for s in json.loads(out.stdout)["sessions"] if s["session_id"] == resumed.session_id)["step"] == 3
    # A worker's announcement (its sessions) is refreshed every heartbeat, so a just-created session may be
    # missing from the first report: read it again until it is there (a liveness bound: each read starts a process).
    deadline = time.monotonic() + 120
    while True:
        worker = next(w for w in report["workers"] if w["hostname"] == mine["worker"])
        if tc.session_id in worker["sessions"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        report = json.loads(
            subprocess.run(
                [sys.executable, "-m", "treadle.cli", "status", "--json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
        )
    assert worker["alive"] and "tiny" in worker["models"] and tc.session_id in worker["sessions"]
    assert worker["memory"]["rss"] > 0
    tc.stop()
