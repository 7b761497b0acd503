"""The worker's Celery tasks, one per op of the op table (`treadle.op.<name>`), so Flower shows what runs.

A session op's message is a doorbell naming (session_id, seq): the sequencer reads the op from the
journal and stores its result itself (tasks ignore their own results), because an early op may be
run by a later doorbell. A control op's message (create_session, sample) carries its request.
"""

from __future__ import annotations

import logging
from typing import Callable

from celery import Celery
from pydantic import BaseModel

from treadle.errors import ServerError, TreadleError
from treadle.gpu_worker.hosting import SessionHost
from treadle.gpu_worker.sampling import Sampling
from treadle.gpu_worker.sequencer import Sequencer
from treadle.queue.ops import OPS, CreateSessionRequest, OpRequest, SampleRequest, encode_result, task_name
from treadle.queue.results import ResultStore

log = logging.getLogger("treadle.worker")


def register_tasks(app: Celery, sequencer: Sequencer, host: SessionHost, sampling: Sampling) -> None:
    results = ResultStore(app)
    control: dict[type[OpRequest], Callable[[OpRequest], BaseModel]] = {
        CreateSessionRequest: host.create,
        SampleRequest: sampling.sample,
    }
    for cls in OPS.values():
        if cls.route == "session":
            app.task(name=task_name(cls.op), ignore_result=True, acks_late=True)(sequencer.on_doorbell)
        elif cls in control:
            app.task(name=task_name(cls.op), bind=True, ignore_result=True, acks_late=True)(
                _control_task(cls, control[cls], results))


def _control_task(cls: type[OpRequest], run: Callable[[OpRequest], BaseModel], results: ResultStore):
    def task(celery_task, payload: dict) -> None:
        future_id = celery_task.request.id
        try:
            results.store_ok(future_id, encode_result(cls.op, run(cls.decode(payload))))
        except TreadleError as exc:
            results.store_error(future_id, exc)
        except Exception as exc:  # a bug or a broken model must still answer the client
            log.exception("%s failed", cls.op)
            results.store_error(future_id, ServerError(f"{cls.op} failed: {type(exc).__name__}: {exc}"))

    task.__name__ = cls.op
    return task
