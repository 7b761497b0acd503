"""The worker's Celery tasks, one per op of the op table (`treadle.op.<name>`), so Flower shows what runs.

A session op's message is a doorbell naming (session_id, seq): the sequencer reads the op from the
journal and stores its result itself (tasks ignore their own results), because an early op may be
run by a later doorbell. A control op's message (create_session, sample) carries its request.
A control handler may answer with a future (sampling does): its result is stored when it resolves,
and the task returns at once, so the pool thread is free for the next message meanwhile. (A sample
in progress when the worker dies is then lost rather than redelivered; the client's wait on it
is bounded by its own timeout.) The future resolves on the thread that computed it, holding the device
(the sampler's decode loop): the answer is encoded, metered and stored on the `deliver` executor
instead, so its Redis round trips (about 4 ms a request) never keep the device, and the other rows'
decode steps, waiting.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from typing import Callable

from celery import Celery
from pydantic import BaseModel

from treadle.errors import ServerError, TreadleError
from treadle.gpu_worker.sessions.hosting import SessionHost
from treadle.gpu_worker.executor.sample_requests import Sampling
from treadle.gpu_worker.executor.sequencer import Sequencer
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.metering import SDK_OWNER
from treadle.queue import names
from treadle.queue.ops import OPS, CreateSessionRequest, OpRequest, SampleRequest, encode_result, task_name
from treadle.queue.results import ResultStore

log = logging.getLogger("treadle.worker")


def register_tasks(
    app: Celery,
    sequencer: Sequencer,
    host: SessionHost,
    sampling: Sampling,
    usage: UsageRecorder,
    deliver: Executor,
) -> None:
    """`deliver` stores the answers of control ops that answer with a future (see the module's docstring)."""
    results = ResultStore(app)
    control: dict[type[OpRequest], Callable[[OpRequest], BaseModel | Future]] = {
        CreateSessionRequest: host.create,
        SampleRequest: sampling.sample,
    }
    for cls in OPS.values():
        if cls.route == "session":
            app.task(name=task_name(cls.op), ignore_result=True, acks_late=True)(sequencer.on_doorbell)
        elif cls in control:
            app.task(name=task_name(cls.op), bind=True, ignore_result=True, acks_late=True)(
                _control_task(cls, control[cls], results, lambda *a: _finished(host, usage, results, *a), deliver)
            )


def _finished(
    host: SessionHost, usage: UsageRecorder, results: ResultStore, future_id: str, request: OpRequest, *rest
) -> None:
    """Meter a control op. An answered sample's rows stop counting against its owner's bound, and the record of its
    submission lives only as long as its result will (treadle.queue.ops_client): a wait on it once both are gone
    fails as expired instead of waiting for a sample still in flight."""
    usage.control_op_finished(host.registry, future_id, request, *rest)
    if isinstance(request, SampleRequest):
        with host.registry.redis.pipeline(transaction=False) as pipe:
            pipe.hdel(names.owner_sample_rows_key(request.owner or SDK_OWNER), future_id)
            pipe.expire(names.submitted_key(future_id), results.backend.expires)
            pipe.execute()


def _control_task(
    cls: type[OpRequest],
    run: Callable[[OpRequest], BaseModel | Future],
    results: ResultStore,
    finished: Callable[[str, OpRequest, BaseModel | None, float, str], None],
    deliver: Executor,
):
    """`finished(future_id, request, response, seconds, outcome)` meters the op before its result is stored."""

    def store(future_id: str, request: OpRequest, started: float, answer: Callable[[], BaseModel]) -> None:
        response, error = None, None
        try:
            response = answer()
            payload = encode_result(cls.op, response)
        except TreadleError as exc:
            error = exc
        except Exception as exc:  # a bug or a broken model must still answer the client
            log.exception("%s failed", cls.op)
            error = ServerError(f"{cls.op} failed: {type(exc).__name__}: {exc}")
        finished(
            future_id,
            request,
            response,
            time.monotonic() - started,
            "ok" if error is None else f"{error.category}_error",
        )
        if error is None:
            results.store_ok(future_id, payload)
        else:
            results.store_error(future_id, error)

    def task(celery_task, payload: dict) -> None:
        future_id, started = celery_task.request.id, time.monotonic()
        try:
            request = cls.decode(payload)
        except TreadleError as exc:
            results.store_error(future_id, exc)
            return
        answer: Future = Future()
        try:
            outcome = run(request)
        except Exception as exc:
            answer.set_exception(exc)
        else:
            if isinstance(outcome, Future):
                answer = outcome
            else:
                answer.set_result(outcome)
        if answer.done():  # answered in this task (create_session, a refused request): this thread stores it
            store(future_id, request, started, answer.result)
        else:
            answer.add_done_callback(lambda done: deliver.submit(store, future_id, request, started, done.result))

    task.__name__ = cls.op
    return task
