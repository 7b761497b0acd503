"""A control request's answer (treadle.gpu_worker.executor.control_ops): stored off the thread that resolved it, which
holds the device (the sampler's decode loop), so the answer's metering and Redis writes never keep the device or the
other rows waiting; its meter record, the release of its rows and the answer are one write; and only the worker
whose claim on the request is live answers it: a doorbell for a request claimed elsewhere runs nothing, a request
whose claim lapsed is run again by another worker, and the first claimer's late answer is dropped; one whose claims
lapsed `max_request_crashes` times is answered with an error instead. A sample's rows count against its owner's
bound from its submit (briefly, until it is held) to its answer. Real Redis, the worker's own `ControlOps`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from treadle.errors import CapacityError, CrashingRequestError, ServerError
from treadle.gpu_worker.executor.control_ops import ControlOps
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.metering import Meter
from treadle.queue import names
from treadle.queue.celery_app import make_app
from treadle.queue.control_requests import ControlRequests
from treadle.queue.ops import SampleRequest, decode_result
from treadle.queue.ops_client import ADMITTED_UNHELD_S, SAMPLE_ROWS_TTL_S, OpsClient
from treadle.queue.results import ResultStore
from treadle.queue.sessions import SessionRegistry
from treadle.types import SampledSequence, SampleResponse


class Seen(UsageRecorder):
    """The worker's own recorder, noting the thread and outcome of each answer it meters."""

    def __init__(self, redis_client):
        super().__init__(redis_client)
        self.answers: list[tuple[str, str]] = []

    def control_op_finished(self, sessions, future_id, request, response, seconds, outcome, error=None):
        self.answers.append((threading.current_thread().name, outcome))
        return super().control_op_finished(sessions, future_id, request, response, seconds, outcome, error)


def control_ops(
    redis_client, results: ResultStore, handler, deliver, holder: str = "w1", ttl_ms: int = 30_000
) -> ControlOps:
    return ControlOps(
        ControlRequests(redis_client, holder, ttl_ms=ttl_ms),
        {SampleRequest: handler},
        models=["tiny"],
        registry=SessionRegistry(redis_client),
        usage=Seen(redis_client),
        results=results,
        deliver=deliver,
        one_write=results.in_redis(results.backend.url),
    )


def hold(redis_client, future_id: str, request: SampleRequest) -> None:
    """What the client's submit writes before it rings (treadle.queue.ops_client)."""
    with redis_client.pipeline() as pipe:
        ControlRequests.queue_hold(pipe, future_id, request)
        pipe.execute()


def _answered(results: ResultStore, future_id: str, timeout: float = 30.0) -> dict:
    """The stored result's meta, once it is there (bounded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = results.backend.get_task_meta(future_id)
        if meta["status"] in ("SUCCESS", "FAILURE"):
            return meta
        time.sleep(0.01)
    raise AssertionError(f"no result stored for {future_id} within {timeout} s")


@pytest.mark.parametrize("outcome", ["ok", "error"])
def test_an_answer_resolved_under_the_device_is_stored_by_the_delivery_thread(redis_client, redis_url, outcome):
    results = ResultStore(make_app(redis_url))
    pending: Future = Future()
    device = threading.Lock()
    future_id = f"delivery-{outcome}"
    hold(redis_client, future_id, SampleRequest.build(base_model="tiny", prompt=[5, 6, 7]))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        control = control_ops(redis_client, results, lambda request: pending, deliver)
        assert control.run(future_id)
        assert not control.usage.answers  # the doorbell returned before the answer: nothing stored yet

        def decode_loop():  # resolves the answer holding the device, as the sampler's loop does
            with device:
                if outcome == "ok":
                    pending.set_result(SampleResponse(sequences=[SampledSequence(tokens=[9], stop_reason="length")]))
                else:
                    pending.set_exception(ServerError("sample failed: boom"))

        loop = threading.Thread(target=decode_loop, name="decode-loop")
        loop.start()
        loop.join(30)
        meta = _answered(results, future_id)
    [(thread, result)] = control.usage.answers
    assert thread.startswith("treadle-deliver")
    assert not control.requests.is_held(future_id)  # answered: the request is no longer held
    if outcome == "ok":
        assert result == "ok"
        assert decode_result(meta["result"]).sequences[0].tokens == [9]
    else:
        assert result == "server_error"
        assert meta["status"] == "FAILURE"


def test_an_answer_ready_in_the_task_is_stored_before_it_returns(redis_client, redis_url):
    """create_session and refused requests answer at once: stored by the Celery thread itself, in order; a second
    doorbell for the answered request runs nothing."""
    results = ResultStore(make_app(redis_url))
    hold(redis_client, "delivery-now", SampleRequest.build(base_model="tiny", prompt=[5]))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        control = control_ops(redis_client, results, lambda request: SampleResponse(sequences=[]), deliver)
        assert control.run("delivery-now")
        assert results.backend.get_task_meta("delivery-now")["status"] == "SUCCESS"
        assert not control.run("delivery-now")


def test_a_request_whose_claim_lapsed_is_rerun_once_and_the_late_answer_is_dropped(redis_client, redis_url):
    """Worker A claims a sample and is still decoding it when its claim lapses (A paused, or died); worker B's
    caretaker runs it again and answers. A's late answer is neither stored nor published, the meter counts the
    sample once, and the answer frees the request's rows from its owner's bound."""
    results = ResultStore(make_app(redis_url))
    assert results.in_redis(redis_url)  # the one-write path
    future_id, owner = "rerun-sample", "alice"
    rows_key = names.owner_sample_rows_key(owner)
    redis_client.hset(rows_key, future_id, f"4 {time.time() + 600}")  # what the submit counted against alice
    request = SampleRequest.build(base_model="tiny", prompt=[5, 6], num_samples=1, owner=owner)
    hold(redis_client, future_id, request)
    a_decoding: Future = Future()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        a = control_ops(redis_client, results, lambda req: a_decoding, deliver, holder="a")
        b = control_ops(
            redis_client,
            results,
            lambda req: SampleResponse(sequences=[SampledSequence(tokens=[7, 7], stop_reason="length")]),
            deliver,
            holder="b",
        )
        assert a.run(future_id)
        assert not b.run(future_id)  # a doorbell for a request claimed elsewhere runs nothing
        assert b.requests.orphans("tiny") == []  # A's claim is live: nobody re-runs it
        redis_client.delete(names.control_claim_key(future_id))  # A's claim lapses
        with results.watch(future_id) as watch:
            b.recover()
            first = watch.sleep(30)  # B's answer's publication
            a_decoding.set_result(SampleResponse(sequences=[SampledSequence(tokens=[9, 9], stop_reason="length")]))
            again = watch.sleep(0.5)
    assert first is not None and again is None  # A's answer was not published
    meta = results.backend.get_task_meta(future_id)
    assert decode_result(meta["result"]).sequences[0].tokens == [7, 7]
    assert redis_client.ttl(results.backend.get_key_for_task(future_id)) > 0  # it expires like any result
    assert not redis_client.hexists(rows_key, future_id)
    assert not b.requests.is_held(future_id) and b.requests.orphans("tiny") == []
    [record] = Meter(redis_client).owner_ops(owner)
    assert record.op_id == future_id and record.sampled_tokens == 2 and record.prefill_tokens == 2


def test_claims_given_back_or_lost_alive_count_no_death_and_lapsed_ones_stop_the_request_at_the_limit(
    redis_client, redis_url
):
    """A claim given back at a warm shutdown counts no death, nor one whose claimer lost it alive (it says so at its
    next renewal, after the next claim counted it); each other claim that lapsed counts one, and the claimer after
    two such deaths (the default max_request_crashes) answers with CrashingRequestError through the normal answer
    path (rows freed, metered as a failure, the request ended) without running it, once the last dead claimer had
    a lease TTL to say it was alive."""
    results = ResultStore(make_app(redis_url))
    future_id, owner = "crashing-sample", "bob"
    rows_key = names.owner_sample_rows_key(owner)
    redis_client.hset(rows_key, future_id, f"1 {time.time() + 600}")
    hold(redis_client, future_id, SampleRequest.build(base_model="tiny", prompt=[5, 6], owner=owner))
    ran: list[str] = []

    def running(holder: str):
        return lambda request: ran.append(holder) or Future()  # a decode that never ends: its worker dies in it

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        shutting_down = control_ops(redis_client, results, running("a"), deliver, holder="a")
        assert shutting_down.run(future_id)
        shutting_down.release_all()
        paused = control_ops(redis_client, results, running("b"), deliver, holder="b")
        assert paused.run(future_id)
        redis_client.delete(names.control_claim_key(future_id))  # b's heartbeat is late: its claim lapses
        for holder in ["c", "d"]:  # each claims it, and dies in it: the claim lapses
            assert control_ops(redis_client, results, running(holder), deliver, holder=holder).run(future_id)
            redis_client.delete(names.control_claim_key(future_id))
            paused.renew()  # b wakes (after c counted its lapse), finds its claim lost, and says it is alive
        last = control_ops(redis_client, results, running("e"), deliver, holder="e", ttl_ms=100)
        deadline = time.monotonic() + 30
        while last.requests.is_held(future_id):
            last.recover()  # nothing the first time: d may yet say it is alive, for e's lease TTL
            assert time.monotonic() < deadline, "the request was never answered"
            time.sleep(0.02)
    assert ran == ["a", "b", "c", "d"]
    meta = results.backend.get_task_meta(future_id)
    assert meta["status"] == "FAILURE" and isinstance(meta["result"], CrashingRequestError)
    assert "2 workers died" in meta["result"].message and future_id in meta["result"].message
    assert last.usage.answers == [("MainThread", "server_error")]
    assert not redis_client.hexists(rows_key, future_id) and not last.requests.is_held(future_id)


def test_a_held_request_that_does_not_parse_is_answered_with_its_error(redis_client, redis_url):
    results = ResultStore(make_app(redis_url))
    hold(redis_client, "unparsable", SampleRequest.build(base_model="tiny", prompt=[5]))
    redis_client.hset(names.control_request_key("unparsable"), "body", b'{"base_model": "tiny", "prompt": "x"}')
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        control = control_ops(redis_client, results, lambda request: SampleResponse(sequences=[]), deliver)
        assert control.run("unparsable")
    meta = results.backend.get_task_meta("unparsable")
    assert meta["status"] == "FAILURE" and "prompt" in str(meta["result"])
    assert not control.requests.is_held("unparsable") and not control.usage.answers  # answered, not metered


def test_a_streamed_sample_whose_worker_died_mid_stream_fails_clearly(redis_client, redis_url):
    """A re-run would stream the tokens a second time: a streamed sample whose stream has entries is answered with
    an error that says why, instead of being run again; one that had streamed nothing runs again."""
    from treadle.queue import sample_stream

    results = ResultStore(make_app(redis_url))
    for future_id, streamed in [("mid-stream", True), ("stream-not-started", False)]:
        request = SampleRequest.build(base_model="tiny", prompt=[5], stream_id=f"s-{future_id}")
        hold(redis_client, future_id, request)
        redis_client.hset(names.control_request_key(future_id), "epoch", 1)  # its first claimer died
        if streamed:
            with redis_client.pipeline() as pipe:
                sample_stream.append(
                    pipe, f"s-{future_id}", sample_stream.StreamedTokens(rows=[0], tokens=[9], logprobs=[-1.0])
                )
                pipe.execute()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        control = control_ops(redis_client, results, lambda request: SampleResponse(sequences=[]), deliver)
        control.recover()
    failed = results.backend.get_task_meta("mid-stream")
    assert failed["status"] == "FAILURE" and "does not resume" in str(failed["result"])
    assert results.backend.get_task_meta("stream-not-started")["status"] == "SUCCESS"


class Killed(BaseException):
    """The client process dying where this is raised."""


def test_rows_admitted_for_a_sample_its_client_never_held_count_only_briefly(redis_client, redis_url, monkeypatch):
    """A loop killed as it submits a sample leaves the rows it was admitted for and no request to answer: they count
    against its owner's bound for ADMITTED_UNHELD_S (they held every later sample of the owner for SAMPLE_ROWS_TTL_S,
    ten minutes). The request's hold gives its rows the full lifetime, in the same transaction."""
    redis_client.hset(names.LIMITS_KEY, "max_queued_sample_rows_per_owner", 8)
    ops = OpsClient(redis_url)
    rows_key = names.owner_sample_rows_key("carol")
    request = SampleRequest.build(base_model="tiny", prompt=[5, 6], num_samples=4, owner="carol")

    def dies(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(ops, "_hold_and_ring", dies)
    with pytest.raises(Killed):
        ops.submit_sample(request)
    [(lost, entry)] = redis_client.hgetall(rows_key).items()
    rows, deadline = entry.decode().split()
    assert rows == "4" and float(deadline) <= time.time() + ADMITTED_UNHELD_S
    assert not ops.control.is_held(lost.decode())

    monkeypatch.undo()
    before = time.time()
    held = ops.submit_sample(request)
    assert ops.control.is_held(held)
    rows, deadline = redis_client.hget(rows_key, held).decode().split()
    assert rows == "4" and float(deadline) >= before + SAMPLE_ROWS_TTL_S
    assert redis_client.ttl(rows_key) > SAMPLE_ROWS_TTL_S - 60
    with pytest.raises(CapacityError, match="owner 'carol' has 8 sample rows queued and the limit is 8"):
        ops.submit_sample(request)  # both count meanwhile
