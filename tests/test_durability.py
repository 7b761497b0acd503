"""Durable operations: a worker crash is invisible to the training loop (real Redis, real worker processes).

Every test compares against the same run done in-process on the engine, bitwise (CPU, one thread).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time

import pytest
import torch
from safetensors.torch import load_file

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.local_stack import LocalStack

ADAM = AdamParams(learning_rate=5e-3)
SEED = 5


def batch(step: int) -> list[Datum]:
    out = []
    for i in range(2):
        toks = [(step * 11 + i * 17 + j * 5) % 240 + 5 for j in range(17)]
        out.append(
            Datum(
                model_input=ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [0.0] * 3 + [1.0] * 13},
            )
        )
    return out


def reference(model_dir: str, steps: int, full: bool = False):
    """Losses and final adapter tensors (`full`: a full fine-tuning session's weights) of the uninterrupted run,
    in-process."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import FullConfig, LoraConfig

    torch.set_num_threads(1)
    engine = Engine(model_dir)
    engine.create_session("ref", LoraConfig(rank=8, seed=SEED), full=FullConfig() if full else None)
    losses = []
    for step in range(steps):
        losses.append(engine.forward_backward("ref", batch(step), "cross_entropy").metrics["loss:sum"])
        engine.optim_step("ref", ADAM)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("ref", tmp)
        weights = load_file(os.path.join(tmp, WEIGHTS[full]))
    return losses, weights


WEIGHTS = {False: "adapter_model.safetensors", True: "model.safetensors"}  # a full session's (tiny: one shard)


def adapter_of(sc: ServiceClient, path: str, full: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sc.create_rest_client().download(path, tmp)
        return load_file(os.path.join(tmp, WEIGHTS[full]))


def assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def owner_process(stack: LocalStack, sc: ServiceClient, session_id: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        hostname = sc.ops.session_info(session_id).worker
        for w in sc.ops.workers.live_workers():
            if w.hostname == hostname:
                for proc in stack.workers:
                    if proc.pid == w.pid and proc.poll() is None:
                        return proc
        time.sleep(0.1)
    raise AssertionError(f"no live owner for {session_id}")


def kill_owner(stack: LocalStack, sc: ServiceClient, session_id: str, replace: bool = True) -> None:
    proc = owner_process(stack, sc, session_id)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stack.workers.remove(proc)
    if replace:
        stack.start_worker()  # keep two workers, as a supervisor would


@pytest.fixture()
def make_stack(tiny_model_dir, tmp_path):
    stacks = []
    os.environ["OMP_NUM_THREADS"] = "1"

    def make(workers: int = 2, extra: list[str] | None = None, slow_op: str | None = None) -> LocalStack:
        # A slow op: its handler sleeps 2 s first, so the test can kill the worker inside it.
        command = [sys.executable, "-m", "tests.slow_worker", slow_op, "2"] if slow_op else None
        s = LocalStack(
            [f"tiny={tiny_model_dir}"],
            home=str(tmp_path / f"stack{len(stacks)}"),
            workers=workers,
            worker_args=["--lease_ttl_s", "2", "--checkpoint_every", "5", *(extra or [])],
            worker_command=command,
        )
        stacks.append(s)
        return s.start(wait_for_workers=180)

    yield make
    for s in stacks:
        s.stop()


def test_chaos_three_kills_are_invisible(make_stack, tiny_model_dir):
    steps = 40
    stack = make_stack(workers=2)
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    kill_at = sorted(random.Random(7).sample(range(3, steps - 2), 3))
    pairs = []
    for step in range(steps):
        pairs.append((tc.forward_backward(batch(step), "cross_entropy"), tc.optim_step(ADAM)))
        if step in kill_at:
            pairs[step - 1][1].result(timeout=120)  # let the run get going, then kill the owner mid-stream
            kill_owner(stack, sc, tc.session_id)
    losses = [fb.result(timeout=300).metrics["loss:sum"] for fb, _ in pairs]
    steps_seen = [opt.result(timeout=300).metrics["step:max"] for _, opt in pairs]
    assert steps_seen == list(range(1, steps + 1))  # exactly 40 optimizer steps, none repeated
    ref_losses, ref_weights = reference(tiny_model_dir, steps)
    assert losses == ref_losses
    assert_same_adapter(adapter_of(sc, tc.save_state("final").result(timeout=120).path), ref_weights)
    assert sc.ops.session_info(tc.session_id).epoch == 4  # created once, taken over three times


def test_full_session_survives_two_kills_bit_for_bit(make_stack, tiny_model_dir):
    steps = 30
    stack = make_stack(workers=2)
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_full_training_client("tiny")
    pairs, prompt = [], ModelInput.from_ints(batch(0)[0].model_input.to_ints())
    for step in range(steps):
        pairs.append((tc.forward_backward(batch(step), "cross_entropy"), tc.optim_step(ADAM)))
        if step == 3:
            sampler = tc.save_weights_and_get_sampling_client("early")
            early = sampler.compute_logprobs(prompt).result(timeout=120)
        if step in (8, 21):  # past an automatic checkpoint (every 5 steps), and with ops after it to replay
            pairs[step - 1][1].result(timeout=120)
            kill_owner(stack, sc, tc.session_id, replace=step == 21)  # the other worker adopts; then a new one
    losses = [fb.result(timeout=300).metrics["loss:sum"] for fb, _ in pairs]
    assert [opt.result(timeout=300).metrics["step:max"] for _, opt in pairs] == list(range(1, steps + 1))
    ref_losses, ref_weights = reference(tiny_model_dir, steps, full=True)
    assert losses == ref_losses
    assert_same_adapter(adapter_of(sc, tc.save_state("final").result(timeout=120).path, full=True), ref_weights)
    assert sc.ops.session_info(tc.session_id).epoch == 3  # created once, taken over twice
    # The snapshot, loaded from the store by a worker that never held it, answers as it did.
    assert sc.create_sampling_client(sampler.model_path).compute_logprobs(prompt).result(timeout=120) == early


@pytest.mark.parametrize("op", ["forward_backward", "optim_step", "save_state"])
def test_kill_during_an_op_recovers(make_stack, tiny_model_dir, op):
    stack = make_stack(workers=2, slow_op=op)
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    fb0 = tc.forward_backward(batch(0), "cross_entropy")
    opt0 = tc.optim_step(ADAM)
    save = tc.save_state("mid") if op == "save_state" else None
    time.sleep(1.0 if op == "forward_backward" else 3.5 if op == "optim_step" else 5.5)  # inside the slow op
    kill_owner(stack, sc, tc.session_id, replace=False)
    fb1 = tc.forward_backward(batch(1), "cross_entropy")
    opt1 = tc.optim_step(ADAM)
    ref_losses, ref_weights = reference(tiny_model_dir, 2)
    assert [fb0.result(timeout=120).metrics["loss:sum"], fb1.result(timeout=120).metrics["loss:sum"]] == ref_losses
    assert [opt0.result().metrics["step:max"], opt1.result().metrics["step:max"]] == [1, 2]
    if save is not None:
        _, ref_one = reference(tiny_model_dir, 1)
        assert_same_adapter(adapter_of(sc, save.result(timeout=60).path), ref_one)
    assert_same_adapter(adapter_of(sc, tc.save_state("end").result(timeout=120).path), ref_weights)


def test_redis_restart_mid_run_loses_nothing(make_stack, tiny_model_dir):
    steps = 12
    stack = make_stack(workers=1)
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    pairs = []
    for step in range(steps):
        pairs.append((tc.forward_backward(batch(step), "cross_entropy"), tc.optim_step(ADAM)))
        if step == 5:
            pairs[4][1].result(timeout=60)
            stack.stop_redis()  # SIGTERM: Redis flushes its AOF
            time.sleep(1.0)
            stack.start_redis()
    losses = [fb.result(timeout=300).metrics["loss:sum"] for fb, _ in pairs]
    assert [opt.result(timeout=300).metrics["step:max"] for _, opt in pairs] == list(range(1, steps + 1))
    ref_losses, ref_weights = reference(tiny_model_dir, steps)
    assert losses == ref_losses
    assert_same_adapter(adapter_of(sc, tc.save_state("final").result(timeout=120).path), ref_weights)


def test_idle_session_is_unloaded_and_reloads(make_stack, tiny_model_dir):
    stack = make_stack(workers=1, extra=["--idle_unload_s", "2"])
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    losses = []
    for step in range(2):
        losses.append(tc.forward_backward(batch(step), "cross_entropy").result(timeout=60).metrics["loss:sum"])
        tc.optim_step(ADAM).result(timeout=60)
    deadline = time.monotonic() + 60
    while not any(tc.session_id in w.unloaded for w in sc.ops.workers.live_workers()):
        assert time.monotonic() < deadline, "the idle session was never unloaded"
        time.sleep(0.5)
    for step in range(2, 4):
        losses.append(tc.forward_backward(batch(step), "cross_entropy").result(timeout=60).metrics["loss:sum"])
        tc.optim_step(ADAM).result(timeout=60)
    ref_losses, ref_weights = reference(tiny_model_dir, 4)
    assert losses == ref_losses
    assert_same_adapter(adapter_of(sc, tc.save_state("final").result(timeout=60).path), ref_weights)


def test_single_worker_restarted_by_a_supervisor_adopts_its_sessions(make_stack, tiny_model_dir):
    stack = make_stack(workers=1)
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    pairs = [(tc.forward_backward(batch(s), "cross_entropy"), tc.optim_step(ADAM)) for s in range(3)]
    pairs[-1][1].result(timeout=60)
    kill_owner(stack, sc, tc.session_id, replace=False)
    pairs += [(tc.forward_backward(batch(s), "cross_entropy"), tc.optim_step(ADAM)) for s in range(3, 6)]
    stack.start_worker()  # what compose's `restart: unless-stopped` does
    losses = [fb.result(timeout=300).metrics["loss:sum"] for fb, _ in pairs]
    assert [opt.result(timeout=60).metrics["step:max"] for _, opt in pairs] == list(range(1, 7))
    assert losses == reference(tiny_model_dir, 6)[0]


def test_an_op_handed_to_an_owner_that_died_waiting_runs_after_adoption(make_stack, tiny_model_dir):
    """The hand-off's crash case (treadle.gpu_worker.scheduling.linger): the owner dies while it waits for the next op,
    so its idle key outlives it and the next op goes onto a dead worker's wake list, ringing nothing; the worker
    that adopts the session runs it from the journal, and the run equals the uninterrupted one."""
    import uuid

    from treadle.queue import names
    from treadle.queue.ops import OptimStepRequest

    stack = make_stack(extra=["--linger_ms", "8000"])
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    fb = tc.forward_backward(batch(0), "cross_entropy")
    fb.result(timeout=60)  # the owner now waits for the next op, for up to 8 s
    kill_owner(stack, sc, tc.session_id, replace=False)
    seq, needs_doorbell = sc.ops.journal.append(
        tc.session_id, OptimStepRequest.build(adam_params=ADAM), token=uuid.uuid4().hex
    )
    assert not needs_doorbell  # handed to the dead owner
    assert sc.ops.wait(names.future_id(tc.session_id, seq), timeout=120)["metrics"]["step:max"] == 1
    second = tc.forward_backward(batch(1), "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert [fb.result().metrics["loss:sum"], second] == reference(tiny_model_dir, 2)[0]
    tc.stop()


def test_a_loop_without_optimizer_steps_is_checkpointed_and_a_crash_loses_nothing(make_stack, tiny_model_dir):
    """Forward_backwards and no optimizer step: only `--checkpoint_journal_ops` checkpoints the session. The
    checkpoint holds the gradients accumulated so far, the journal is trimmed to it, and a crash after it loses
    none of them."""
    from treadle.gpu_worker.engine import Engine
    from treadle.queue.journal import Journal
    from treadle.types import LoraConfig

    accumulated = 10
    stack = make_stack(workers=2, extra=["--checkpoint_journal_ops", "4"])
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    losses = [
        tc.forward_backward(batch(step), "cross_entropy").result(timeout=120).metrics["loss:sum"]
        for step in range(accumulated)
    ]
    deadline = time.monotonic() + 120
    while (covered := sc.ops.session_info(tc.session_id).checkpoint_seq) < accumulated - 2:
        assert time.monotonic() < deadline, f"no checkpoint past seq {covered}"
        time.sleep(0.2)
    left = Journal(sc.ops.redis).seqs(tc.session_id)
    assert left and min(left) > covered and len(left) < 4  # trimmed to the checkpoint, not holding every op
    kill_owner(stack, sc, tc.session_id)
    assert tc.optim_step(ADAM).result(timeout=120).metrics["step:max"] == 1

    torch.set_num_threads(1)
    engine = Engine(tiny_model_dir)
    engine.create_session("ref", LoraConfig(rank=8, seed=SEED))
    ref_losses = [
        engine.forward_backward("ref", batch(step), "cross_entropy").metrics["loss:sum"] for step in range(accumulated)
    ]
    engine.optim_step("ref", ADAM)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("ref", tmp)
        ref_weights = load_file(os.path.join(tmp, "adapter_model.safetensors"))
    assert losses == ref_losses
    assert_same_adapter(adapter_of(sc, tc.save_state("end").result(timeout=120).path), ref_weights)
    assert sc.ops.session_info(tc.session_id).epoch == 2  # taken over once


def test_an_owner_that_loses_its_lease_inside_an_op_hands_it_over_and_the_loop_sees_nothing(make_stack, tiny_model_dir):
    """A worker starved or paused past its lease's TTL while an op runs (its checkpoint write is fenced): the op is
    run again by the session's next owner, and its client gets that result, not an error."""
    from treadle.queue import names

    stack = make_stack(workers=1, slow_op="save_state")
    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    tc.forward_backward(batch(0), "cross_entropy")
    tc.optim_step(ADAM).result(timeout=120)
    save = tc.save_state("mid")  # its handler sleeps 2 s before writing: the lease is taken inside it
    redis = sc.ops.redis
    time.sleep(0.5)  # inside the slow handler (were it not yet, the op's turn would see the lease gone: same end)
    epoch = redis.hincrby(names.session_key(tc.session_id), "epoch", 1)  # another holder takes it for 3 s
    redis.set(names.lease_key(tc.session_id), f"elsewhere:{epoch}", px=3000)
    _, ref_one = reference(tiny_model_dir, 1)
    assert_same_adapter(adapter_of(sc, save.result(timeout=120).path), ref_one)
    fb1 = tc.forward_backward(batch(1), "cross_entropy")
    tc.optim_step(ADAM)
    ref_losses, ref_weights = reference(tiny_model_dir, 2)
    assert fb1.result(timeout=120).metrics["loss:sum"] == ref_losses[1]
    assert_same_adapter(adapter_of(sc, tc.save_state("end").result(timeout=120).path), ref_weights)
    record = sc.ops.session_info(tc.session_id)
    assert record.epoch == epoch + 1  # adopted after the other holder's lease ended
    assert record.crashes == 0  # its owner was alive: no death counted against the op (--max_request_crashes)
