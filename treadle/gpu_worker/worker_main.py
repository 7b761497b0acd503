"""The worker process: `treadle worker --model NAME_OR_DIR [--model ...]`.

It loads each base model once, consumes the control queue of each, and subscribes itself to the
queue of every session it owns. Besides Celery's own thread pool (one thread: one op at a time on the
accelerator) it runs three background threads: a heartbeat that announces the worker and renews its
session leases (never blocked by a long op), a caretaker that adopts sessions whose owner died,
expires sessions idle past `session_idle_ttl_s` and unloads idle ones, and one that stores sample
answers off the decode loop. With `--metrics_port` it
serves Prometheus metrics (treadle.observability.metrics). SIGTERM is a warm shutdown: the running op
finishes, owned sessions are checkpointed and their leases released so another worker can adopt them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from celery.signals import worker_ready, worker_shutting_down

from treadle.errors import InvalidRequestError
from treadle.gpu_worker.worker_config import WorkerConfig
from treadle.queue import names
from treadle.queue.celery_app import make_app
from treadle.queue.lease import LeaseManager
from treadle.queue.connections import connect_redis
from treadle.queue.workers import ServedModel, WorkerAnnouncement, WorkerRegistry, parse_model_spec
from treadle.settings import ConnectionSettings

log = logging.getLogger("treadle.worker")


class WorkerService:
    def __init__(self, config: WorkerConfig):
        from treadle.gpu_worker.sessions.autosave import Autosaver
        from treadle.gpu_worker.executor.celery_tasks import register_tasks
        from treadle.gpu_worker.executor.failover import Failover
        from treadle.gpu_worker.sampling import logprob_audit
        from treadle.gpu_worker.sampling.hf import prefix_cache
        from treadle.gpu_worker.scheduling.fair import FairShare
        from treadle.gpu_worker.sessions.hosting import SessionHost, SessionLimits, SessionStores
        from treadle.gpu_worker.scheduling.linger import Linger
        from treadle.gpu_worker.executor.sample_requests import SamplerCache, Sampling
        from treadle.gpu_worker.executor.op_record import OpRecorder
        from treadle.gpu_worker.executor.sequencer import Sequencer
        from treadle.gpu_worker.executor.turn_scheduler import TurnMetrics, TurnScheduler
        from treadle.gpu_worker.executor.usage import UsageRecorder
        from treadle.observability import metrics  # prometheus-client: the worker extra, not every CLI
        from treadle.quotas import SessionQuota
        from treadle.storage.checkpoint_store import CheckpointStore

        self.config = config
        self.metrics = metrics
        env = ConnectionSettings()
        broker = config.broker_url or env.broker_url
        if not broker:
            raise SystemExit("no broker: pass --broker_url or set TREADLE_BROKER_URL (or use `treadle up`)")
        result = config.result_url or env.result_url or broker
        storage = config.storage_url or env.storage_url or "file://" + os.path.expanduser("~/.treadle/checkpoints")
        self.hostname = config.hostname or f"treadle-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        self.redis = connect_redis(broker)
        self.store = CheckpointStore.from_url(storage)
        served_as = {
            path: name for name, path in map(parse_model_spec, config.model)
        }  # the audit names a model by its path
        logprob_audit.configure(
            fraction=config.logprob_audit_fraction,
            observe=lambda model, gap: metrics.LOGPROB_GAP.labels(served_as.get(model, model)).observe(gap),
        )
        prefix_cache.configure(
            observe=lambda model, prefilled, reused: metrics.observe_prefill(
                served_as.get(model, model), prefilled, reused
            )
        )
        self.engines, self.served = load_engines(config)
        self.app = make_app(broker, result, task_events=config.task_events, result_expires_s=config.result_ttl_s)
        self.lease = LeaseManager(self.redis, self.hostname, ttl_ms=int(config.lease_ttl_s * 1000))
        samplers = SamplerCache(lambda model: self.host.engine(model), self.store)
        stores = SessionStores.on(self.redis, self.lease)
        self.host = SessionHost(
            hostname=self.hostname,
            engines=self.engines,
            stores=stores,
            store=self.store,
            limits=SessionLimits(
                quota=SessionQuota(self.redis, config.max_sessions_per_owner, config.owner_session_limits),
                max_queued_ops=config.max_queued_ops_per_session,
                max_owner_queued_ops=config.max_queued_ops_per_owner,
            ),
            remember_sampler=samplers.remember,
            subscribe=self._subscribe,
            unsubscribe=self._unsubscribe,
        )
        self.autosaver = Autosaver(
            self.host,
            checkpoint_every=config.checkpoint_every,
            checkpoint_interval_s=config.checkpoint_interval_s,
            journal_ops=config.checkpoint_journal_ops,
        )
        usage = UsageRecorder(self.redis)
        self.linger = Linger(self.redis, self.hostname, config.linger_ms / 1000, config.anticipate_ms / 1000)
        turns = TurnScheduler(
            self.host,
            self.linger,
            fair=FairShare(config.owner_weights),
            metrics=TurnMetrics(queue_wait=metrics.observe_queue_wait, anticipation=metrics.observe_anticipation),
        )
        recorder = OpRecorder(self.app, stores, usage, self.linger)
        sequencer = Sequencer(
            self.host, self.app, stores=stores, turns=turns, recorder=recorder, autosaver=self.autosaver
        )
        self.sequencer = sequencer
        self.failover = Failover(
            self.host,
            sequencer,
            self.autosaver,
            idle_unload_s=config.idle_unload_s,
            session_idle_ttl_s=config.session_idle_ttl_s,
        )
        # Stores the answers of sample requests off the decode loop's thread (treadle.gpu_worker.executor.celery_tasks).
        self.deliver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver")
        register_tasks(self.app, sequencer, self.host, Sampling(samplers, self.host.op_lock), usage, self.deliver)
        self.registry = WorkerRegistry(self.redis)
        self._stop = threading.Event()
        self._started_at = time.time()

    # The pool thread asks the worker's own consumer (main thread) to (un)subscribe, via remote control.
    # The reply is awaited: a lost broadcast would leave a session's queue with no consumer.
    def _subscribe(self, queue: str) -> None:
        for attempt in range(10):
            replies = self.app.control.add_consumer(queue, destination=[self.hostname], reply=True, timeout=3)
            if replies:
                return
            log.warning("no reply subscribing to %s (attempt %d); retrying", queue, attempt + 1)
        log.error("could not subscribe to %s", queue)

    def _unsubscribe(self, queue: str) -> None:
        self.app.control.cancel_consumer(queue, destination=[self.hostname], reply=False)

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
                memory=self.metrics.memory_in_use(),
            )
        )
        counts = dict.fromkeys(self.engines, 0)
        for owned in list(self.host.owned.values()):
            counts[owned.record.base_model] += 1
        for model, count in counts.items():
            self.metrics.ACTIVE_SESSIONS.labels(model).set(count)

    def _heartbeat_loop(self) -> None:
        period = min(3.0, self.config.lease_ttl_s / 3)
        while not self._stop.is_set():
            try:
                self._announce()
                for sid, owned in list(self.host.owned.items()):
                    if not self.lease.renew(sid, owned.epoch):
                        log.warning("could not renew the lease of session %s", sid)
            except Exception:  # Redis restarting: keep trying, the leases have slack
                log.warning("heartbeat failed; retrying", exc_info=True)
            self._stop.wait(period)

    def _caretaker_loop(self) -> None:
        period = min(3.0, self.config.lease_ttl_s / 3)
        while not self._stop.is_set():
            try:
                self.failover.caretaker_pass()
            except Exception:
                log.warning("caretaker pass failed; retrying", exc_info=True)
            self._stop.wait(period)

    # ------------------------------------------------------------ run
    def _publish_tokenizers(self) -> None:
        import tempfile

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
            self.metrics.start_metrics_server(
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
            for engine in self.engines.values():  # sample requests still waiting fail (and say so to their clients)
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


def load_engines(config: WorkerConfig) -> tuple[dict, list[ServedModel]]:
    """Every model of `config`, loaded (across the device group when --devices > 1) and described for the
    announcement; a model treadle cannot serve stops the worker, naming what is missing."""
    from treadle.gpu_worker.engine import Engine
    from treadle.gpu_worker.sampling.registry import SamplerOptions
    from treadle.gpu_worker.sampling.vllm.sampler import VllmOptions

    engines, served = {}, []
    group = None
    if config.devices > 1:  # the followers load their models while this process loads its own
        from treadle.gpu_worker.parallel.device_group import DeviceGroup

        group = DeviceGroup(config)
        group.spawn()
    options = VllmOptions(
        python=config.vllm_python,
        max_lora_rank=config.vllm_max_lora_rank,
        max_loras=config.vllm_max_loras,
        gpu_memory_share=config.vllm_memory_share,
        cpu_kv_cache_gib=config.vllm_cpu_kv_cache_gib,
        max_logprobs=config.vllm_max_logprobs,
    )
    for spec in config.model:
        name, path = parse_model_spec(spec)
        t0 = time.monotonic()
        try:
            engine = Engine(
                path,
                device=group.device if group else config.device,
                dtype=config.dtype,
                max_tokens_per_microbatch=config.max_tokens_per_microbatch,
                sampling_max_batch_tokens=config.sampling_max_batch_tokens,
                sampling_prefix_cache_tokens=config.sampling_prefix_cache_tokens,
                sampler=config.sampler,
                sampler_options=SamplerOptions(vllm=options, hf_decode=config.sampler_decode),
            )
        except (InvalidRequestError, ValueError) as exc:  # a model treadle cannot serve: say what, and stop
            raise SystemExit(f"treadle worker: cannot serve {name} ({path}): {exc}") from exc
        engines[name] = engine
        served.append(
            ServedModel(
                name=name,
                path=path,
                max_seq_len=engine.max_seq_len,
                vocab_size=engine.vocab_size,
                family=engine.profile.family,
                dtype=engine.profile.dtype,
                sampler=engine.sampler.path,
            )
        )
        log.info(
            "loaded %s from %s in %.1f s (%s, micro-batches of %d tokens)",
            name,
            path,
            time.monotonic() - t0,
            engine.profile.dtype,
            engine.max_tokens_per_microbatch,
        )
    return (group.join(engines) if group else engines), served


def run_worker(config: WorkerConfig) -> None:
    logging.basicConfig(level=config.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    WorkerService(config).run()
