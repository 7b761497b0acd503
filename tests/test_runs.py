"""Batch runs on the real local stack: `treadle runs ...` and `treadle runner` as subprocesses configured
by TREADLE_BROKER_URL / TREADLE_STORAGE_URL, as docs/runs.md says; commands really killed."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
import redis
import yaml

from treadle.cli import UpConfig, build_parser
from treadle.config import config_from_args
from treadle.local_stack import LocalStack
from treadle.runs.records import RunRecord, RunSpec, RunStore
from treadle.runs.runner import RunnerConfig, live_runners
from treadle.storage import CheckpointStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Short poll and flush intervals and a short lease, so that adoption and log streaming happen within seconds. The
# lease is renewed every third of it: 6 s leaves a renewal 4 s of slack on a loaded CI machine, where a runner that
# misses it gives up the run (kills its command) and the tests below would see a run they did not kill restart.
RUNNER_ARGS = ["--poll_s", "0.1", "--lease_ttl_s", "6", "--log_flush_s", "0.2", "--stop_grace_s", "5"]


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll)


@pytest.fixture()
def env(stack):
    return {
        **os.environ,
        "TREADLE_BROKER_URL": stack.broker_url,
        "TREADLE_STORAGE_URL": stack.storage_url,
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture()
def store(stack):
    return RunStore(redis.Redis.from_url(stack.broker_url))


@pytest.fixture()
def runners(stack):
    """Start runners (`treadle runner`) by id; each is SIGTERMed (and reaped) when the test ends."""
    started: list[subprocess.Popen] = []

    def start(runner_id: str) -> subprocess.Popen:
        proc = stack.start_runner(["--runner_id", runner_id, *RUNNER_ARGS])  # as `treadle up` starts its runner
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        proc.wait(timeout=60)


def treadle(env, *args, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def submit(env, name: str, *command: str, options: tuple[str, ...] = ()) -> str:
    out = treadle(env, "runs", "submit", "--name", name, *options, "--", *command).stdout
    assert out.splitlines()[0] == name
    return name


def status(env, name: str) -> RunRecord:
    return RunRecord.model_validate_json(treadle(env, "runs", "status", name, "--json").stdout)


def finished(store: RunStore, name: str) -> RunRecord | None:
    record = store.get(name)
    return record if record.finished else None


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_compose_runs_one_runner_that_shuts_down_gracefully():
    with open(os.path.join(REPO, "compose.yaml")) as f:
        compose = yaml.safe_load(f)
    runner = compose["services"]["runner"]
    ns = build_parser().parse_args(runner["command"])
    assert ns.func.__name__ == "cmd_runner"
    assert (
        runner["environment"]["TREADLE_BROKER_URL"]
        == compose["services"]["worker"]["environment"]["TREADLE_BROKER_URL"]
    )
    assert runner["restart"] == "unless-stopped" and "redis" in runner["depends_on"]
    # compose's SIGKILL must come after the runner's own SIGTERM-to-SIGKILL grace: runs are released, not orphaned
    assert int(runner["stop_grace_period"].rstrip("s")) > RunnerConfig().stop_grace_s


def test_a_runner_that_lost_its_lease_can_no_longer_write_the_run(stack):
    """Fencing: after the lease expired and another runner claimed the run, the first one's writes are refused."""
    store = RunStore(redis.Redis.from_url(stack.broker_url), ttl_ms=300)
    name = unique("fenced")
    store.submit(RunSpec(name=name, command=["true"], cwd="/"))
    first = store.claim(name, "r-old")
    assert first is not None and store.claim(name, "r-new") is None  # held: nobody else gets it
    assert store.update(name, store.token("r-old", first), state="running", pid=123)
    wait_for(lambda: store.lease_holder(name) is None, 60, "the lease to expire")
    second = store.claim(name, "r-new")
    assert second == first + 1
    assert not store.update(name, store.token("r-old", first), state="failed", message="stale")
    assert store.renew({name: store.token("r-old", first)}) == {name}
    assert store.renew({name: store.token("r-new", second)}) == set()
    assert store.update(name, store.token("r-new", second), release=True, state="succeeded")
    record = store.get(name)
    assert (record.status.state, record.status.pid, record.status.epoch) == ("succeeded", 123, second)
    assert name not in store.open_names() and store.lease_holder(name) is None


def test_stop_of_a_run_that_no_runner_holds_stops_it_at_once(env, store):
    out = treadle(env, "runs", "submit", "--name", (name := unique("idle")), "--", "sleep", "300")
    assert "no runner is alive" in out.stderr
    assert treadle(env, "runs", "stop", name, "--wait_s", "10").stdout.strip() == f"{name}: stopped"
    record = store.get(name)
    assert record.status.attempt == 0 and record.status.stop_requested  # it never started


def test_a_stack_with_a_runner_runs_a_submitted_command_and_stops_it_with_the_stack(tmp_path):
    """`treadle up` starts one runner by default; LocalStack(runners=1) starts it and stops it with the stack."""
    ns = build_parser().parse_args(["up", "--model", "m"])
    assert config_from_args(UpConfig, ns).runners == 1
    with LocalStack([], home=str(tmp_path / "home"), workers=0, runners=1) as small:
        runner = small.runners[0]
        wait_for(lambda: live_runners(redis.Redis.from_url(small.broker_url)), 60, "the runner to announce itself")
        env = {**small.env(), "OMP_NUM_THREADS": "1"}
        name = submit(env, unique("hello"), sys.executable, "-c", "print('hello from', __import__('os').getcwd())")
        store = RunStore(redis.Redis.from_url(small.broker_url))
        wait_for(lambda: finished(store, name), 60, "the run to finish")
        assert store.get(name).status.state == "succeeded"
        assert f"hello from {REPO}" in treadle(env, "runs", "logs", name).stdout  # it ran in the submitter's cwd
    assert runner.poll() is not None


# ------------------------------------------------------------------------ restart policy and logs
def test_a_failing_command_restarts_with_its_resume_args_then_fails_with_its_last_lines(env, store, runners):
    runners("r-fail")
    script = "import os, sys; print('attempt', os.environ['TREADLE_RUN_ATTEMPT'], sys.argv[1:]); print('boom', file=sys.stderr); sys.exit(3)"
    name = submit(
        env,
        unique("fails"),
        sys.executable,
        "-c",
        script,
        options=("--max_restarts", "2", "--backoff_s", "0.05", "--resume_args=--again --from-last"),
    )
    record = wait_for(lambda: finished(store, name), 60, "the run to fail")
    shown = status(env, name)
    assert shown.status.state == "failed" and shown.status.restarts == 2 and shown.status.attempt == 3
    assert shown.status.last_exit_code == 3
    assert shown.status.last_lines[-2:] == ["attempt 3 ['--again', '--from-last']", "boom"]
    assert record.status.message == "exit code 3 after 2 restarts (max_restarts=2)"
    human = treadle(env, "runs", "status", name).stdout
    assert "state:       failed" in human and "boom" in human
    log = treadle(env, "runs", "logs", name).stdout
    # the first start as submitted; every restart with the declared resume arguments
    assert [line for line in log.splitlines() if line.startswith("attempt")] == [
        "attempt 1 []",
        "attempt 2 ['--again', '--from-last']",
        "attempt 3 ['--again', '--from-last']",
    ]
    listed = treadle(env, "runs", "list").stdout
    assert any(line.split()[:3] == [name, "failed", "2/2"] for line in listed.splitlines())


def test_submit_rejects_bad_input_naming_the_field_and_the_limit(env):
    done = treadle(env, "runs", "submit", "--max_restarts", "-1", "--", "true", check=False)
    assert done.returncode != 0 and "--max_restarts -1" in done.stderr and "greater than or equal to 0" in done.stderr
    done = treadle(env, "runs", "submit", "--name", "a/b", "--", "true", check=False)
    assert done.returncode != 0 and "name 'a/b' must not contain '/'" in done.stderr
    done = treadle(env, "runs", "status", "no-such-run", check=False)
    assert done.returncode != 0 and "no batch run named 'no-such-run'" in done.stderr


def _read_lines(pipe, into: queue.Queue) -> None:
    for line in pipe:
        into.put(line.rstrip("\n"))
    into.put(None)


def test_logs_follow_streams_while_the_run_is_live(env, store, runners, tmp_path):
    runners("r-follow")
    go = tmp_path / "go"
    script = (
        "import os, sys, time\nfor i in range(3): print('tick', i, flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\nprint('done', flush=True)"
    )
    name = submit(env, unique("follow"), sys.executable, "-c", script)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "treadle.cli",
            "runs",
            "logs",
            name,
            "--follow",
            "--poll_s",
            "0.1",
            "--timeout_s",
            "120",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(follower.stdout, lines), daemon=True).start()
    try:
        seen = []
        while "tick 2" not in seen:
            seen.append(lines.get(timeout=60))
        # the output arrived while the command is still running: it waits for `go`
        assert store.get(name).status.state == "running" and follower.poll() is None
        go.touch()
        while seen[-1] is not None:
            seen.append(lines.get(timeout=60))
        assert follower.wait(timeout=60) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
    assert seen[-2] == "done" and store.get(name).status.state == "succeeded"


# ------------------------------------------------------------------------ a loop that stalls
STALLING_LOOP = """
import json, os, sys, threading
from treadle import AdamParams, Datum, ModelInput, ServiceClient

# A loop in a recipe's shape: steps of forward_backward and optim_step, a checkpoint after each in its log_dir's
# checkpoints.jsonl, `--resume` from the last one. Its first attempt hangs after step 2, as a loop stuck in a wait.
log_dir, steps = sys.argv[1], 4
checkpoints = os.path.join(log_dir, "checkpoints.jsonl")
sc = ServiceClient()
if "--resume" in sys.argv:
    with open(checkpoints) as f:
        last = [json.loads(line) for line in f][-1]
    tc, start = sc.create_training_client_from_state_with_optimizer(last["state_path"]), last["step"]
    print("resuming from step", start, flush=True)
else:
    os.makedirs(log_dir, exist_ok=True)
    tc, start = sc.create_lora_training_client("tiny", rank=4, seed=0), 0
datum = Datum(model_input=ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3})
for step in range(start + 1, steps + 1):
    tc.forward_backward([datum], "cross_entropy")
    optimizer_steps = int(tc.optim_step(AdamParams(learning_rate=1e-3)).result().metrics["step:max"])
    path = tc.save_state(f"step-{step}").result().path
    with open(checkpoints, "a") as f:
        f.write(json.dumps({"step": step, "state_path": path}) + "\\n")
    print("step", step, "optimizer steps", optimizer_steps, flush=True)
    if step == 2 and os.environ["TREADLE_RUN_ATTEMPT"] == "1":
        threading.Event().wait()
"""


def test_a_loop_that_stalls_is_restarted_from_its_last_checkpoint(env, store, runners, tmp_path):
    runners("r-stall")
    script, log_dir = tmp_path / "loop.py", tmp_path / "logs"
    script.write_text(STALLING_LOOP)
    name = submit(
        env,
        unique("stalls"),
        sys.executable,
        str(script),
        str(log_dir),
        options=("--stall_s", "3", "--backoff_s", "0.1", "--resume_args=--resume", "--log_dir", str(log_dir)),
    )
    record = wait_for(lambda: finished(store, name), 240, "the stalled run to finish")
    log = treadle(env, "runs", "logs", name).stdout
    assert (record.status.state, record.status.restarts, record.status.attempt) == ("succeeded", 1, 2), log
    # The runner said why it stopped the first attempt; the second resumed from its checkpoint and went on from there.
    assert "no op answered for" in log and "(stall_s=3): stopping attempt 1" in log
    assert "resuming from step 2" in log
    assert [line for line in log.splitlines() if line.startswith("step")] == [
        f"step {n} optimizer steps {n}" for n in (1, 2, 3, 4)
    ]
    assert [c["step"] for c in record.status.checkpoints] == [1, 2, 3, 4]


# ------------------------------------------------------------------------ runner shutdown, adoption, stop
def _group(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_runner_shutdown_leaves_the_run_adoptable_and_stop_kills_the_whole_group(env, store, runners):
    first = runners("r-first")
    name = submit(env, unique("sleeper"), "sh", "-c", "echo start $TREADLE_RUN_ATTEMPT; sleep 300 & sleep 301 & wait")
    record = wait_for(
        lambda: (r := store.get(name)).status.state == "running" and r.status.pid and r, 60, "the first start"
    )
    procs = wait_for(lambda: len(group := _group(record.status.pid)) == 3 and group, 60, "sh and its two sleeps")

    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs), (
        "orphans after runner shutdown"
    )
    record = store.get(name)
    assert record.status.state == "running" and store.lease_holder(name) is None  # released, not finished

    runners("r-second")
    record = wait_for(lambda: (r := store.get(name)).status.attempt == 2 and r.status.pid and r, 60, "adoption")
    assert record.status.runner == "r-second" and record.status.adoptions == 1 and record.status.restarts == 0
    procs = wait_for(lambda: len(group := _group(record.status.pid)) == 3 and group, 60, "the second start")

    out = treadle(env, "runs", "stop", name, "--wait_s", "30").stdout
    assert out.strip() == f"{name}: stopped"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs), "orphans after stop"
    log = treadle(env, "runs", "logs", name).stdout
    assert "start 1" in log and "start 2" in log


# ------------------------------------------------------------------------ acceptance: math_rl survives kills
RL_STEPS = 21
RL_ARGS = [
    "--base_model",
    "tiny",
    "--max_operand",
    "3",
    "--max_tokens",
    "3",
    "--format_reward",
    "0.5",
    "--learning_rate",
    "3e-3",
    "--lora_rank",
    "4",
    "--groups_per_batch",
    "2",
    "--group_size",
    "4",
    "--eval_problems",
    "2",
    "--eval_every",
    "0",
    "--steps",
    str(RL_STEPS),
    "--save_every",
    "3",
    "--seed",
    "0",
]


def _last_step(log_dir) -> int:
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return -1
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return rows[-1]["step"] if rows else -1


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _final_state(stack, log_dir, tmp_path) -> tuple[int, dict[str, bytes]]:
    """The optimizer steps applied by the final checkpoint (its manifest), and its weights and optimizer bytes."""
    path = _rows(os.path.join(log_dir, "checkpoints.jsonl"))[-1]["state_path"]
    local = tmp_path / uuid.uuid4().hex
    manifest = CheckpointStore.from_url(stack.storage_url).load(path, str(local))
    files = {name: (local / name).read_bytes() for name in ("adapter_model.safetensors", "optimizer.safetensors")}
    return manifest.step, files


def test_math_rl_run_survives_three_loop_kills_and_a_runner_kill_bit_identically(
    stack, env, store, runners, tmp_path, request
):
    # Seeded by the test's name: every run kills at the same steps and delays, so a failure reruns as it was.
    chooser = random.Random(request.node.name)
    # the steps after which to kill: the loop, the loop, the runner, the loop (3 apart: each attempt gets going)
    kill_at = [chooser.randint(2, 4), chooser.randint(7, 9), chooser.randint(12, 14), chooser.randint(17, 19)]
    print("kill points (steps):", kill_at)
    by_id = {rid: runners(rid) for rid in ("r-a", "r-b")}
    recipe = [sys.executable, "-m", "treadle.recipes.math_rl", *RL_ARGS]
    killed_dir, fresh_dir = tmp_path / "killed", tmp_path / "fresh"
    name = submit(
        env, unique("rl"), *recipe, "--log_dir", str(killed_dir), options=("--max_restarts", "5", "--backoff_s", "0.2")
    )
    # the uninterrupted reference runs beside it, outside the runners (killing a runner must not touch it)
    with open(tmp_path / "reference.log", "w") as out:
        reference = subprocess.Popen(
            [*recipe, "--log_dir", str(fresh_dir)], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )

    for attempt, step in enumerate(kill_at, start=1):
        record = wait_for(
            lambda: (r := store.get(name)).status.attempt == attempt and r.status.pid and r, 120, f"attempt {attempt}"
        )
        wait_for(lambda: _last_step(killed_dir) >= step, 300, f"step {step}", poll=0.02)
        time.sleep(chooser.uniform(0, 0.3))
        if attempt == 3:  # the runner that supervises the run: the loop dies with it, the other runner adopts
            by_id[record.status.runner].send_signal(signal.SIGKILL)
        else:
            try:
                os.kill(record.status.pid, signal.SIGKILL)
            except ProcessLookupError:  # its runner reaped it: it exited on its own, or the runner gave it up
                log = treadle(env, "runs", "logs", name, check=False).stdout
                pytest.fail(f"attempt {attempt} ended before the kill: {store.get(name).status}\n{log[-3000:]}")

    done = wait_for(lambda: finished(store, name), 600, "the killed run to finish")
    assert reference.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    shown = status(env, name)
    assert (shown.status.state, shown.status.restarts, shown.status.adoptions, shown.status.attempt) == (
        "succeeded",
        3,
        1,
        5,
    )
    assert done.status.last_exit_code == 0
    assert shown.status.last_metrics["step"] == RL_STEPS
    assert shown.status.checkpoints[-1]["step"] == RL_STEPS

    rows = _rows(killed_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(RL_STEPS + 1))  # one row per step, none repeated, none missing
    used = [r["problem_index"] for r in _rows(killed_dir / "rollouts.jsonl")]
    assert sorted(used) == list(range(RL_STEPS * 2))  # every problem trained on exactly once
    # Every loop step ends in one optimizer step (one with nothing to train leaves the weights as they are), so
    # the final state has applied exactly RL_STEPS: none repeated by a resume, none lost.
    steps, state = _final_state(stack, killed_dir, tmp_path)
    ref_steps, ref_state = _final_state(stack, fresh_dir, tmp_path)
    assert steps == ref_steps == RL_STEPS
    assert state == ref_state  # weights and Adam moments bit-identical to the uninterrupted run
    log = treadle(env, "runs", "logs", name).stdout
    assert log.count("resuming from") >= 3 and "attempt 5:" in log
