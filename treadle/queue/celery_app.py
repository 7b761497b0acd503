"""The Celery app and its configuration, shared by the SDK (which only publishes) and the worker.

Why each setting: JSON only, never pickle; one message at a time per worker (acks_late + prefetch 1),
so a worker busy with an op leaves the next ones to the queue; results live 7 days (a worker's
`--result_ttl_s`). No ack emulation:
kombu's Redis transport would copy every delivered message into an `unacked` hash and delete it again
on ack (two transactions per message, on the critical path of every op) to redeliver it after a
visibility timeout. treadle needs neither: a session message is a doorbell for an op the journal
already holds, and the worker that adopts a dead owner's session runs what the journal holds. A
control message (create_session, sample) is a doorbell too: its request is held in Redis until it is
answered, and run again when its worker dies (treadle.queue.control_requests).
Task events (for Flower's task views) are off unless a worker asks for them: each event is a fanout
publish for which kombu builds a Redis client, and with them on they took a third of a worker's CPU
per op (py-spy, a stream of noops). Publishers never send `task-sent` (Flower lists an op from `received`).
A plain redis:// broker goes through `treadle.queue.redis_transport` (kombu's, without a client object
per command); rediss:// and sentinel:// keep kombu's own, whose TLS and discovery come from the scheme.
Every scheme reads control queues before session queues (`redis_transport.SessionsLast`).
"""

from __future__ import annotations

from celery import Celery

from treadle.queue import redis_transport

RESULT_EXPIRES_S = 7 * 24 * 3600


def make_app(
    broker_url: str,
    result_url: str | None = None,
    *,
    task_events: bool = False,
    result_expires_s: int = RESULT_EXPIRES_S,
) -> Celery:
    """`result_expires_s`: how long the results this app stores stay (a worker's `--result_ttl_s`)."""
    app = Celery("treadle", broker=broker_url, backend=result_url or broker_url, set_as_current=False)
    transport = {
        "ack_emulation": False,
        "socket_connect_timeout": 5,
        "socket_timeout": 30,
        "retry_on_timeout": True,
        "health_check_interval": 25,
        "queue_order_strategy": redis_transport.QUEUE_ORDER,
    }
    if broker_url.startswith("redis://"):
        app.conf.broker_transport = redis_transport.TRANSPORT
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=False,
        task_track_started=False,
        result_extended=True,
        result_expires=result_expires_s,
        task_send_sent_event=False,
        worker_send_task_events=task_events,
        broker_transport_options=transport,
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        redis_socket_connect_timeout=5,
        redis_socket_timeout=30,
        redis_retry_on_timeout=True,
        worker_soft_shutdown_timeout=30,
        worker_hijack_root_logger=False,
        task_create_missing_queues=True,
        task_default_queue="treadle.default",
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app
