"""The worker process: `treadle worker --model NAME_OR_DIR [--model ...]`.

It loads each base model once, consumes the control queue of each, and subscribes itself to the
queue of every session it owns. Besides Celery's own thread pool (one thread: one op at a time on the
accelerator) it runs three background threads: a heartbeat that announces the worker and renews its
session leases and its claims on control requests (never blocked by a long op), a caretaker that adopts
sessions whose owner died, runs again the control requests whose worker died, expires sessions idle past
`session_idle_ttl_s` and unloads idle ones, and one that stores sample answers off the decode loop. With `--metrics_port` it
serves Prometheus metrics (treadle.observability.metrics). SIGTERM is a warm shutdown: the running op
finishes, owned sessions are checkpointed and their leases released so another worker can adopt them, and
the claims on control requests not yet answered are given back so another worker runs them.
`build_worker` (treadle.gpu_worker.wiring) makes its parts.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from celery import Celery
from celery.signals import worker_ready, worker_shutting_down
from redis import Redis

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.executor.control_ops import ControlOps
from treadle.gpu_worker.executor.failover import Failover
from treadle.gpu_worker.scheduling.linger import Linger
from treadle.gpu_worker.sessions.autosave import Autosaver
from treadle.gpu_worker.sessions.hosting import SessionHost
from treadle.gpu_worker.worker_config import WorkerConfig
from treadle.observability import metrics
from treadle.queue import names
from treadle.queue.lease import LeaseManager
from treadle.queue.workers import ServedModel, WorkerAnnouncement, WorkerRegistry

log = logging.getLogger("treadle.worker")


class Consumers:
    """The worker's own Celery consumer (main thread), which the pool thread asks to (un)subscribe a session's queue
    via remote control. The reply is awaited: a lost broadcast would leave a session's queue with no consumer."""

    def __init__(self, app: Celery, hostname: str):
        self.app, self.hostname = app, hostname

    def subscribe(self, queue: str) -> None:
        for attempt in range(10):
            replies = self.app.control.add_consumer(queue, destination=[self.hostname], reply=True, timeout=3)
            if replies:
                return
            log.warning("no reply subscribing to %s (attempt %d); retrying", queue, attempt + 1)
        log.error("could not subscribe to %s", queue)

    def unsubscribe(self, queue: str) -> None:
        self.app.control.cancel_consumer(queue, destination=[self.hostname], reply=False)


@dataclass
class WorkerService:
    """A worker's parts, wired by treadle.gpu_worker.wiring.build_worker, and what the process does with them: its
    background threads, its Celery worker, its warm shutdown."""

    config: WorkerConfig
    hostname: str
    redis: Redis
    app: Celery
    engines: dict[str, Engine]
    served: list[ServedModel]  # the models as the announcement describes them
    host: SessionHost
    lease: LeaseManager
    autosaver: Autosaver
    linger: Linger
    failover: Failover
    control: ControlOps
    registry: WorkerRegistry
    # Stores the answers of sample requests off the decode loop's thread (treadle.gpu_worker.executor.celery_tasks).
    deliver: ThreadPoolExecutor
    _stop: threading.Event = field(default_factory=threading.Event)
    _started_at: float = field(default_factory=time.time)

    # ------------------------------------------------------------ background threads
    def _announce(self) -> None:
        self.registry.announce(
            WorkerAnnouncement(
                hostname=self.hostname,
                pid=os.getpid(),
                models=self.served,
                started_at=self._started_at,
                sessions=sorted(self.host.owned),
                unloaded=sorted(sid for sid, o in self.host.owned.items() if o.unloaded),
                memory=metrics.memory_in_use(),
            )
        )
        counts = dict.fromkeys(self.engines, 0)
        for owned in list(self.host.owned.values()):
            counts[owned.record.base_model] += 1
        for model, count in counts.items():
            metrics.ACTIVE_SESSIONS.labels(model).set(count)

    def _heartbeat_loop(self) -> None:
        period = min(3.0, self.config.lease_ttl_s / 3)
        while not self._stop.is_set():
            try:
                self._announce()
                for sid, owned in list(self.host.owned.items()):
                    if not self.lease.renew(sid, owned.epoch):
                        log.warning("could not renew the lease of session %s", sid)
                self.control.renew()
            except Exception:  # Redis restarting: keep trying, the leases have slack
                log.warning("heartbeat failed; retrying", exc_info=True)
            self._stop.wait(period)

    def _caretaker_loop(self) -> None:
        period = min(3.0, self.config.lease_ttl_s / 3)
        while not self._stop.is_set():
            try:
                self.failover.caretaker_pass()
                self.control.recover()
            except Exception:
                log.warning("caretaker pass failed; retrying", exc_info=True)
            self._stop.wait(period)

    # ------------------------------------------------------------ run
    def _publish_tokenizers(self) -> None:
        for name, engine in self.engines.items():
            with tempfile.TemporaryDirectory() as tmp:
                engine.tokenizer.save_pretrained(tmp)
                files = {f: open(os.path.join(tmp, f), "rb").read() for f in os.listdir(tmp)}
            key = names.tokenizer_key(name)
            with self.redis.pipeline() as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping=files)
                pipe.execute()

    def _device_seconds(self, session_id: str, base_model: str) -> float:
        engine = self.engines.get(base_model)
        return 0.0 if engine is None else engine.device.seconds.get(session_id, 0.0)

    def run(self) -> None:
        if self.config.metrics_port:
            metrics.start_metrics_server(
                self.config.metrics_port,
                self.config.metrics_address,
                redis=self.redis,
                models=self.engines,
                owned=lambda: list(self.host.owned),
                device_seconds=self._device_seconds,
            )
        self._publish_tokenizers()
        self.redis.hset(
            names.LIMITS_KEY, "max_queued_sample_rows_per_owner", self.config.max_queued_sample_rows_per_owner
        )
        self._announce()
        threading.Thread(target=self._heartbeat_loop, name="treadle-heartbeat", daemon=True).start()
        # Adopting sessions needs the consumer up (it subscribes to their queues), so wait for ready.
        caretaker = threading.Thread(target=self._caretaker_loop, name="treadle-caretaker", daemon=True)
        worker_ready.connect(lambda sender=None, **kw: caretaker.start(), weak=False)
        worker_shutting_down.connect(
            lambda sender=None, **kw: self.linger.close(), weak=False
        )  # the op thread stops waiting
        worker = self.app.Worker(
            hostname=self.hostname,
            pool="threads",
            concurrency=1,
            queues=[names.model_queue(name) for name in self.engines],
            without_gossip=True,
            without_mingle=True,
            send_events=self.config.task_events,
            loglevel=self.config.loglevel,
            redirect_stdouts=False,
        )
        try:
            worker.start()
        finally:
            self._stop.set()
            self._hand_over()
            self.control.release_all()  # other workers run them; the answers given below are dropped
            for engine in self.engines.values():  # sample requests still waiting fail
                engine.close()
            self.deliver.shutdown(wait=True)  # ...once their answers are stored
            self.registry.withdraw(self.hostname)

    def _hand_over(self) -> None:
        """On a clean shutdown, checkpoint owned sessions and free their leases for another worker."""
        for sid, owned in list(self.host.owned.items()):
            try:
                with self.host.op_lock:
                    if not owned.unloaded:
                        self.autosaver.checkpoint(owned)
                    self.lease.release(sid, owned.epoch)
                log.info("handed over session %s", sid)
            except Exception:
                log.warning("could not hand over session %s", sid, exc_info=True)
