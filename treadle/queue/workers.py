"""The worker registry: each live worker announces the base models it serves, with a short TTL."""

from __future__ import annotations


from pydantic import BaseModel

from treadle.queue import names

HEARTBEAT_TTL_S = 15


class ServedModel(BaseModel):
    name: str
    path: str
    max_seq_len: int
    vocab_size: int
    family: str | None = None  # transformers' model_type (None: announced by an older worker)
    dtype: str | None = None
    sampler: str | None = None  # how the worker's sampler serves it (`model_profile`)
    inputs: list[str] = ["text"]  # what it reads: text, and vision for a vision-language model
    workers: list[str] = []


class WorkerAnnouncement(BaseModel):
    hostname: str
    pid: int
    models: list[ServedModel]
    started_at: float
    sessions: list[str] = []
    unloaded: list[str] = []
    memory: dict[str, int] = {}  # bytes in use: "rss", and "cuda:<i>" per device the worker allocated on


class WorkerRegistry:
    def __init__(self, redis):
        self.redis = redis

    def announce(self, info: WorkerAnnouncement) -> None:
        self.redis.set(names.worker_key(info.hostname), info.model_dump_json(), ex=HEARTBEAT_TTL_S)

    def withdraw(self, hostname: str) -> None:
        self.redis.delete(names.worker_key(hostname))

    def live_workers(self) -> list[WorkerAnnouncement]:
        keys = list(self.redis.scan_iter(names.WORKER_PATTERN, count=500))
        if not keys:
            return []
        return [WorkerAnnouncement.model_validate_json(v) for v in self.redis.mget(keys) if v]

    def served_models(self) -> list[ServedModel]:
        models: dict[str, ServedModel] = {}
        for worker in self.live_workers():
            for m in worker.models:
                entry = models.setdefault(m.name, m.model_copy(update={"workers": []}))
                entry.workers.append(worker.hostname)
        return sorted(models.values(), key=lambda m: m.name)

    def is_alive(self, hostname: str) -> bool:
        return bool(self.redis.exists(names.worker_key(hostname)))


def parse_model_spec(spec: str) -> tuple[str, str]:
    """`NAME=DIR` -> (NAME, DIR); a bare id or dir is served under its own name."""
    if "=" in spec:
        name, path = spec.split("=", 1)
        return name, path
    return spec, spec
