"""Prometheus metrics of a worker, served by `start_metrics_server` (text format on GET /metrics).

Counters only grow; rates are the scraper's job: tokens/s by kind is
`rate(treadle_tokens_total[1m])`, ops/s `rate(treadle_ops_total[1m])`, p99 op latency
`histogram_quantile(0.99, rate(treadle_op_seconds_bucket[5m]))`. Labels of what accumulates (counters,
histograms) are bounded sets: op names, base models, token kinds, outcomes, and owners (the gateway's
configured API keys, plus `sdk`), never session ids, whose number has no bound (per-session usage is
metering's job, `treadle.metering`). Queue depths are read from Redis at each scrape, so they are current
even when no op runs; the per-session ones (`treadle_session_queued_ops`, `treadle_session_queue_wait_seconds`)
exist only while their session is active, so their series end with it.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from treadle.metering import SDK_OWNER, OpUsage
from treadle.queue import names
from treadle.queue.sessions import SessionRegistry
from treadle.queue.workers import WorkerRegistry
from treadle.status import queue_depth

REGISTRY = CollectorRegistry()
# From a 1 ms no-op to a 10-minute GRPO step.
_OP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

OP_SECONDS = Histogram(
    "treadle_op_seconds",
    "Seconds an op ran on the worker.",
    ["op", "base_model"],
    buckets=_OP_BUCKETS,
    registry=REGISTRY,
)
OPS = Counter(
    "treadle_ops",
    "Ops run, by outcome (ok | user_error | server_error).",
    ["op", "base_model", "outcome"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "treadle_tokens",
    "Tokens processed, by kind (prefill | sampled | trained).",
    ["kind", "base_model"],
    registry=REGISTRY,
)
ACTIVE_SESSIONS = Gauge(
    "treadle_active_sessions", "Sessions this worker owns (loaded or unloaded).", ["base_model"], registry=REGISTRY
)
LEASE_TAKEOVERS = Counter(
    "treadle_lease_takeovers", "Sessions this worker adopted from a dead worker.", ["base_model"], registry=REGISTRY
)
QUEUE_WAIT_SECONDS = Histogram(
    "treadle_op_queue_seconds",
    "Seconds an op waited from its submit to its start on the worker.",
    ["owner", "base_model"],
    buckets=_OP_BUCKETS,
    registry=REGISTRY,
)
ANTICIPATIONS = Counter(
    "treadle_anticipation_waits",
    "Waits for a session's next op while others had ops ready, by outcome "
    "(op: it came | control: a sample or a create ended it | none: the window passed).",
    ["base_model", "outcome"],
    registry=REGISTRY,
)
ANTICIPATION_SECONDS = Counter(
    "treadle_anticipation_seconds",
    "Seconds the device was held idle for those waits (charged to the awaited sessions).",
    ["base_model"],
    registry=REGISTRY,
)
LOGPROB_GAP = Histogram(
    "treadle_sampler_logprob_gap",
    "Mean absolute gap (nats per token) between the sampler's logprobs "
    "of a sampled sequence and the training forward's on the same snapshot (a sampled fraction).",
    ["base_model"],
    buckets=(1e-5, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3),
    registry=REGISTRY,
)
PREFILL_TOKENS = Counter(
    "treadle_sampler_prefill_tokens",
    "Prompt tokens the hf sampler ran through a prefill forward.",
    ["base_model"],
    registry=REGISTRY,
)
PREFIX_REUSED_TOKENS = Counter(
    "treadle_sampler_prefix_reused_tokens",
    "Prompt tokens the hf sampler served from kept KV instead (an earlier request's prompt or answer on the same "
    "snapshot, or an equal prompt admitted with it).",
    ["base_model"],
    registry=REGISTRY,
)
CHECKPOINT_SECONDS = Histogram(
    "treadle_checkpoint_seconds",
    "Seconds to write one checkpoint (auto | state | sampler).",
    ["kind"],
    buckets=_OP_BUCKETS,
    registry=REGISTRY,
)
CHECKPOINT_BYTES = Counter(
    "treadle_checkpoint_bytes", "Bytes of checkpoints written (auto | state | sampler).", ["kind"], registry=REGISTRY
)


def memory_in_use() -> dict[str, int]:
    """Bytes this process holds: its resident set, and what torch allocated on each CUDA device."""
    with open("/proc/self/statm") as f:
        memory = {"rss": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}
    torch = sys.modules.get("torch")  # only a worker has it loaded; never import it here
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            memory[f"cuda:{index}"] = int(torch.cuda.memory_allocated(index))
    return memory


def observe_op(op: str, base_model: str, seconds: float, outcome: str = "ok", usage: OpUsage | None = None) -> None:
    """One finished op: its latency, its outcome and the tokens it processed."""
    OP_SECONDS.labels(op, base_model).observe(seconds)
    OPS.labels(op, base_model, outcome).inc()
    if usage is not None:
        for kind in ("prefill", "sampled", "trained"):
            count = getattr(usage, f"{kind}_tokens")
            if count:
                TOKENS.labels(kind, base_model).inc(count)


def observe_queue_wait(owner: str, base_model: str, seconds: float) -> None:
    QUEUE_WAIT_SECONDS.labels(owner, base_model).observe(seconds)


def observe_anticipation(base_model: str, outcome: str | None, seconds: float) -> None:
    ANTICIPATIONS.labels(base_model, outcome or "none").inc()
    ANTICIPATION_SECONDS.labels(base_model).inc(seconds)


def observe_prefill(base_model: str, prefilled: int, reused: int) -> None:
    """One admission of sample requests: prompt tokens prefilled, and prompt tokens served from kept KV."""
    PREFILL_TOKENS.labels(base_model).inc(prefilled)
    PREFIX_REUSED_TOKENS.labels(base_model).inc(reused)


def observe_checkpoint(kind: str, seconds: float, size_bytes: int) -> None:
    CHECKPOINT_SECONDS.labels(kind).observe(seconds)
    CHECKPOINT_BYTES.labels(kind).inc(size_bytes)


def _queue_depths(redis, models: Iterable[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "treadle_queue_depth", "Messages waiting on a base model's control queue.", labels=["base_model"]
    )
    for model in sorted(models):
        family.add_metric([model], queue_depth(redis, names.model_queue(model)))
    return family


def _session_queues(redis, session_ids: Iterable[str]) -> list[GaugeMetricFamily]:
    """Per active session: ops queued and the estimated wait of its next op (as its worker last decided)."""
    ids = sorted(session_ids)
    with redis.pipeline(transaction=False) as pipe:
        for sid in ids:
            pipe.hmget(names.session_key(sid), "status", "owner", "base_model", "next_seq", "applied", "queue_wait_s")
        rows = pipe.execute()
    labels = ["session", "owner", "base_model"]
    queued = GaugeMetricFamily(
        "treadle_session_queued_ops", "Ops a session has submitted and not yet run.", labels=labels
    )
    waits = GaugeMetricFamily(
        "treadle_session_queue_wait_seconds",
        "Estimated seconds until a session's next queued op "
        "starts (0: none queued), from the measured costs of the ops ahead of it.",
        labels=labels,
    )
    for sid, (status, owner, model, next_seq, applied, wait_s) in zip(ids, rows):
        if status != b"active":
            continue
        depth = max(0, int(next_seq or 0) - int(applied or 0))
        label = [sid, (owner or b"").decode() or SDK_OWNER, (model or b"").decode()]
        queued.add_metric(label, depth)
        waits.add_metric(label, float(wait_s or 0) if depth else 0.0)
    return [queued, waits]


class QueueDepthCollector:
    """`treadle_queue_depth{base_model}` of the models a worker serves, and the queues of the sessions it owns
    (`owned()`: their ids), read from Redis at each scrape; with `device_seconds(session_id, base_model)`, the
    device time each owned session has had on this worker."""

    def __init__(self, redis, models: Iterable[str], owned=lambda: (), device_seconds=None):
        self.redis = redis
        self.models = list(models)
        self.owned = owned
        self.device_seconds = device_seconds

    def collect(self):
        yield _queue_depths(self.redis, self.models)
        queued, waits = _session_queues(self.redis, self.owned())
        yield from (queued, waits)
        device = GaugeMetricFamily(
            "treadle_session_device_seconds",
            "Seconds of device time this worker has charged to a session it owns: its training ops, its rows' "
            "share of the decode steps they ran in, and the device's idle waits for its next op.",
            labels=["session", "owner", "base_model"],
        )
        if self.device_seconds is not None:
            for sample in queued.samples:  # the active owned sessions, labelled as their queue gauges
                labels = sample.labels
                device.add_metric(
                    [labels["session"], labels["owner"], labels["base_model"]],
                    self.device_seconds(labels["session"], labels["base_model"]),
                )
        yield device


class DeploymentCollector:
    """What the whole deployment has, read at each scrape: the queue depth of every served model, the live
    workers, the active sessions per base model (the gateway exports these; every instance sees the same).

    `redis_fn` is called at each scrape, so the collector can be registered before the process connects.
    """

    def __init__(self, redis_fn):
        self.redis_fn = redis_fn

    def collect(self):
        redis = self.redis_fn()
        workers = WorkerRegistry(redis).live_workers()
        counts = dict.fromkeys((m.name for w in workers for m in w.models), 0)
        active = []
        for record in SessionRegistry(redis).all():
            if record.status == "active":
                counts[record.base_model] = counts.get(record.base_model, 0) + 1
                active.append(record.session_id)
        yield _queue_depths(redis, counts)
        yield from _session_queues(redis, active)
        yield GaugeMetricFamily("treadle_deployment_workers", "Workers with a current heartbeat.", value=len(workers))
        sessions = GaugeMetricFamily(
            "treadle_deployment_active_sessions", "Active sessions, by base model.", labels=["base_model"]
        )
        for model, count in sorted(counts.items()):
            sessions.add_metric([model], count)
        yield sessions


def start_metrics_server(
    port: int,
    addr: str = "0.0.0.0",
    *,
    redis=None,
    models: Iterable[str] = (),
    owned=lambda: (),
    device_seconds=None,
):
    """Serve REGISTRY (plus the queue depths of `models` and the queues and device time of the sessions `owned()`
    names, when a Redis client is given; see `QueueDepthCollector`) on addr:port."""
    if redis is not None:
        REGISTRY.register(QueueDepthCollector(redis, models, owned, device_seconds))
    return start_http_server(port, addr, registry=REGISTRY)
