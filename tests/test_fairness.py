"""Many tenants on one worker: fair turns, weighted shares, bounded queues and a visible queue.

The share arithmetic (treadle.gpu_worker.scheduling.fair) is pinned on its own; everything else runs on a real worker
of its own (real Redis, the tiny model) with owner weights alice=2 and small queue bounds, so that "past
the bound" is a few dozen ops. How long an op waited is read from what the worker recorded (the meter's
start and end of every op), counted in the other tenant's ops that ran meanwhile, never against a clock.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from treadle import ServiceClient
from treadle.errors import CapacityError
from treadle.gpu_worker.scheduling.fair import FairShare
from treadle.local_stack import LocalStack
from treadle.metering import Meter
from treadle.queue import names
from treadle.queue.ops import NoopRequest
from treadle.status import collect_status, render
from treadle.types import AdamParams, LoraConfig, ModelInput, SamplingParams
from tests.test_sessions import sft_batch

SESSION_BOUND, OWNER_BOUND, ROW_BOUND = 48, 64, 8
ADAM = AdamParams(learning_rate=1e-3)


# ------------------------------------------------------------ the share arithmetic


def _serve(
    fair: FairShare, ready: dict[str, str], tokens: dict[str, int], turns: int, noise=lambda turn: 1.0
) -> dict[str, int]:
    """`turns` turns of forward_backwards of `tokens[key]` tokens at 10 us a token (times `noise(turn)`)."""
    served = dict.fromkeys(ready, 0)
    for turn in range(turns):
        key = fair.pick(ready)
        served[key] += 1
        fair.charge(key, ready[key], tokens[key] * 1e-5 * noise(turn), kind="forward_backward", units=tokens[key])
    return served


def test_owners_share_device_time_by_weight_and_sessions_share_their_owners():
    fair = FairShare({"alice": 2})
    ready = {"a1": "alice", "b1": "bob", "b2": "bob"}
    served = _serve(fair, ready, dict.fromkeys(ready, 1000), 600)
    assert served == {"a1": 400, "b1": 100, "b2": 100}


def test_identical_work_is_charged_alike_however_noisy_its_timing():
    """One op measuring 1x to 4x an identical one (a loaded host) must not tilt the shares."""
    fair = FairShare({"alice": 2})
    served = _serve(
        fair, {"a": "alice", "c": "carol"}, {"a": 1000, "c": 1000}, 300, noise=lambda turn: 1 + 3 * (turn % 7 == 0)
    )
    assert served == {"a": 200, "c": 100}


def test_a_heavy_op_counts_as_many_light_ones():
    fair = FairShare()
    served = _serve(fair, {"heavy": "x", "light": "y"}, {"heavy": 4096, "light": 128}, 33 * 4)
    assert served == {"heavy": 4, "light": 128}


def test_an_idle_tenant_banks_no_credit():
    """A tenant that rejoins after others ran alone for a while gets its share from then on, not a burst."""
    fair = FairShare()
    _serve(fair, {"busy": "x"}, {"busy": 1000}, 100)
    served = _serve(fair, {"busy": "x", "back": "y"}, {"busy": 1000, "back": 1000}, 20)
    assert served == {"busy": 10, "back": 10}


def test_a_wait_held_for_a_session_is_charged_to_it_as_it_was():
    """The device idled 30 ms for `light`'s next op (anticipation): `light` pays those 30 ms, so `heavy`, charged 20,
    goes next; the wait is no turn, so it leaves `light`'s average turn cost as it was."""
    fair = FairShare()
    ready = {"light": "o", "heavy": "o"}
    fair.charge("light", "o", 0.001, kind="forward_backward", units=10)
    fair.charge("heavy", "o", 0.02, kind="forward_backward", units=200)
    cost = fair.cost["light"]
    assert fair.pick(ready) == "light"
    fair.hold("light", "o", 0.03)
    assert fair.pick(ready) == "heavy"
    assert fair.cost["light"] == cost


def test_the_order_of_turns_estimates_each_ones_wait():
    fair = FairShare()
    for key, owner, tokens in [("a", "x", 300), ("b", "y", 100), ("c", "z", 200)]:
        fair.charge(key, owner, tokens * 1e-5, kind="forward", units=tokens)
    assert fair.order({"a": "x", "b": "y", "c": "z"}) == ["b", "c", "a"]  # least service first


# ------------------------------------------------------------ a real worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fair_stack(tiny_model_dir, tmp_path_factory):
    port = _free_port()
    stack = LocalStack(
        [f"tiny={tiny_model_dir}"],
        home=str(tmp_path_factory.mktemp("fair")),
        worker_args=[
            "--lease_ttl_s",
            "3",
            "--owner_weights",
            json.dumps({"alice": 2}),
            "--metrics_port",
            str(port),
            "--max_queued_ops_per_session",
            str(SESSION_BOUND),
            "--max_queued_ops_per_owner",
            str(OWNER_BOUND),
            "--max_queued_sample_rows_per_owner",
            str(ROW_BOUND),
            "--logprob_audit_fraction",
            "1",
            # A light loop's next step comes a few ms after its result here, but much later on a loaded CI machine.
            "--anticipate_ms",
            "500",
        ],
    )
    stack.start(wait_for_workers=180)
    yield ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url), stack, port
    stack.stop()


def _session(sc: ServiceClient, owner: str | None = None, seed: int = 0):
    return sc._create(base_model="tiny", lora=LoraConfig(rank=4, seed=seed), owner=owner)


def _spans(sc: ServiceClient, session_id: str, op: str | None = None) -> list[tuple[float, float]]:
    """(start, end) of each op the worker ran for the session, oldest first (the meter's record)."""
    return [(o.at - o.compute_s, o.at) for o in Meter(sc.ops.redis).session_ops(session_id) if op in (None, o.op)]


def _light_steps_beside(
    sc: ServiceClient, a, b, heavy: list, steps: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """A submits the `heavy` batches without waiting; B runs `steps` light steps one at a time (forward_backward of
    2 x 16 tokens, then optim_step). Once A's backlog is done: when each B step was submitted, and A's op spans."""
    futures = [a.forward_backward(batch, "cross_entropy") for batch in heavy]
    submitted = []
    for i in range(steps):
        submitted.append(time.time())
        b.forward_backward(sft_batch(100 + i, n=2, length=16), "cross_entropy")
        b.optim_step(ADAM).result(timeout=120)
    for future in futures:
        future.result(timeout=300)
    return submitted, _spans(sc, a.session_id)


def test_a_light_loop_waits_for_at_most_two_heavy_ops_of_a_tenant_that_pipelines(fair_stack):
    """Tenant A pipelines heavy forward_backwards without waiting; tenant B runs step after step of a light
    loop beside it. Each B step (its forward_backward and optim_step) waits for at most two of A's ops: the
    one running when it arrives, and one more when its second op arrives while A's next has started.
    Before fair turns a drain read up to 8 ops of A ahead before B got a turn."""
    sc, _, _ = fair_stack
    a, b = _session(sc, seed=0), _session(sc, seed=1)
    steps, a_ops = _light_steps_beside(sc, a, b, [sft_batch(i, n=8, length=96) for i in range(30)], steps=6)
    b_optims = _spans(sc, b.session_id, "optim_step")
    assert b_optims[-1][1] < a_ops[-1][0], "B's loop ran beside A's backlog, not after it"
    waited = [
        sum(1 for start, end in a_ops if start >= submitted and end <= optim_start)
        for submitted, (optim_start, _) in zip(steps, b_optims)
    ]
    assert max(waited) <= 2, waited
    a.stop()
    b.stop()


def test_a_light_loop_beside_a_pipelining_tenant_runs_its_steps_back_to_back_while_it_is_owed(fair_stack):
    """B's next step comes a moment after its result. While B is owed the device, the worker waits for that step
    (anticipation) instead of starting one of A's heavy ops, so B runs several steps per heavy op of A. Without the
    wait, each B step waited for the heavy op that had started while B's client was busy."""
    sc, _, port = fair_stack
    a, b = _session(sc, seed=0), _session(sc, seed=1)
    b.forward_backward(sft_batch(99, n=2, length=16), "cross_entropy")
    b.optim_step(ADAM).result(timeout=120)  # B's first ops: its turn costs are known
    came = 'treadle_anticipation_waits_total{base_model="tiny",outcome="op"}'
    came_before = _metric(_scrape(port), came)
    steps, a_ops = _light_steps_beside(sc, a, b, [sft_batch(i, n=16, length=128) for i in range(30)], steps=10)
    b_forwards = _spans(sc, b.session_id, "forward_backward")[-10:]
    assert b_forwards[-1][1] < a_ops[-1][0], "B's loop ran beside A's backlog, not after it"
    # A's ops that ended while a B step waited to start: one per step without anticipation
    waited = [
        sum(1 for _, end in a_ops if submitted < end <= start) for submitted, (start, _) in zip(steps, b_forwards)
    ]
    assert sum(waited) <= 5, waited
    # a step that waited for none of A's ops found the worker waiting for it: the metric counts those waits
    metrics = _scrape(port)
    assert _metric(metrics, came) - came_before >= max(1, waited.count(0) - 1)  # (the first may find A not started)
    assert _metric(metrics, 'treadle_anticipation_seconds_total{base_model="tiny"}') > 0
    a.stop()
    b.stop()


def test_a_sample_request_right_after_a_checkpointed_step_takes_none_of_the_heavy_tenants_ops(fair_stack):
    """B checkpoints after each optimizer step and samples after each step, beside A's backlog. A checkpoint takes a
    while, so the sequencer reads B's next entry afresh after it; finding none, it waits for B (anticipation), and
    B's sample request ends that wait and reaches the sampler at once. When it left that entry to be read at B's
    next turn, B had no op there (a sample is not a session op), A's next heavy op started, and each request
    waited for it."""
    sc, _, _ = fair_stack
    a = _session(sc, seed=0)
    b = sc._create(base_model="tiny", lora=LoraConfig(rank=4, seed=1), checkpoint_every=1)
    b_sampler = b.save_weights_and_get_sampling_client("after-checkpoints")
    prompt, params = ModelInput.from_ints([5, 6, 7, 8]), SamplingParams(max_tokens=2, seed=0)
    b_sampler.sample(prompt, 1, params).result(timeout=120)  # warm
    heavy = [a.forward_backward(sft_batch(i, n=16, length=128), "cross_entropy") for i in range(30)]
    heavy[1].result(timeout=300)  # A's backlog is running
    windows = []
    for i in range(6):
        b.forward_backward(sft_batch(100 + i, n=2, length=16), "cross_entropy")
        b.optim_step(ADAM).result(timeout=120)
        submitted = time.time()
        b_sampler.sample(prompt, 1, params).result(timeout=300)
        windows.append((submitted, time.time()))
    for future in heavy:
        future.result(timeout=300)
    a_ops = _spans(sc, a.session_id, "forward_backward")
    assert a_ops[-1][1] > windows[-1][1], "B's loop ran beside A's backlog, not after it"
    assert sc.ops.session_info(b.session_id).checkpoint_seq >= 6, "B's steps were not checkpointed"
    waited = [
        sum(1 for start, end in a_ops if submitted <= start and end <= answered) for submitted, answered in windows
    ]
    assert sum(waited) <= 2, waited
    a.stop()
    b.stop()


def test_a_small_sample_beside_a_heavy_training_backlog_gets_a_fair_share_of_the_device(fair_stack):
    """Tenant A pipelines heavy forward_backwards; tenant B samples 16 tokens beside them (17 forwards: a prefill
    and 16 decode steps). The device goes to the forward serving the tenant with less device time
    (treadle.gpu_worker.scheduling.device_lock), so B's forwards run several in a row between two of A's ops, as many as
    fit in the time one of A's ops took. With turns taken one for one, each of B's forwards waited for one of A's
    ops: 16 or more of them in B's sample."""
    sc, _, _ = fair_stack
    a, b = _session(sc, seed=0), _session(sc, seed=1)
    b_sampler = b.save_weights_and_get_sampling_client("small")
    prompt = ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12])
    b_sampler.sample(prompt, 1, SamplingParams(max_tokens=16, seed=0)).result(timeout=120)  # warm
    heavy = [a.forward_backward(sft_batch(i, n=8, length=96), "cross_entropy") for i in range(30)]
    heavy[1].result(timeout=300)  # A's backlog is running
    submitted = time.time()
    answer = b_sampler.sample(prompt, 1, SamplingParams(max_tokens=16, seed=1)).result(timeout=300)
    answered = time.time()
    assert len(answer.sequences[0].tokens) == 16
    for future in heavy:
        future.result(timeout=300)
    a_ops = _spans(sc, a.session_id)
    assert a_ops[-1][1] > answered, "B's sample ran beside A's backlog, not after it"
    waited = sum(1 for start, end in a_ops if start >= submitted and end <= answered)
    assert waited <= 5, f"B's 16-token sample waited for {waited} of A's ops"
    a.stop()
    b.stop()


def test_a_sample_request_reaches_the_sampler_before_the_doorbells_of_a_pipelining_tenant(fair_stack):
    """A's backlog of heavy forward_backwards is running when A sends 6 small sample requests and then B sends one.
    The sequencer's pass ends as soon as a control message waits, and rings the doorbell of the sessions it left;
    the worker takes every waiting control message before that doorbell (treadle.queue.redis_transport), so B's
    request reaches the sampler after the op that was running, and its 4 tokens take none of A's ops. With kombu's
    round robin over the queues, a doorbell went first after each control message: each of A's requests ahead of
    B's cost another of A's ops."""
    sc, _, _ = fair_stack
    a, b = _session(sc, owner="dave", seed=0), _session(sc, seed=1)
    a_sampler = a.save_weights_and_get_sampling_client("a-requests")
    b_sampler = b.save_weights_and_get_sampling_client("b-request")
    prompt, params = ModelInput.from_ints([5, 6, 7, 8]), SamplingParams(max_tokens=4, seed=0)
    b_sampler.sample(prompt, 1, params).result(timeout=120)  # warm
    heavy = [a.forward_backward(sft_batch(i, n=8, length=96), "cross_entropy") for i in range(30)]
    heavy[1].result(timeout=300)  # A's backlog is running
    a_samples = [a_sampler.sample(prompt, 1, params) for _ in range(6)]
    submitted = time.time()
    b_sampler.sample(prompt, 1, params).result(timeout=300)
    answered = time.time()
    for future in [*heavy, *a_samples]:
        future.result(timeout=300)
    a_ops = _spans(sc, a.session_id, "forward_backward")
    assert a_ops[-1][1] > answered, "B's sample ran beside A's backlog, not after it"
    waited = sum(1 for start, end in a_ops if start >= submitted and end <= answered)
    assert waited <= 2, f"B's sample request waited for {waited} of A's ops"
    a.stop()
    b.stop()


def test_two_flooding_owners_with_weights_two_to_one_get_two_to_one(fair_stack):
    sc, _, _ = fair_stack
    alice, carol = _session(sc, "alice", seed=0), _session(sc, "carol", seed=1)
    batch = sft_batch(0, n=8, length=64)
    futures = []
    for _ in range(40):
        futures += [alice.forward(batch, "cross_entropy"), carol.forward(batch, "cross_entropy")]
    both_queued = time.time()
    for future in futures:
        future.result(timeout=300)
    spans = {"alice": _spans(sc, alice.session_id, "forward"), "carol": _spans(sc, carol.session_id, "forward")}
    until = min(ops[-1][1] for ops in spans.values())  # both had ops queued from `both_queued` until one ran out
    ran = {who: sum(1 for start, end in ops if start >= both_queued and end <= until) for who, ops in spans.items()}
    assert ran["carol"] >= 10, ran
    assert ran["alice"] / ran["carol"] == pytest.approx(2.0, rel=0.10), ran
    alice.stop()
    carol.stop()


def _hold(sc: ServiceClient, session_id: str, count: int) -> None:
    """Queue `count` noops at seqs 2.. with seq 1 left open (as a gateway client whose first op is late): none
    can run, so the queue stays as long as the test makes it."""
    for seq in range(2, count + 1):
        sc.ops.submit(session_id, NoopRequest(), seq=seq)


def _raising_at_once(stack: LocalStack) -> ServiceClient:
    """A client whose submits past a bound raise at once, instead of waiting for room (tests/test_sdk_backpressure.py)."""
    return ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url, capacity_wait_s=0)


def test_past_the_bound_a_submit_fails_with_a_retry_hint_and_nothing_queued_is_lost(fair_stack):
    sc, stack, _ = fair_stack
    tc = _session(_raising_at_once(stack), "dave")
    _hold(sc, tc.session_id, SESSION_BOUND)  # seqs 2..48: the queue reaches 48 ops counting the open seq 1
    with pytest.raises(CapacityError) as refused:
        tc.forward(sft_batch(0), "cross_entropy")  # the SDK's path: seq 49
    assert "max_queued_ops_per_session" in str(refused.value) and f"limit is {SESSION_BOUND}" in str(refused.value)
    assert refused.value.retry_after_s >= 1
    with pytest.raises(CapacityError):
        sc.ops.submit(tc.session_id, NoopRequest(), seq=SESSION_BOUND + 1)  # the gateway's path
    assert sc.ops.next_seq(tc.session_id) == SESSION_BOUND  # the refused ops took nothing
    # The owner's bound counts every session of the owner: 48 queued here, so 16 more elsewhere, then no more.
    other = _session(sc, "dave", seed=1)
    _hold(sc, other.session_id, OWNER_BOUND - SESSION_BOUND)
    with pytest.raises(CapacityError, match="max_queued_ops_per_owner: owner 'dave' has 64 ops queued"):
        sc.ops.submit(other.session_id, NoopRequest(), seq=OWNER_BOUND - SESSION_BOUND + 1)
    # The open seqs fill (always accepted: refusing them would stall the session), every queued op runs, and the
    # submit that was refused goes through on its retry.
    for session in (tc, other):
        sc.ops.submit(session.session_id, NoopRequest(), seq=1)
    for session, count in ((tc, SESSION_BOUND), (other, OWNER_BOUND - SESSION_BOUND)):
        for seq in range(1, count + 1):
            assert sc.ops.wait(names.future_id(session.session_id, seq), timeout=120) == {"op": "noop"}
    assert tc.forward(sft_batch(0), "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0
    tc.stop()
    other.stop()


def _metric(text: str, series: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


def test_past_the_sample_row_bound_a_sample_request_fails_until_earlier_rows_are_answered(fair_stack):
    from treadle.types import SamplingParams

    sc, stack, _ = fair_stack
    # Base-model sampling on a worker whose last adapter was removed fails inside PEFT (its active adapter is
    # gone: a gap of treadle.gpu_worker.model.adapters, outside this test's subject), so a session stays meanwhile.
    keep = _session(sc)
    sampler = _raising_at_once(stack).create_sampling_client(base_model="tiny")
    prompt = ModelInput.from_ints([5, 6, 7, 8])
    long_run = SamplingParams(max_tokens=400, temperature=1.0, seed=0)
    first = sampler.sample(prompt, num_samples=ROW_BOUND, sampling_params=long_run)
    with pytest.raises(
        CapacityError, match=f"max_queued_sample_rows_per_owner: owner 'sdk' has {ROW_BOUND} sample rows"
    ):
        sampler.sample(prompt, num_samples=1, sampling_params=long_run)
    assert len(first.result(timeout=300).sequences) == ROW_BOUND
    assert (
        len(
            sampler.sample(prompt, num_samples=2, sampling_params=SamplingParams(max_tokens=4, seed=0))
            .result(timeout=120)
            .sequences
        )
        == 2
    )
    # Every sequence was drawn at temperature 1, so each is audited against the training forward (off the decode path).
    _, port = fair_stack[1:]
    deadline = time.monotonic() + 120
    while (count := _metric(_scrape(port), 'treadle_sampler_logprob_gap_count{base_model="tiny"}')) < ROW_BOUND + 2:
        assert time.monotonic() < deadline, f"{count} audits exported"
        time.sleep(0.2)
    assert _metric(_scrape(port), 'treadle_sampler_logprob_gap_sum{base_model="tiny"}') / count < 1e-4
    keep.stop()


def test_status_and_metrics_show_each_sessions_place_in_line_and_its_estimated_wait(fair_stack):
    """Two tenants flood the worker: while both have ops queued, status and the worker's metrics show the one
    whose turn is next at position 1 and the other at 2, waiting about one op of the first."""
    sc, _, port = fair_stack
    a, b = _session(sc, seed=0), _session(sc, seed=1)
    futures = []
    for i in range(30):  # 60 ops: within the owner bound (both are the SDK's, owner `sdk`)
        futures += [
            a.forward_backward(sft_batch(i, n=8, length=96), "cross_entropy"),
            b.forward_backward(sft_batch(i, n=8, length=96), "cross_entropy"),
        ]
    seen, metrics, text = None, None, ""
    while not futures[-1].done():
        report = collect_status(sc.ops.redis)  # what `treadle status` prints
        mine = {s.session_id: s for s in report.sessions if s.session_id in (a.session_id, b.session_id)}
        if (
            len(mine) == 2
            and all(s.queued_ops > 1 and s.op_cost_s > 0 for s in mine.values())
            and sorted(s.queue_position or 0 for s in mine.values()) == [1, 2]
        ):
            seen, metrics, text = mine, _scrape(port), render(report)
            break
        time.sleep(0.05)
    assert seen is not None, "the two backlogs ran out before status showed both in line"
    header = next(line for line in text.splitlines() if line.startswith("SESSION"))
    assert "POSITION" in header and "EST WAIT" in header and "OP COST" in header
    second = next(s for s in seen.values() if s.queue_position == 2)
    first = next(s for s in seen.values() if s.queue_position == 1)
    assert first.est_wait_s == 0 and second.est_wait_s > 0
    assert f"{second.est_wait_s:.2f}s" in next(line for line in text.splitlines() if line.startswith(second.session_id))
    assert f'treadle_session_queued_ops{{base_model="tiny",owner="sdk",session="{second.session_id}"}}' in metrics
    for future in futures:
        future.result(timeout=300)
    assert 'treadle_op_queue_seconds_count{base_model="tiny",owner="sdk"}' in _scrape(port)
    a.stop()
    b.stop()


def test_the_worker_exports_each_sessions_device_time_for_its_training_and_its_samples(fair_stack):
    """`treadle_session_device_seconds` moves with a session's training ops and with the samples of its snapshots
    (decode steps are charged to the sessions whose rows they carry), and with nothing run for another session."""
    sc, _, port = fair_stack
    trainer, sampler = _session(sc, seed=0), _session(sc, seed=1)
    snapshot = sampler.save_weights_and_get_sampling_client("device-time")
    trainer.forward_backward(sft_batch(0, n=8, length=96), "cross_entropy").result(timeout=300)

    def series(session) -> str:
        return f'treadle_session_device_seconds{{base_model="tiny",owner="sdk",session="{session.session_id}"}}'

    before = _scrape(port)
    assert series(sampler) in before and _metric(before, series(trainer)) > 0
    snapshot.sample(ModelInput.from_ints([5, 6, 7, 8]), 4, SamplingParams(max_tokens=16, seed=0)).result(timeout=300)
    after = _scrape(port)
    assert _metric(after, series(sampler)) > _metric(before, series(sampler))
    assert _metric(after, series(trainer)) == _metric(before, series(trainer))
    trainer.optim_step(ADAM).result(timeout=300)
    assert _metric(_scrape(port), series(trainer)) > _metric(after, series(trainer))
    trainer.stop()
    sampler.stop()
    assert series(trainer) not in _scrape(port)  # released: its series ends with it
