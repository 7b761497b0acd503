"""The worker's Celery tasks: thin doorbells into the executor.

Results are stored by the executor under the op's future id (the tasks ignore their own results),
because a parked op may be run by a later message.
"""

from __future__ import annotations

from celery import Celery

from treadle.queue.celery_app import CREATE_SESSION_TASK, OP_TASK, SAMPLE_TASK


def register_tasks(app: Celery, executor) -> None:
    @app.task(name=OP_TASK, bind=True, ignore_result=True, acks_late=True)
    def op(task, envelope: dict) -> None:
        executor.on_op_message(envelope)

    @app.task(name=CREATE_SESSION_TASK, bind=True, ignore_result=True, acks_late=True)
    def create_session(task, payload: dict) -> None:
        executor.on_create_session(task.request.id, payload)

    @app.task(name=SAMPLE_TASK, bind=True, ignore_result=True, acks_late=True)
    def sample(task, body: dict) -> None:
        executor.on_sample(task.request.id, body)
