"""The hand-off (treadle.gpu_worker.scheduling.linger): an op submitted while its owner waits for it rings no doorbell.

A worker of its own with a long window (8 s), so that "submitted while it waits" does not depend on how
fast this machine gets from a result to the next submit; real Redis, a real worker process. The crash
case (the owner dies while it waits) is in tests/test_durability.py.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from treadle import AdamParams, ServiceClient
from treadle.gpu_worker.scheduling.linger import KEY_SLACK_MS
from treadle.local_stack import LocalStack
from treadle.queue import names
from treadle.queue.ops import NoopRequest, OptimStepRequest
from tests.test_sessions import sft_batch

WINDOW_S = 8.0
ADAM = AdamParams(learning_rate=5e-3)
# A liveness bound (a broken test must not hang), not a speed claim: a loaded machine stays far below it.
LIVENESS_S = 120


@pytest.fixture(scope="module")
def lingering(tiny_model_dir, tmp_path_factory):
    os.environ["OMP_NUM_THREADS"] = "1"
    stack = LocalStack(
        [f"tiny={tiny_model_dir}"],
        home=str(tmp_path_factory.mktemp("handoff")),
        worker_args=["--lease_ttl_s", "3", "--linger_ms", str(int(WINDOW_S * 1000))],
    )
    stack.start(wait_for_workers=180)
    yield ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url), stack
    stack.stop()


def _append(sc: ServiceClient, session_id: str, request=None) -> tuple[int, bool]:
    return sc.ops.journal.append(session_id, request or NoopRequest(), token=uuid.uuid4().hex)


def _run_noop(sc: ServiceClient, session_id: str) -> None:
    """An op through the public path, whatever it needs: afterwards the worker waits for the next one."""
    seq, needs_doorbell = _append(sc, session_id)
    if needs_doorbell:
        sc.ops.ring(session_id, seq, "noop")
    assert sc.ops.wait(names.future_id(session_id, seq), timeout=60) == {"op": "noop"}


def _server_ms(sc: ServiceClient) -> int:
    seconds, micros = sc.ops.redis.time()
    return seconds * 1000 + micros // 1000


def _window_end_ms(sc: ServiceClient, worker: str) -> int:
    """When the worker's current wait would run out, on Redis's clock: its idle key's expiry, less the key's slack."""
    now, left = _server_ms(sc), sc.ops.redis.pttl(names.idle_key(worker))
    assert left > 0, "the worker is not waiting"
    return now + left - KEY_SLACK_MS


def _wait_end_ms(sc: ServiceClient, worker: str) -> int:
    """When the worker's wait ended (its idle key deleted), on Redis's clock: seen within a few milliseconds."""
    deadline = time.monotonic() + LIVENESS_S
    while sc.ops.redis.exists(names.idle_key(worker)):
        assert time.monotonic() < deadline, "the worker's wait never ended"
        time.sleep(0.005)
    return _server_ms(sc)


def _worker_log(stack: LocalStack) -> str:
    with open(f"{stack.home}/logs/worker-0.log", errors="replace") as f:
        return f.read()


def test_the_next_op_of_any_owned_session_is_handed_over_without_a_doorbell(lingering):
    sc, stack = lingering
    a = sc.create_lora_training_client("tiny", rank=4, seed=0)
    b = sc.create_lora_training_client("tiny", rank=4, seed=1)
    first, needs_doorbell = _append(sc, a.session_id)
    assert needs_doorbell  # the worker was not waiting for an op (it had just created a session)
    sc.ops.ring(a.session_id, first, "noop")
    sc.ops.wait(names.future_id(a.session_id, first), timeout=60)
    # The worker now waits for the next op of any session it owns: none of these rings, and each runs.
    second, needs_doorbell = _append(sc, a.session_id)
    assert (second, needs_doorbell) == (first + 1, False)
    assert sc.ops.wait(names.future_id(a.session_id, second), timeout=60) == {"op": "noop"}
    other, needs_doorbell = _append(sc, b.session_id)
    assert not needs_doorbell
    assert sc.ops.wait(names.future_id(b.session_id, other), timeout=60) == {"op": "noop"}
    # Training ops take the same path, and the one pipelined behind runs after it.
    fb = a.forward_backward(sft_batch(0), "cross_entropy")
    seq, _ = _append(sc, a.session_id, OptimStepRequest.build(adam_params=ADAM))
    assert fb.result(timeout=60).metrics["step:max"] == 0
    assert sc.ops.wait(names.future_id(a.session_id, seq), timeout=60)["metrics"]["step:max"] == 1
    assert "was journaled with no doorbell coming" not in _worker_log(stack)  # none waited for the caretaker
    # Past the window the worker has gone back to Celery: the next op rings again.
    time.sleep(WINDOW_S + KEY_SLACK_MS / 1000 + 0.5)
    later, needs_doorbell = _append(sc, a.session_id)
    assert needs_doorbell
    sc.ops.ring(a.session_id, later, "noop")
    assert sc.ops.wait(names.future_id(a.session_id, later), timeout=60) == {"op": "noop"}
    a.stop()
    b.stop()


def test_a_control_message_ends_the_wait(lingering):
    """A session created (a control message) while the worker waits for an op is created at once, not when the
    window ends: the waiting thread looks at the control queues every few milliseconds."""
    sc, _ = lingering
    a = sc.create_lora_training_client("tiny", rank=4, seed=0)
    _run_noop(sc, a.session_id)  # the worker now waits for up to 8 s
    worker = sc.ops.session_info(a.session_id).worker
    window_end = _window_end_ms(sc, worker)
    with ThreadPoolExecutor(max_workers=1) as creating:
        b = creating.submit(sc.create_lora_training_client, "tiny", rank=4, seed=1)
        # The wait ended when the control message came, not when its window ran out (the order of the two,
        # on Redis's clock: how long the machine then takes to create the session does not matter).
        assert _wait_end_ms(sc, worker) < window_end
        b = b.result(timeout=LIVENESS_S)
    _run_noop(sc, b.session_id)
    a.stop()
    b.stop()


def test_an_op_that_rang_while_the_worker_was_busy_is_run_from_the_journal(lingering):
    """An op submitted while no idle key is set rings; a worker that waits runs it from the journal, before
    its doorbell arrives, and the doorbell then finds it run."""
    sc, stack = lingering
    a = sc.create_lora_training_client("tiny", rank=4, seed=0)
    _run_noop(sc, a.session_id)
    sc.ops.redis.delete(names.idle_key(sc.ops.session_info(a.session_id).worker))  # as if its wait had not begun
    seq, needs_doorbell = _append(sc, a.session_id)
    assert needs_doorbell  # ... and it is not rung: the waiting worker finds it on its own
    # It runs with no doorbell at all (the caretaker's nudge would leave a line in the log, asserted below).
    assert sc.ops.wait(names.future_id(a.session_id, seq), timeout=LIVENESS_S) == {"op": "noop"}
    sc.ops.ring(a.session_id, seq, "noop")  # the doorbell, late: a repeat of an applied seq
    _run_noop(sc, a.session_id)
    assert a.forward(sft_batch(0), "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    assert "was journaled with no doorbell coming" not in _worker_log(stack)
    a.stop()


def test_a_warm_shutdown_ends_the_wait(lingering):
    """SIGTERM while the op thread waits (this module's last test: it stops the worker): the worker hands its
    sessions over and exits without waiting out the 8 s window."""
    sc, stack = lingering
    a = sc.create_lora_training_client("tiny", rank=4, seed=0)
    _run_noop(sc, a.session_id)  # the worker now waits for up to 8 s
    proc, worker = stack.workers[0], sc.ops.session_info(a.session_id).worker
    window_end = _window_end_ms(sc, worker)
    proc.send_signal(signal.SIGTERM)
    # The shutdown ended the wait before its window ran out (the order of the two, on Redis's clock; checkpointing
    # the session and exiting afterwards take what they take on this machine).
    assert _wait_end_ms(sc, worker) < window_end
    proc.wait(timeout=LIVENESS_S)
    assert f"handed over session {a.session_id}" in _worker_log(stack)
