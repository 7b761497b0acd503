"""`treadle up` and the worker's visibility: the embedded stack starts, is found, and leaves no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil

from treadle import ServiceClient
from treadle.local_stack import find_running_stack, free_port


def test_treadle_up_is_found_and_ctrl_c_leaves_no_orphans(tiny_model_dir, tmp_path):
    home = str(tmp_path / "home")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", "up", "--model", f"tiny={tiny_model_dir}", "--home", home],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        # as from a terminal: a test run started in the background (`... &`) ignores SIGINT
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 180
        while find_running_stack(home) is None:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.3)
        info = find_running_stack(home)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # redis-server and a worker
        sc = ServiceClient(broker_url=info.broker_url, storage_url=info.storage_url)
        assert sc.list_base_models() == ["tiny"]
        tc = sc.create_lora_training_client("tiny", rank=4, seed=0)
        assert tc.forward([_datum()]).result(timeout=60).metrics["loss:sum"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "treadle is up" in out
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, f"orphan {child.pid} {child.name()}"
    assert find_running_stack(home) is None


def test_flower_sees_the_worker_online(stack):
    port = free_port()
    env = {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true"}
    flower = subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", "flower", "--broker_url", stack.broker_url, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        from treadle.queue.workers import WorkerRegistry
        import redis

        hostnames = {w.hostname for w in WorkerRegistry(redis.Redis.from_url(stack.broker_url)).live_workers()}
        deadline = time.monotonic() + 90
        workers = {}
        while not (hostnames & set(workers)):
            assert time.monotonic() < deadline, f"flower never listed {hostnames}; saw {workers}"
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=10) as r:
                    workers = json.load(r)
            except OSError:
                continue
    finally:
        flower.terminate()
        flower.wait(timeout=30)


def _datum():
    from treadle import Datum, ModelInput

    return Datum(
        model_input=ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
