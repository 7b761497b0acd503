"""The SDK waits its turn at a queue's bound (treadle.sdk.capacity).

Loops that pipeline far past the workers' default bounds (256 ops a session, 1024 an owner) complete, every op
in the order it was submitted and none lost; the first wait on a bound is logged once; the wait is bounded by
`capacity_wait_s` and skipped when it is 0. A queue is held at its bound, with no race against the worker, by
an op at seq 2 with seq 1 left open (as a gateway client's late first chunk): nothing runs until the test fills it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.errors import CapacityError
from treadle.queue import names
from treadle.queue.ops import NoopRequest
from treadle.sdk import APIFuture, TrainingClient

ADAM = AdamParams(learning_rate=1e-3)
# The tiniest batch: one datum of three tokens.
BATCH = [
    Datum(
        model_input=ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
    )
]
# A liveness bound for a result on a loaded machine, not a speed claim.
LIVENESS_S = 600
WAITING = "Waiting for room"


def _waits_logged(caplog, bound: str) -> int:
    return sum(
        1
        for r in caplog.records
        if r.name == "treadle.sdk" and WAITING in r.getMessage() and f"--{bound}" in r.getMessage()
    )


def _pipeline(tc: TrainingClient, ops: int) -> list[APIFuture]:
    """`ops` optim_steps, submitted without reading a result: the cheapest op a session's queue bound counts (the
    bound counts ops, whatever they are, and a step without gradients costs the worker least)."""
    return [tc.optim_step(ADAM) for _ in range(ops)]


def _assert_ran_in_order(tc: TrainingClient, futures: list[APIFuture]) -> None:
    """Each op took the session's next seq as it was submitted, and each ran once, in that order (the optimizer's
    step count goes 1, 2, 3, ...)."""
    assert [int(f.id.rpartition(":")[2]) for f in futures] == list(range(1, len(futures) + 1))
    assert [f.result(timeout=LIVENESS_S).metrics["step:max"] for f in futures] == list(range(1, len(futures) + 1))
    record = tc._ops.session_info(tc.session_id)
    assert record.applied == tc._ops.next_seq(tc.session_id) == len(futures)


def _training_client(sc: ServiceClient, seed: int = 0) -> TrainingClient:
    # No automatic checkpoints: they cost what the loop does not test.
    return sc.create_lora_training_client("tiny", rank=4, seed=seed, checkpoint_every=0)


def test_sixteen_sessions_of_one_owner_each_pipelining_160_ops_all_run_in_order(service_client, caplog):
    """The owner's 2,560 ops pass its bound of 1,024 more than twice over: each submit past it waits for room."""
    clients = [_training_client(service_client, seed) for seed in range(16)]
    with ThreadPoolExecutor(len(clients)) as pool:
        submitted = list(pool.map(lambda tc: _pipeline(tc, 160), clients))
    assert _waits_logged(caplog, "max_queued_ops_per_owner") == 1
    for tc, futures in zip(clients, submitted):
        _assert_ran_in_order(tc, futures)
        tc.stop()


async def _submit_watching_the_loop(tc: TrainingClient, ops: int, caplog) -> tuple[list[APIFuture], bool]:
    """The twins' futures, in the order the twins were started, and whether the event loop ran while a submit
    waited for room (a twin that slept on the loop's thread would hold it until the last submit returned)."""
    submits = asyncio.gather(*(tc.optim_step_async(ADAM) for _ in range(ops)))
    ran_while_waiting = False
    while not submits.done():
        ran_while_waiting = ran_while_waiting or _waits_logged(caplog, "max_queued_ops_per_session") > 0
        await asyncio.sleep(0.05)
    return list(await submits), ran_while_waiting


def test_one_session_pipelining_640_ops_through_the_async_twins_runs_them_in_order(service_client, caplog):
    """Past the session's bound of 256, each twin waits on the session's submitting thread, not the event loop."""
    tc = _training_client(service_client)
    futures, ran_while_waiting = asyncio.run(_submit_watching_the_loop(tc, 640, caplog))
    assert ran_while_waiting
    assert _waits_logged(caplog, "max_queued_ops_per_session") == 1
    _assert_ran_in_order(tc, futures)
    tc.stop()


def _held(sc: ServiceClient) -> TrainingClient:
    """A session at its bound, lowered to 1: an op at seq 2 waits for the open seq 1."""
    tc = _training_client(sc)
    sc.ops.redis.hset(names.session_key(tc.session_id), "max_queued_ops", 1)
    sc.ops.submit(tc.session_id, NoopRequest(), seq=2)
    return tc


def test_a_submit_waits_at_most_capacity_wait_s_and_raises_at_once_when_it_is_zero(stack, caplog, monkeypatch):
    patient = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url, capacity_wait_s=0.5)
    waited = _held(patient)
    with pytest.raises(CapacityError, match="max_queued_ops_per_session: .* the SDK waited 0.5 s") as refused:
        waited.forward(BATCH)
    assert refused.value.bound == "max_queued_ops_per_session" and refused.value.retry_after_s >= 1
    assert _waits_logged(caplog, "max_queued_ops_per_session") == 1

    caplog.clear()
    monkeypatch.setenv("TREADLE_CAPACITY_WAIT_S", "0")
    at_once = _held(ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url))
    with pytest.raises(CapacityError, match="max_queued_ops_per_session: ") as refused:
        at_once.forward(BATCH)
    assert "waited" not in str(refused.value)
    assert not [r for r in caplog.records if WAITING in r.getMessage()]
    with pytest.raises(ValidationError, match="capacity_wait_s"):
        ServiceClient(broker_url=stack.broker_url, capacity_wait_s=-1)

    # The refused submits queued nothing: once seq 1 fills, the held ops run and the next op takes seq 3.
    for tc in (waited, at_once):
        patient.ops.submit(tc.session_id, NoopRequest(), seq=1)
        assert patient.ops.wait(names.future_id(tc.session_id, 2), timeout=LIVENESS_S) == {"op": "noop"}
        forward = tc.forward(BATCH)
        assert forward.id == names.future_id(tc.session_id, 3)
        assert len(forward.result(timeout=LIVENESS_S).loss_fn_outputs) == 1
        tc.stop()


def test_a_sample_past_its_owners_row_bound_waits_for_the_rows_before_it(service_client, caplog):
    redis = service_client.ops.redis
    bound = redis.hget(names.LIMITS_KEY, "max_queued_sample_rows_per_owner")
    redis.hset(names.LIMITS_KEY, "max_queued_sample_rows_per_owner", 2)
    try:
        # Base-model sampling needs an adapter loaded on the worker (see tests/test_fairness.py): a session stays.
        keep = _training_client(service_client)
        sampler = service_client.create_sampling_client(base_model="tiny")
        prompt = ModelInput.from_ints([5, 6, 7, 8])
        long_run = SamplingParams(max_tokens=400, temperature=1.0, seed=0)
        first = sampler.sample(prompt, num_samples=2, sampling_params=long_run)
        second = sampler.sample(prompt, num_samples=1, sampling_params=SamplingParams(max_tokens=4, seed=0))
        assert _waits_logged(caplog, "max_queued_sample_rows_per_owner") == 1
        assert len(first.result(timeout=LIVENESS_S).sequences) == 2
        assert len(second.result(timeout=LIVENESS_S).sequences) == 1
        keep.stop()
    finally:
        redis.hset(names.LIMITS_KEY, "max_queued_sample_rows_per_owner", bound)
