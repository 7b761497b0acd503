"""The worker's Celery tasks, one per op of the op table (`treadle.op.<name>`), so Flower shows what runs.

A session op's message is a doorbell naming (session_id, seq): the sequencer reads the op from the
journal and stores its result itself (tasks ignore their own results), because an early op may be
run by a later doorbell. A control op's message (create_session, sample) is a doorbell too, named by the
request's future id: the request is held in Redis until it is answered, and `ControlOps`
(treadle.gpu_worker.executor.control_ops) claims, runs and answers it.
"""

from __future__ import annotations

from celery import Celery

from treadle.gpu_worker.executor.control_ops import ControlOps
from treadle.gpu_worker.executor.sequencer import Sequencer
from treadle.queue.ops import OPS, task_name


def register_tasks(app: Celery, sequencer: Sequencer, control: ControlOps) -> None:
    def control_op(celery_task) -> None:  # the task's id is the request's future id
        control.run(celery_task.request.id)

    for cls in OPS.values():
        if cls.route == "session":
            app.task(name=task_name(cls.op), ignore_result=True, acks_late=True)(sequencer.on_doorbell)
        else:
            app.task(name=task_name(cls.op), bind=True, ignore_result=True, acks_late=True)(control_op)
