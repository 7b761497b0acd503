"""Wiring a worker: `build_worker(config)` makes every part of the process and connects them, in the order
each needs the others; `run_worker` is `treadle worker`.

What the parts do is theirs to say (treadle.gpu_worker.worker_main for the process itself); this module only
decides which instance each is given. Every part exists before it is handed to another.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from redis import Redis

from treadle.errors import InvalidRequestError
from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.executor.celery_tasks import register_tasks
from treadle.gpu_worker.executor.control_ops import ControlOps
from treadle.gpu_worker.executor.failover import Failover
from treadle.gpu_worker.executor.op_record import OpRecorder
from treadle.gpu_worker.executor.sample_requests import SamplerCache, Sampling
from treadle.gpu_worker.executor.sample_stream import SampleStreams
from treadle.gpu_worker.executor.sequencer import Sequencer
from treadle.gpu_worker.executor.turn_scheduler import TurnMetrics, TurnScheduler
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.gpu_worker.parallel.device_group import DeviceGroup, node_main
from treadle.gpu_worker.sampling import logprob_audit
from treadle.gpu_worker.sampling.hf import prefix_cache
from treadle.gpu_worker.sampling.registry import SamplerOptions
from treadle.gpu_worker.sampling.vllm.sampler import VllmOptions
from treadle.gpu_worker.scheduling.fair import FairShare
from treadle.gpu_worker.scheduling.linger import Linger
from treadle.gpu_worker.sessions.autosave import Autosaver
from treadle.gpu_worker.sessions.hosting import SessionHost, SessionLimits, SessionStores, engine_of
from treadle.gpu_worker.worker_config import WorkerConfig
from treadle.gpu_worker.worker_main import Consumers, WorkerService
from treadle.observability import metrics
from treadle.queue.celery_app import make_app
from treadle.queue.connections import connect_redis
from treadle.queue.control_requests import ControlRequests
from treadle.queue.ops import CreateSessionRequest, SampleRequest
from treadle.queue.results import ResultStore
from treadle.queue.lease import LeaseManager
from treadle.queue.workers import ServedModel, WorkerRegistry, parse_model_spec
from treadle.quotas import SessionQuota
from treadle.settings import ConnectionSettings
from treadle.storage.checkpoint_store import CheckpointStore

log = logging.getLogger("treadle.worker")

TURN_METRICS = TurnMetrics(queue_wait=metrics.observe_queue_wait, anticipation=metrics.observe_anticipation)


def run_worker(config: WorkerConfig) -> None:
    logging.basicConfig(level=config.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.shard and config.devices * config.nnodes == 1:
        raise SystemExit("treadle worker: --shard needs a group of several ranks (--devices N, --nnodes M)")
    if config.node_rank >= config.nnodes:
        raise SystemExit(f"treadle worker: --node_rank {config.node_rank} is not below --nnodes {config.nnodes}")
    if config.node_rank > 0:  # a host of the group's other ranks: no Celery consumer here
        node_main(config)
        return
    build_worker(config).run()


def build_worker(config: WorkerConfig) -> WorkerService:
    """Every part of a worker process, connected; `run()` on the result starts it."""
    urls = _Urls.of(config)
    hostname = config.hostname or f"treadle-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    redis = connect_redis(urls.broker)
    store = CheckpointStore.from_url(urls.storage)
    _sampler_metrics(config)
    engines, served = load_engines(config)
    app = make_app(urls.broker, urls.result, task_events=config.task_events, result_expires_s=config.result_ttl_s)
    lease = LeaseManager(redis, hostname, ttl_ms=int(config.lease_ttl_s * 1000))
    stores = SessionStores.on(redis, lease)
    # The sampler cache and the host find an engine the same way; the host remembers the snapshots it saves.
    samplers = SamplerCache(functools.partial(engine_of, engines, hostname), store)
    consumers = Consumers(app, hostname)
    host = SessionHost(
        hostname=hostname,
        engines=engines,
        stores=stores,
        store=store,
        limits=_limits(config, redis),
        remember_sampler=samplers.remember,
        subscribe=consumers.subscribe,
        unsubscribe=consumers.unsubscribe,
    )
    autosaver = _autosaver(config, host)
    usage = UsageRecorder(redis)
    linger = Linger(redis, hostname, config.linger_ms / 1000, config.anticipate_ms / 1000)
    turns = TurnScheduler(host, linger, fair=FairShare(config.owner_weights), metrics=TURN_METRICS)
    recorder = OpRecorder(app, stores, usage, linger)
    sequencer = Sequencer(
        host,
        app,
        stores=stores,
        turns=turns,
        recorder=recorder,
        autosaver=autosaver,
        max_crashes=config.max_request_crashes,
    )
    failover = Failover(
        host,
        sequencer,
        autosaver,
        idle_unload_s=config.idle_unload_s,
        session_idle_ttl_s=config.session_idle_ttl_s,
    )
    deliver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-deliver")
    results = ResultStore(app)
    control = ControlOps(
        ControlRequests(redis, hostname, ttl_ms=lease.ttl_ms),
        {
            CreateSessionRequest: host.create,
            SampleRequest: Sampling(samplers, host.op_lock, SampleStreams(redis)).sample,
        },
        models=list(engines),
        registry=host.registry,
        usage=usage,
        results=results,
        deliver=deliver,
        one_write=results.in_redis(urls.broker),
        rerun={CreateSessionRequest: failover.resume_create},
        max_crashes=config.max_request_crashes,
    )
    register_tasks(app, sequencer, control)
    return WorkerService(
        config=config,
        hostname=hostname,
        redis=redis,
        app=app,
        engines=engines,
        served=served,
        host=host,
        lease=lease,
        autosaver=autosaver,
        linger=linger,
        failover=failover,
        control=control,
        registry=WorkerRegistry(redis),
        deliver=deliver,
    )


@dataclass(frozen=True)
class _Urls:
    broker: str
    result: str
    storage: str

    @classmethod
    def of(cls, config: WorkerConfig) -> _Urls:
        """The options first, then the environment (TREADLE_*); the result backend defaults to the broker."""
        env = ConnectionSettings()
        broker = config.broker_url or env.broker_url
        if not broker:
            raise SystemExit("no broker: pass --broker_url or set TREADLE_BROKER_URL (or use `treadle up`)")
        result = config.result_url or env.result_url or broker
        storage = config.storage_url or env.storage_url or "file://" + os.path.expanduser("~/.treadle/checkpoints")
        return cls(broker=broker, result=result, storage=storage)


def _autosaver(config: WorkerConfig, host: SessionHost) -> Autosaver:
    return Autosaver(
        host,
        checkpoint_every=config.checkpoint_every,
        checkpoint_interval_s=config.checkpoint_interval_s,
        journal_ops=config.checkpoint_journal_ops,
    )


def _sampler_metrics(config: WorkerConfig) -> None:
    """The logprob audit's and the prefix cache's metrics, by served name (they name a model by its path)."""
    served_as = {path: name for name, path in map(parse_model_spec, config.model)}
    logprob_audit.configure(
        fraction=config.logprob_audit_fraction,
        observe=lambda model, gap: metrics.LOGPROB_GAP.labels(served_as.get(model, model)).observe(gap),
    )
    prefix_cache.configure(
        observe=lambda model, prefilled, reused: metrics.observe_prefill(served_as.get(model, model), prefilled, reused)
    )


def _limits(config: WorkerConfig, redis: Redis) -> SessionLimits:
    return SessionLimits(
        quota=SessionQuota(
            redis,
            config.max_sessions_per_owner,
            config.owner_session_limits,
            memory_limit=config.full_session_memory_per_owner,
        ),
        max_queued_ops=config.max_queued_ops_per_session,
        max_owner_queued_ops=config.max_queued_ops_per_owner,
    )


def load_engines(config: WorkerConfig) -> tuple[dict[str, Engine], list[ServedModel]]:
    """Every model of `config`, loaded (across the device group when --devices > 1) and described for the
    announcement; a model treadle cannot serve stops the worker, naming what is missing."""
    engines, served = {}, []
    group = None
    if config.devices * config.nnodes > 1:  # the followers load their models while this process loads its own
        group = DeviceGroup(config)
        group.spawn()
        if config.shard:  # sharding a model is collective: the group must exist before any model loads
            group.join_group()
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
                activation_checkpointing=config.activation_checkpointing,
                sampling_max_batch_tokens=config.sampling_max_batch_tokens,
                sampling_prefix_cache_tokens=config.sampling_prefix_cache_tokens,
                # A sharded model's forwards gather weights through hooks: the hf sampler's eager steps, nothing
                # compiled, no vLLM (which would need the whole model).
                sampler="hf" if config.shard else config.sampler,
                sampler_options=SamplerOptions(
                    vllm=options,
                    hf_decode="dynamic" if config.shard else config.sampler_decode,
                    hf_deterministic_rows=config.sampler_deterministic_rows,
                ),
                shard=config.shard,
                max_image_pixels=config.max_image_pixels,
                full_session_memory=config.full_session_memory,
            )
        except (InvalidRequestError, ValueError) as exc:  # a model treadle cannot serve: say what, and stop
            raise SystemExit(f"treadle worker: cannot serve {name} ({path}): {exc}") from exc
        engines[name] = engine
        served.append(_served(name, path, engine))
        log.info(
            "loaded %s from %s in %.1f s (%s, micro-batches of %d tokens)",
            name,
            path,
            time.monotonic() - t0,
            engine.profile.dtype,
            engine.max_tokens_per_microbatch,
        )
    return (group.join(engines) if group else engines), served


def _served(name: str, path: str, engine: Engine) -> ServedModel:
    return ServedModel(
        name=name,
        path=path,
        max_seq_len=engine.max_seq_len,
        vocab_size=engine.vocab_size,
        family=engine.profile.family,
        dtype=engine.profile.dtype,
        sampler=engine.samplers.backend.path,
        inputs=engine.profile.inputs,
    )
