"""`treadle status`: workers, sessions and queue depths of a deployment, read (only read) from its Redis.

A worker is alive while its heartbeat key exists (it renews it every few seconds); a worker that an
active session still names but that no longer announces itself is listed as dead: its sessions wait
for another worker to adopt them. Queue depth is the number of messages waiting in Redis (all of
Celery's priority lists of the queue), not counting the one a worker is running.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from treadle.metering import Meter, Usage
from treadle.queue import names
from treadle.queue.sessions import SessionRecord, SessionRegistry
from treadle.queue.workers import WorkerRegistry

# kombu's Redis transport keeps one list per priority step; priority 0 is the queue's own name.
_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")


class WorkerStatus(BaseModel):
    hostname: str = Field(description="Celery node name.")
    alive: bool = Field(description="Its heartbeat is current.")
    pid: int | None = Field(default=None, description="Process id on its host.")
    models: list[str] = Field(default_factory=list, description="Base models it serves.")
    sessions: list[str] = Field(default_factory=list, description="Sessions it owns.")
    unloaded: list[str] = Field(
        default_factory=list, description="Owned sessions checkpointed and unloaded while idle."
    )
    uptime_s: float | None = Field(default=None, description="Seconds since it started.")
    memory: dict[str, int] = Field(
        default_factory=dict, description="Bytes in use as the worker reports them (rss, device)."
    )


class SessionStatus(BaseModel):
    session_id: str
    owner: str | None = Field(description="Gateway owner; None for sessions of the treadle SDK.")
    base_model: str
    status: str = Field(description="active | stopped | expired")
    worker: str | None = Field(description="The worker holding its lease.")
    applied: int = Field(description="Highest seq applied.")
    step: int = Field(
        description="Optimizer steps of the session's weights, as its worker last recorded them (a "
        "session created from a checkpoint goes on from the checkpoint's step)."
    )
    submitted: int = Field(description="Highest seq submitted.")
    queued_ops: int = Field(description="Ops submitted and not yet applied.")
    queue_position: int | None = Field(
        default=None,
        description="Its next op's place in its worker's line (1: next, or "
        "running), as the worker last decided; None when nothing is queued.",
    )
    est_wait_s: float | None = Field(
        default=None,
        description="Estimated seconds until its next op starts, from the "
        "measured costs of the ops ahead of it; None when nothing is queued.",
    )
    op_cost_s: float = Field(default=0.0, description="Average device seconds of its recent ops.")
    last_op: str | None = Field(default=None, description="Name of the last op metered.")
    last_activity: float = Field(description="Unix time of its last op.")
    idle_s: float = Field(description="Seconds since then.")
    last_checkpoint: str | None = Field(description="Its latest automatic checkpoint.")
    checkpoint_seq: int = Field(description="The seq that checkpoint covers.")
    usage: Usage = Field(description="What its ops consumed.")
    kind: str = Field(default="lora", description="lora | full (a full fine-tuning session).")
    memory_bytes: int = Field(
        default=0, description="Device bytes its trained weights hold (weights, gradients, AdamW moments)."
    )


class ModelStatus(BaseModel):
    name: str
    family: str | None = Field(description="transformers' model_type; None if its workers predate the field.")
    dtype: str | None = Field(description="Weights' dtype on the worker.")
    sampler: str | None = Field(description="The sampler path the worker chose for it at load.")
    workers: list[str] = Field(description="Live workers serving it.")


class QueueDepth(BaseModel):
    queue: str
    depth: int


class StatusReport(BaseModel):
    at: float = Field(description="When this was read (Unix time).")
    workers: list[WorkerStatus]
    models: list[ModelStatus] = Field(default_factory=list)
    sessions: list[SessionStatus]
    queues: list[QueueDepth]


def queue_depth(redis, queue: str) -> int:
    with redis.pipeline(transaction=False) as pipe:
        for suffix in _PRIORITY_SUFFIXES:
            pipe.llen(queue + suffix)
        return sum(pipe.execute())


def collect_status(redis, include_stopped: bool = False) -> StatusReport:
    now = time.time()
    meter = Meter(redis)
    workers = _live_workers(redis, now)
    sessions = []
    for record in sorted(SessionRegistry(redis).all(), key=lambda r: r.created_at):
        if record.status != "active" and not include_stopped:
            continue
        if record.status == "active" and record.worker and record.worker not in workers:
            workers[record.worker] = WorkerStatus(hostname=record.worker, alive=False)
        sessions.append(_session_status(redis, meter, record, now))
    models = sorted({m for w in workers.values() for m in w.models} | {s.base_model for s in sessions})
    queues = [names.model_queue(m) for m in models] + [
        names.session_queue(s.session_id) for s in sessions if s.status == "active"
    ]
    served = [
        ModelStatus(name=m.name, family=m.family, dtype=m.dtype, sampler=m.sampler, workers=m.workers)
        for m in WorkerRegistry(redis).served_models()
    ]
    return StatusReport(
        at=now,
        workers=sorted(workers.values(), key=lambda w: w.hostname),
        models=served,
        sessions=sessions,
        queues=[QueueDepth(queue=q, depth=queue_depth(redis, q)) for q in queues],
    )


def _live_workers(redis, now: float) -> dict[str, WorkerStatus]:
    """The workers whose heartbeat is current, by hostname."""
    return {
        w.hostname: WorkerStatus(
            hostname=w.hostname,
            alive=True,
            pid=w.pid,
            models=[m.name for m in w.models],
            sessions=w.sessions,
            unloaded=w.unloaded,
            uptime_s=now - w.started_at,
            memory=w.memory,
        )
        for w in WorkerRegistry(redis).live_workers()
    }


def _session_status(redis, meter: Meter, record: SessionRecord, now: float) -> SessionStatus:
    submitted = int(redis.hget(names.session_key(record.session_id), "next_seq") or 0)
    ops = meter.session_ops(record.session_id)
    return SessionStatus(
        session_id=record.session_id,
        owner=record.owner,
        base_model=record.base_model,
        status=record.status,
        worker=record.worker,
        applied=record.applied,
        step=record.step,
        submitted=max(submitted, record.applied),
        queued_ops=max(0, submitted - record.applied),
        last_op=ops[-1].op if ops else None,
        queue_position=record.queue_position or None if submitted > record.applied else None,
        est_wait_s=record.queue_wait_s if submitted > record.applied else None,
        op_cost_s=record.op_cost_s,
        last_activity=record.last_activity,
        idle_s=max(0.0, now - record.last_activity),
        last_checkpoint=record.checkpoint,
        checkpoint_seq=record.checkpoint_seq,
        usage=meter.session_usage(record.session_id),
        kind="lora" if record.full is None else "full",
        memory_bytes=record.memory_bytes,
    )


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _bytes(memory: dict[str, int]) -> str:
    return " ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in sorted(memory.items())) or "-"


def render(report: StatusReport) -> str:
    """The report as four plain-text tables."""
    lines = [f"workers ({sum(w.alive for w in report.workers)} alive)"]
    lines += _workers_table(report.workers)
    lines += ["", f"models ({len(report.models)})"]
    lines += _table(
        ["MODEL", "FAMILY", "DTYPE", "SAMPLER", "WORKERS"],
        [[m.name, m.family or "-", m.dtype or "-", m.sampler or "-", str(len(m.workers))] for m in report.models],
    )
    lines += ["", f"sessions ({len(report.sessions)})"]
    lines += _sessions_table(report.sessions)
    lines += ["", "queues"]
    lines += _table(["QUEUE", "DEPTH"], [[q.queue, str(q.depth)] for q in report.queues])
    return "\n".join(lines)


def _workers_table(workers: list[WorkerStatus]) -> list[str]:
    return _table(
        ["HOSTNAME", "ALIVE", "MODELS", "SESSIONS", "UNLOADED", "UPTIME", "MEMORY"],
        [
            [
                w.hostname,
                "yes" if w.alive else "NO",
                ",".join(w.models) or "-",
                str(len(w.sessions)),
                str(len(w.unloaded)),
                _ago(w.uptime_s),
                _bytes(w.memory),
            ]
            for w in workers
        ],
    )


_SESSION_COLUMNS = [
    "SESSION",
    "OWNER",
    "MODEL",
    "KIND",
    "MEMORY",
    "STATUS",
    "WORKER",
    "APPLIED",
    "STEP",
    "QUEUED",
    "POSITION",
    "EST WAIT",
    "OP COST",
    "LAST OP",
    "IDLE",
    "TRAINED TOK",
    "LAST CHECKPOINT",
]


def _sessions_table(sessions: list[SessionStatus]) -> list[str]:
    return _table(
        _SESSION_COLUMNS,
        [
            [
                s.session_id,
                s.owner or "(sdk)",
                s.base_model,
                s.kind,
                _bytes({"": s.memory_bytes}).removeprefix("=") if s.memory_bytes else "-",
                s.status,
                s.worker or "-",
                str(s.applied),
                str(s.step),
                str(s.queued_ops),
                str(s.queue_position or "-"),
                "-" if s.est_wait_s is None else f"{s.est_wait_s:.2f}s",
                f"{s.op_cost_s * 1000:.0f}ms" if s.op_cost_s else "-",
                s.last_op or "-",
                _ago(s.idle_s),
                str(s.usage.trained_tokens),
                f"{s.last_checkpoint} (seq {s.checkpoint_seq})" if s.last_checkpoint else "-",
            ]
            for s in sessions
        ],
    )
