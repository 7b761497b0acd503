"""A sample request's answer is stored off the thread that resolved it: that thread holds the device (the
sampler's decode loop), and the answer's metering and Redis writes must not keep the device or the other rows
waiting. Its meter record, the release of its rows and the answer are one write, and a redelivered task's second
answer does not replace the first. Real Redis, the worker's own control task and answer."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from treadle.errors import ServerError
from treadle.gpu_worker.executor.celery_tasks import _answer, _control_task
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.metering import Meter
from treadle.queue import names
from treadle.queue.celery_app import make_app
from treadle.queue.ops import SampleRequest, decode_result
from treadle.queue.results import ResultStore
from treadle.queue.sessions import SessionRegistry
from treadle.types import SampledSequence, SampleResponse


def _worker_answer(redis_client, results: ResultStore, seen: list | None = None):
    """The worker's own answer (`_answer`: meter, release the rows, store) on a real Redis; `seen` collects the
    thread and outcome of each answer."""
    host = SimpleNamespace(registry=SessionRegistry(redis_client))
    usage, one_write = UsageRecorder(redis_client), results.in_redis(results.backend.url)

    def answer(future_id, request, response, payload, error, seconds):
        if seen is not None:
            seen.append((threading.current_thread().name, "ok" if error is None else f"{error.category}_error"))
        _answer(host, usage, results, one_write, future_id, request, response, payload, error, seconds)

    return answer


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
    app = make_app(redis_url)
    results = ResultStore(app)
    pending: Future = Future()
    metered: list[tuple[str, str]] = []  # (thread that metered the answer, outcome)
    device = threading.Lock()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        task = _control_task(
            SampleRequest, lambda request: pending, results, _worker_answer(redis_client, results, metered), deliver
        )
        request = SampleRequest.build(base_model="tiny", prompt=[5, 6, 7])
        future_id = f"delivery-{outcome}"
        task(SimpleNamespace(request=SimpleNamespace(id=future_id)), request.encode())
        assert not metered  # the task returned before the answer: nothing stored yet

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
    [(thread, result)] = metered
    assert thread.startswith("treadle-deliver")
    if outcome == "ok":
        assert result == "ok"
        assert decode_result(meta["result"]).sequences[0].tokens == [9]
    else:
        assert result == "server_error"
        assert meta["status"] == "FAILURE"


def test_an_answer_ready_in_the_task_is_stored_before_it_returns(redis_client, redis_url):
    """create_session and refused requests answer at once: stored by the Celery thread itself, in order."""
    app = make_app(redis_url)
    results = ResultStore(app)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        task = _control_task(
            SampleRequest,
            lambda request: SampleResponse(sequences=[]),
            results,
            _worker_answer(redis_client, results),
            deliver,
        )
        task(
            SimpleNamespace(request=SimpleNamespace(id="delivery-now")),
            SampleRequest.build(base_model="tiny", prompt=[5]).encode(),
        )
        assert results.backend.get_task_meta("delivery-now")["status"] == "SUCCESS"


def test_a_redelivered_sample_keeps_its_first_answer_and_is_metered_once(redis_client, redis_url):
    """A task redelivered after a crash answers again: the stored answer, which a client may have read, stays, and
    the meter counts the sample once. The answer frees the request's rows from its owner's bound."""
    app = make_app(redis_url)
    results = ResultStore(app)
    assert results.in_redis(redis_url)  # the one-write path
    future_id, owner = "redelivered-sample", "alice"
    rows_key = names.owner_sample_rows_key(owner)
    redis_client.hset(rows_key, future_id, f"4 {time.time() + 600}")  # what the submit counted against alice
    answers = iter([[9, 9], [7, 7]])  # the second run samples other tokens
    request = SampleRequest.build(base_model="tiny", prompt=[5, 6], num_samples=1, owner=owner)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        task = _control_task(
            SampleRequest,
            lambda req: SampleResponse(sequences=[SampledSequence(tokens=next(answers), stop_reason="length")]),
            results,
            _worker_answer(redis_client, results),
            deliver,
        )
        with results.watch(future_id) as watch:
            task(SimpleNamespace(request=SimpleNamespace(id=future_id)), request.encode())
            first = watch.sleep(30)  # the first answer's publication
            task(SimpleNamespace(request=SimpleNamespace(id=future_id)), request.encode())
            again = watch.sleep(0.5)
    assert first is not None and again is None  # the second answer was not published
    meta = results.backend.get_task_meta(future_id)
    assert decode_result(meta["result"]).sequences[0].tokens == [9, 9]
    assert redis_client.ttl(results.backend.get_key_for_task(future_id)) > 0  # it expires like any result
    assert not redis_client.hexists(rows_key, future_id)
    [record] = Meter(redis_client).owner_ops(owner)
    assert record.op_id == future_id and record.sampled_tokens == 2 and record.prefill_tokens == 2
