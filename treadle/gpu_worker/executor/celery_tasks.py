"""The worker's Celery tasks, one per op of the op table (`treadle.op.<name>`), so Flower shows what runs.

A session op's message is a doorbell naming (session_id, seq): the sequencer reads the op from the
journal and stores its result itself (tasks ignore their own results), because an early op may be
run by a later doorbell. A control op's message (create_session, sample) carries its request.
A control handler may answer with a future (sampling does): its result is stored when it resolves,
and the task returns at once, so the pool thread is free for the next message meanwhile. (A sample
in progress when the worker dies is then lost rather than redelivered; the client's wait on it
is bounded by its own timeout.) The future resolves on the thread that computed it, holding the device
(the sampler's decode loop): the answer is encoded, metered and stored on the `deliver` executor
instead, so its Redis writes never keep the device, and the other rows' decode steps, waiting.

A control op's meter record, the release of a sample's rows from its owner's bound and its answer are one
MULTI/EXEC when results live in the broker's Redis (the default), as a session op's are
(treadle.gpu_worker.executor.op_record): one round trip instead of five (two when a sample's request names no
owner: its session's record is read first). An answer already stored stays: a
task redelivered after a crash (between its answer and its acknowledgement) answers again, and the first answer,
which a client may have read, is the one that counts (Celery's own store keeps a first success the same way).
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
    one_write = results.in_redis(app.conf.broker_url)
    control: dict[type[OpRequest], Callable[[OpRequest], BaseModel | Future]] = {
        CreateSessionRequest: host.create,
        SampleRequest: sampling.sample,
    }
    for cls in OPS.values():
        if cls.route == "session":
            app.task(name=task_name(cls.op), ignore_result=True, acks_late=True)(sequencer.on_doorbell)
        elif cls in control:
            app.task(name=task_name(cls.op), bind=True, ignore_result=True, acks_late=True)(
                _control_task(
                    cls,
                    control[cls],
                    results,
                    lambda *a: _answer(host, usage, results, one_write, *a),
                    deliver,
                )
            )


def _answer(
    host: SessionHost,
    usage: UsageRecorder,
    results: ResultStore,
    one_write: bool,
    future_id: str,
    request: OpRequest,
    response: BaseModel | None,
    payload: dict | None,
    error: TreadleError | None,
    seconds: float,
) -> None:
    """Meter a control op and store its answer (see the module's docstring). An answered sample's rows stop counting
    against its owner's bound, and the record of its submission lives only as long as its result will
    (treadle.queue.ops_client): a wait on it once both are gone fails as expired instead of waiting for a sample
    still in flight."""
    outcome = "ok" if error is None else f"{error.category}_error"
    metered = usage.control_op_finished(host.registry, future_id, request, response, seconds, outcome)
    with host.registry.redis.pipeline(transaction=True) as pipe:
        if metered is not None:  # a successful op: metered before its answer shows
            usage.record(metered, client=pipe)
        if isinstance(request, SampleRequest):
            pipe.hdel(names.owner_sample_rows_key(request.owner or SDK_OWNER), future_id)
            pipe.expire(names.submitted_key(future_id), results.backend.expires)
        if one_write:
            results.queue_store(pipe, future_id, payload, error, first_only=True)
        pipe.execute()
    if not one_write:
        results.store(future_id, payload, error)


def _control_task(
    cls: type[OpRequest],
    run: Callable[[OpRequest], BaseModel | Future],
    results: ResultStore,
    answer_with: Callable[[str, OpRequest, BaseModel | None, dict | None, TreadleError | None, float], None],
    deliver: Executor,
):
    """`answer_with(future_id, request, response, payload, error, seconds)` meters the op and stores its answer."""

    def store(future_id: str, request: OpRequest, started: float, answer: Callable[[], BaseModel]) -> None:
        response, payload, error = None, None, None
        try:
            response = answer()
            payload = encode_result(cls.op, response)
        except TreadleError as exc:
            error = exc
        except Exception as exc:  # a bug or a broken model must still answer the client
            log.exception("%s failed", cls.op)
            error = ServerError(f"{cls.op} failed: {type(exc).__name__}: {exc}")
        answer_with(future_id, request, response, payload, error, time.monotonic() - started)

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
