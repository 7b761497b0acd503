"""A sample request's answer is stored off the thread that resolved it: that thread holds the device (the
sampler's decode loop), and the answer's metering and Redis writes must not keep the device or the other rows
waiting. Real Redis, the worker's own control task."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from treadle.errors import ServerError
from treadle.gpu_worker.executor.celery_tasks import _control_task
from treadle.queue.celery_app import make_app
from treadle.queue.ops import SampleRequest, decode_result
from treadle.queue.results import ResultStore
from treadle.types import SampledSequence, SampleResponse


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
def test_an_answer_resolved_under_the_device_is_stored_by_the_delivery_thread(redis_url, outcome):
    app = make_app(redis_url)
    results = ResultStore(app)
    pending: Future = Future()
    metered: list[tuple[str, str]] = []  # (thread that metered the answer, outcome)
    device = threading.Lock()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        task = _control_task(
            SampleRequest,
            lambda request: pending,
            results,
            lambda future_id, request, response, seconds, result: metered.append(
                (threading.current_thread().name, result)
            ),
            deliver,
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


def test_an_answer_ready_in_the_task_is_stored_before_it_returns(redis_url):
    """create_session and refused requests answer at once: stored by the Celery thread itself, in order."""
    app = make_app(redis_url)
    results = ResultStore(app)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver") as deliver:
        task = _control_task(
            SampleRequest,
            lambda request: SampleResponse(sequences=[]),
            results,
            lambda *args: None,
            deliver,
        )
        task(
            SimpleNamespace(request=SimpleNamespace(id="delivery-now")),
            SampleRequest.build(base_model="tiny", prompt=[5]).encode(),
        )
        assert results.backend.get_task_meta("delivery-now")["status"] == "SUCCESS"
