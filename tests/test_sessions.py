"""Sessions over Celery + Redis: the SDK, per-session queues, the sticky worker (real Redis, real workers)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.errors import BrokerUnavailableError, InvalidRequestError, NoWorkerError, UnknownModelError
from treadle.local_stack import LocalStack
from treadle.queue import names

ADAM = AdamParams(learning_rate=5e-3)


def sft_batch(offset: int, n: int = 2, length: int = 24) -> list[Datum]:
    out = []
    for i in range(n):
        toks = [(offset * 7 + i * 13 + j * 3) % 250 + 5 for j in range(length + 1)]
        weights = [0.0] * 4 + [1.0] * (length - 4)  # a masked prompt
        out.append(
            Datum(
                model_input=ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": weights},
            )
        )
    return out


def engine_losses(model_dir: str, batches, seed: int) -> list[float]:
    """The same run in-process on the engine: the reference the queue path must equal bitwise."""
    import torch

    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    torch.set_num_threads(1)
    engine = Engine(model_dir)
    engine.create_session("ref", LoraConfig(rank=8, seed=seed))
    losses = []
    for batch in batches:
        losses.append(engine.forward_backward("ref", batch, "cross_entropy").metrics["loss:sum"])
        engine.optim_step("ref", ADAM)
    return losses


def test_sft_through_sdk_lowers_loss_and_equals_engine(service_client, tiny_model_dir):
    tc = service_client.create_lora_training_client("tiny", rank=8, seed=3)
    batches = [sft_batch(0)] * 20
    futures = []
    for batch in batches:
        futures.append(tc.forward_backward(batch, "cross_entropy"))
        tc.optim_step(ADAM)
    losses = [f.result(timeout=120).metrics["loss:sum"] for f in futures]
    assert losses[-1] < 0.7 * losses[0]
    assert losses == engine_losses(tiny_model_dir, batches, seed=3)  # bitwise on CPU
    tc.stop()


def test_pipelined_ops_resolve_in_order(service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    pairs = [
        (tc.forward_backward(sft_batch(i, n=1, length=8), "cross_entropy"), tc.optim_step(ADAM)) for i in range(50)
    ]
    for step, (fb, opt) in enumerate(pairs):
        assert fb.result(timeout=120).metrics["step:max"] == step  # ran before its optim_step
        assert opt.result(timeout=120).metrics["step:max"] == step + 1
    tc.stop()


def test_duplicate_delivery_runs_once(service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    ops = service_client.ops
    tc.forward_backward(sft_batch(1), "cross_entropy").result(timeout=60)
    optim = tc.optim_step(ADAM)
    assert optim.result(timeout=60).metrics["step:max"] == 1
    # Ring the optim_step's doorbell again, as Redis would after a redelivery.
    _, seq = names.split_future_id(optim.id)
    ops.ring(tc.session_id, seq, "optim_step")
    after = tc.forward(sft_batch(1), "cross_entropy").result(timeout=60)
    assert after.metrics["step:max"] == 1  # not 2: the duplicate did not step again
    assert tc.future(optim.id).result(timeout=60).metrics == optim.result().metrics
    tc.stop()


def test_a_submit_whose_reply_is_lost_journals_the_op_once(service_client):
    """The append ran in Redis but its answer never came back (a dropped connection): the retry gets the
    same seq, so the op is neither journaled twice (it would run twice) nor left with a gap behind it."""
    import redis

    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    ops = service_client.ops
    real, lost = ops.journal._append, []

    def reply_lost_once(**kwargs):
        answer = real(**kwargs)
        if not lost:
            lost.append(answer)
            raise redis.ConnectionError("reply lost")
        return answer

    ops.journal._append = reply_lost_once
    try:
        fb = tc.forward_backward(sft_batch(1), "cross_entropy")
    finally:
        ops.journal._append = real
    _, seq = names.split_future_id(fb.id)
    assert [answer[0] for answer in lost] == [seq]
    assert ops.journal.seqs(tc.session_id).count(seq) == 1 and ops.next_seq(tc.session_id) == seq
    optim = tc.optim_step(ADAM)
    assert names.split_future_id(optim.id)[1] == seq + 1
    assert optim.result(timeout=60).metrics["step:max"] == 1  # the op after it ran: no gap stalled the session
    tc.stop()


def _worker_log(stack) -> str:
    with open(f"{stack.home}/logs/worker-0.log", errors="replace") as f:
        return f.read()


def test_an_op_behind_one_not_yet_applied_rings_no_doorbell_and_still_runs(service_client, stack):
    """The write that marks op s-1 applied also reads op s, so only an op whose predecessor is applied needs a
    message; a burst longer than the drain's read-ahead bound is finished by the doorbell the drain rings itself."""
    import uuid

    from treadle.gpu_worker.scheduling.linger import KEY_SLACK_MS
    from treadle.gpu_worker.executor.turn_scheduler import READ_AHEAD_OPS
    from treadle.gpu_worker.worker_config import WorkerConfig
    from treadle.queue.ops import NoopRequest

    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    ops, sid = service_client.ops, tc.session_id
    burst = [ops.journal.append(sid, NoopRequest(), token=uuid.uuid4().hex) for _ in range(READ_AHEAD_OPS + 4)]
    first = burst[0][0]
    assert burst == [(first, True)] + [(first + i, False) for i in range(1, len(burst))]
    ops.ring(sid, first, "noop")  # the burst's one message
    for seq, _ in burst:
        assert ops.wait(names.future_id(sid, seq), timeout=60) == {"op": "noop"}
    # The worker waits a moment for a next op (tests/test_handoff.py); once that is over, it is idle.
    time.sleep(WorkerConfig.model_fields["linger_ms"].default / 1000 + KEY_SLACK_MS / 1000)
    later = ops.journal.append(sid, NoopRequest(), token=uuid.uuid4().hex)
    assert later == (first + len(burst), True)  # the worker went idle: the next op rings
    ops.ring(sid, later[0], "noop")
    ops.wait(names.future_id(sid, later[0]), timeout=60)
    assert f"session {sid}: op" not in _worker_log(stack)  # no op waited for the caretaker's nudge
    tc.stop()


def test_an_op_whose_doorbell_never_comes_is_rung_by_the_caretaker(service_client, stack):
    """A backstop: an op journaled next in line with no doorbell on its way (one lost) runs after a delay."""
    import uuid

    from treadle.queue.ops import NoopRequest

    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    ops, sid = service_client.ops, tc.session_id
    seq, needs_doorbell = ops.journal.append(sid, NoopRequest(), token=uuid.uuid4().hex)
    assert needs_doorbell  # ... and it is never rung
    assert ops.wait(names.future_id(sid, seq), timeout=60) == {"op": "noop"}
    assert f"session {sid}: op {seq} was journaled with no doorbell coming" in _worker_log(stack)
    tc.stop()


def test_future_resolves_by_id_from_a_fresh_process(service_client, stack):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    fut = tc.forward_backward(sft_batch(2), "cross_entropy")
    expected = fut.result(timeout=60).metrics["loss:sum"]
    code = (
        "from treadle import ServiceClient; import sys, json;"
        f"sc = ServiceClient(broker_url={stack.broker_url!r}, storage_url={stack.storage_url!r});"
        f"print(json.dumps(sc.future({fut.id!r}).result(timeout=30).metrics))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["loss:sum"] == expected
    tc.stop()


def test_two_sessions_on_one_worker_are_independent(service_client, tiny_model_dir):
    a = service_client.create_lora_training_client("tiny", rank=8, seed=11)
    b = service_client.create_lora_training_client("tiny", rank=8, seed=12)
    batches_a = [sft_batch(3)] * 4
    batches_b = [sft_batch(9)] * 4
    fa, fb = [], []
    for xa, xb in zip(batches_a, batches_b):  # interleaved on the same worker
        fa.append(a.forward_backward(xa, "cross_entropy"))
        fb.append(b.forward_backward(xb, "cross_entropy"))
        a.optim_step(ADAM)
        b.optim_step(ADAM)
    assert [f.result(timeout=60).metrics["loss:sum"] for f in fa] == engine_losses(tiny_model_dir, batches_a, seed=11)
    assert [f.result(timeout=60).metrics["loss:sum"] for f in fb] == engine_losses(tiny_model_dir, batches_b, seed=12)
    a.stop()
    b.stop()


def test_session_on_a_second_worker_process(stack, service_client, tiny_model_dir):
    proc = stack.start_worker(["--model", f"second={tiny_model_dir}"])
    try:
        deadline = time.monotonic() + 120
        while "second" not in service_client.list_base_models():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        tc = service_client.create_lora_training_client("second", rank=8, seed=3)
        loss = tc.forward_backward(sft_batch(0), "cross_entropy").result(timeout=60).metrics["loss:sum"]
        assert loss == engine_losses(tiny_model_dir, [sft_batch(0)], seed=3)[0]
        record = service_client.ops.session_info(tc.session_id)
        workers = {w.hostname: w for w in service_client.ops.workers.live_workers()}
        assert "second" in [m.name for m in workers[record.worker].models]
        assert proc.pid == workers[record.worker].pid
        tc.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        stack.workers.remove(proc)


@pytest.mark.parametrize(
    "case, field",
    [
        ("mismatched_lengths", "weights"),
        ("unknown_loss", "loss_fn"),
        ("token_out_of_vocab", "tokens"),
        ("over_length", "model_input"),
        ("nan_advantages", "advantages"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_session_survives(service_client, case, field):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    good = sft_batch(4)
    toks = list(range(10, 30))
    loss_fn = "cross_entropy"
    if case == "mismatched_lengths":
        bad = Datum(
            model_input=ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 5},
        )
    elif case == "unknown_loss":
        bad, loss_fn = good[0], "hinge"
    elif case == "token_out_of_vocab":
        bad = Datum(
            model_input=ModelInput.from_ints([5, 6, 10**6]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
        )
    elif case == "over_length":
        long = list(range(5, 5 + 600))
        bad = Datum(
            model_input=ModelInput.from_ints([t % 250 for t in long]),
            loss_fn_inputs={"target_tokens": [t % 250 for t in long], "weights": [1.0] * 600},
        )
    else:
        n = len(toks) - 1
        bad, loss_fn = (
            Datum(
                model_input=ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "logprobs": [-1.0] * n,
                    "advantages": [math.nan] + [1.0] * (n - 1),
                },
            ),
            "importance_sampling",
        )
    before = tc.forward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    with pytest.raises(InvalidRequestError) as err:
        tc.forward_backward([bad], loss_fn).result(timeout=60)
    assert field in str(err.value)
    # The session is unchanged and trains normally afterwards.
    assert tc.forward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"] == before
    tc.forward_backward(good, "cross_entropy")
    assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1
    assert tc.forward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"] < before
    tc.stop()


def test_wrong_types_are_rejected_naming_the_field(service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    with pytest.raises(Exception) as err:
        tc.forward_backward(
            [{"model_input": ModelInput.from_ints([1, 2]), "loss_fn_inputs": {"target_tokens": ["a", "b"]}}],
            "cross_entropy",
        ).result(timeout=30)
    assert "target_tokens" in str(err.value) or "data" in str(err.value)
    with pytest.raises(Exception) as err:
        tc.optim_step(AdamParams.model_validate({"learning_rate": "fast"}))
    assert "learning_rate" in str(err.value)
    tc.stop()


def test_unknown_base_model_lists_served_models(service_client):
    with pytest.raises(UnknownModelError) as err:
        service_client.create_lora_training_client("no-such-model")
    assert "tiny" in str(err.value)


def test_no_worker_is_a_clear_error(tmp_path):
    bare = LocalStack([], home=str(tmp_path), workers=0)
    bare.start_redis()
    try:
        sc = ServiceClient(broker_url=bare.broker_url, storage_url=bare.storage_url)
        with pytest.raises(NoWorkerError) as err:
            sc.create_lora_training_client("tiny")
        assert "no worker is running" in str(err.value)
        # Refused before anything was queued, not after waiting out the no-worker grace.
        assert sc.ops.redis.llen(names.model_queue("tiny")) == 0
    finally:
        bare.stop_redis()


def test_unreachable_redis_is_a_clear_error():
    with pytest.raises(BrokerUnavailableError) as err:
        ServiceClient(broker_url="redis://127.0.0.1:1/0")
    assert "127.0.0.1:1" in str(err.value) and "cannot reach Redis" in str(err.value)
