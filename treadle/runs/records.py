"""Durable batch-run records in Redis, and the lease a runner holds on each run it supervises.

A run is one Redis hash, `treadle:brun:<name>`: the field `spec` holds what `treadle runs submit`
recorded (command, working directory, environment, restart policy) and never changes; every other
field is one status value, JSON-encoded, so that a runner's updates and a user's stop request touch
different fields and never overwrite each other. `treadle:bruns` (a sorted set, by submit time) lists
every run; `treadle:bruns:open` holds the names of runs not yet finished, which runners scan.

A runner supervises a run while it holds `treadle:brun-lease:<name>` (SET NX PX, renewed by a
background thread). Each claim bumps the run's `epoch`, and every status write of a runner is fenced
by a Lua script that first checks the lease still holds `<runner>:<epoch>`: a runner that was paused
past its lease can never write over the runner that adopted the run.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from treadle.errors import InvalidRequestError, UserError
from treadle.queue import names
from treadle.storage.paths import validate_name

RunState = Literal["queued", "running", "restarting", "succeeded", "failed", "stopped"]
TERMINAL_STATES = ("succeeded", "failed", "stopped")
INDEX_KEY = names.BATCH_RUNS_KEY
OPEN_KEY = names.OPEN_BATCH_RUNS_KEY
LEASE_TTL_MS = 15_000


run_key = names.batch_run_key
lease_key = names.batch_run_lease_key


class RunNotFoundError(UserError):
    """No batch run of that name was ever submitted."""


class RunExistsError(UserError):
    """A batch run of that name exists already; names are unique for good."""


class RunSpec(BaseModel):
    """What a run is: recorded once at submit, read by whichever runner starts it."""

    name: str = Field(description="Unique name of the run: 1-128 of [A-Za-z0-9._-].")
    command: list[str] = Field(min_length=1, description="argv of the command; the first item is looked up on PATH.")
    cwd: str = Field(description="Working directory the command starts in.")
    env: dict[str, str] = Field(default_factory=dict, description="The whole environment of the command.")
    resume_args: list[str] = Field(default_factory=list, description="Appended to argv on every start after the first.")
    max_restarts: int = Field(
        default=5, ge=0, le=1000, description="Restarts after a non-zero exit before the run fails."
    )
    backoff_s: float = Field(
        default=5.0, ge=0.0, le=3600.0, description="Wait before restart n: backoff_s * 2**(n-1) ..."
    )
    backoff_max_s: float = Field(default=300.0, ge=0.0, le=86400.0, description="... but never more than this.")
    log_dir: str | None = Field(
        default=None, description="Directory of the run's metrics.jsonl / checkpoints.jsonl, if any."
    )
    stall_s: float = Field(
        default=1800.0,
        ge=0.0,
        le=7 * 86400.0,
        description="Restart the command, as after a crash, when its loop has had no op answered for this long "
        "(0: never). Watched from the attempt's first answered op, which the treadle SDK reports.",
    )
    created_at: float = Field(default_factory=time.time, description="Submit time (Unix seconds).")

    def backoff(self, restart: int) -> float:
        """Seconds to wait before restart number `restart` (1-based): exponential, capped."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** (restart - 1))


class RunStatus(BaseModel):
    """Where a run stands; written by the runner that holds its lease (and by `stop` on an idle run)."""

    state: RunState = "queued"
    restarts: int = Field(default=0, description="Restarts after a failed exit so far (adoptions do not count).")
    adoptions: int = Field(
        default=0, description="Times a runner took the run over from a runner that died or stopped."
    )
    attempt: int = Field(default=0, description="Starts of the command so far; its log segments are numbered by it.")
    last_exit_code: int | None = Field(
        default=None, description="Exit code of the last attempt (-N: killed by signal N)."
    )
    epoch: int = Field(default=0, description="Fencing epoch: bumped by every claim of the run's lease.")
    runner: str | None = Field(default=None, description="The runner that supervises (or last supervised) the run.")
    host: str | None = None
    pid: int | None = Field(default=None, description="pid (and process-group id) of the running attempt.")
    pid_start: str | None = Field(
        default=None, description="Start time of that pid per /proc, to tell it from a reused pid."
    )
    started_at: float | None = None
    finished_at: float | None = None
    next_start_at: float | None = Field(default=None, description="When a restarting run starts again (Unix seconds).")
    stop_requested: bool = False
    message: str = ""
    last_lines: list[str] = Field(default_factory=list, description="The last lines of output of the last attempt.")
    last_metrics: dict[str, Any] | None = Field(default=None, description="The last line of the run's metrics.jsonl.")
    checkpoints: list[dict[str, Any]] = Field(
        default_factory=list, description="Last entries of its checkpoints.jsonl."
    )
    log_url: str | None = Field(default=None, description="Blob store that holds the run's log segments.")


class RunRecord(BaseModel):
    spec: RunSpec
    status: RunStatus

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def finished(self) -> bool:
        return self.status.state in TERMINAL_STATES


# KEYS[1] lease, KEYS[2] run hash, KEYS[3] open set; ARGV[1] expected token, ARGV[2] "release" or "",
# ARGV[3] "close" (the run finished: drop it from the open set) or "", then field/value pairs.
_FENCED_UPDATE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == 'close' then redis.call('SREM', KEYS[3], redis.call('HGET', KEYS[2], 'name')) end
if ARGV[2] == 'release' then redis.call('DEL', KEYS[1]) end
return 1
"""
# KEYS: lease keys; ARGV[i]: the token expected under KEYS[i]; ARGV[#KEYS + 1]: the TTL in ms.
_RENEW_ALL = """
local held = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then redis.call('PEXPIRE', key, ARGV[#KEYS + 1]); held[i] = 1 else held[i] = 0 end
end
return held
"""


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RunStore:
    """Submit, read and update batch runs; claim, renew and release their leases."""

    def __init__(self, redis, ttl_ms: int = LEASE_TTL_MS):
        self.redis = redis
        self.ttl_ms = ttl_ms
        self._update = redis.register_script(_FENCED_UPDATE)
        self._renew = redis.register_script(_RENEW_ALL)

    # ------------------------------------------------------------ records
    def submit(self, spec: RunSpec) -> RunRecord:
        validate_name(spec.name, "name")
        if not self.redis.hsetnx(run_key(spec.name), "spec", spec.model_dump_json()):
            existing = self.get(spec.name)
            raise RunExistsError(
                f"a run named {spec.name!r} exists already (state {existing.status.state}); pick another --name"
            )
        status = RunStatus()
        pipe = self.redis.pipeline()
        pipe.hset(run_key(spec.name), mapping={"name": spec.name, **self._encode(status.model_dump())})
        pipe.zadd(INDEX_KEY, {spec.name: spec.created_at})
        pipe.sadd(OPEN_KEY, spec.name)
        pipe.execute()
        return RunRecord(spec=spec, status=status)

    def get(self, name: str) -> RunRecord:
        raw = {_decode(k): _decode(v) for k, v in self.redis.hgetall(run_key(name)).items()}
        if "spec" not in raw:
            raise RunNotFoundError(f"no batch run named {name!r} (see `treadle runs list`)")
        fields = {k: json.loads(v) for k, v in raw.items() if k in RunStatus.model_fields}
        return RunRecord(spec=RunSpec.model_validate_json(raw["spec"]), status=RunStatus.model_validate(fields))

    def names(self) -> list[str]:
        return [_decode(n) for n in self.redis.zrange(INDEX_KEY, 0, -1)]

    def list(self) -> list[RunRecord]:
        return [self.get(name) for name in self.names()]

    def open_names(self) -> list[str]:
        """Runs not finished yet, oldest first: the ones a runner may claim."""
        names = [_decode(n) for n in self.redis.smembers(OPEN_KEY)]
        scores = self.redis.pipeline()
        for name in names:
            scores.zscore(INDEX_KEY, name)
        return [n for _, n in sorted(zip(scores.execute(), names), key=lambda pair: (pair[0] or 0, pair[1]))]

    @staticmethod
    def _encode(fields: dict[str, Any]) -> dict[str, str]:
        unknown = set(fields) - set(RunStatus.model_fields)
        if unknown:
            raise InvalidRequestError(f"unknown run status field(s) {sorted(unknown)}")
        return {k: json.dumps(v) for k, v in fields.items()}

    # ------------------------------------------------------------ leases
    @staticmethod
    def token(holder: str, epoch: int) -> str:
        return f"{holder}:{epoch}"

    def claim(self, name: str, holder: str) -> int | None:
        """Take the run's lease if nobody holds it; returns the new fencing epoch, or None."""
        if not self.redis.set(lease_key(name), f"{holder}:?", nx=True, px=self.ttl_ms):
            return None
        epoch = int(self.redis.hincrby(run_key(name), "epoch", 1))
        self.redis.set(lease_key(name), self.token(holder, epoch), px=self.ttl_ms)
        return epoch

    def update(self, name: str, token: str, *, release: bool = False, **fields: Any) -> bool:
        """Write status fields if `token` still holds the lease (and then release it, if asked).
        Returns False, writing nothing, when the lease was lost."""
        close = fields.get("state") in TERMINAL_STATES
        pairs = [x for kv in self._encode(fields).items() for x in kv]
        args = [token, "release" if release else "", "close" if close else "", *pairs]
        return bool(self._update(keys=[lease_key(name), run_key(name), OPEN_KEY], args=args))

    def renew(self, tokens: dict[str, str]) -> set[str]:
        """Extend every lease in `tokens` (name -> token) still held; returns the names whose lease was lost."""
        if not tokens:
            return set()
        names = list(tokens)
        held = self._renew(keys=[lease_key(n) for n in names], args=[*(tokens[n] for n in names), self.ttl_ms])
        return {name for name, ok in zip(names, held) if not ok}

    def lease_holder(self, name: str) -> str | None:
        value = self.redis.get(lease_key(name))
        return _decode(value) if value is not None else None

    # ------------------------------------------------------------ stop
    def request_stop(self, name: str, holder: str) -> RunRecord:
        """Ask the run to stop. The runner that holds it stops the command; a run that no runner holds
        (queued, or waiting for adoption) is stopped here, under the lease, so no runner can start it."""
        record = self.get(name)
        if record.finished:
            return record
        self.redis.hset(run_key(name), "stop_requested", "true")
        epoch = self.claim(name, holder)
        if epoch is not None:
            self.update(
                name,
                self.token(holder, epoch),
                release=True,
                state="stopped",
                finished_at=time.time(),
                pid=None,
                message=f"stopped by {holder} before a runner started it again",
            )
        return self.get(name)
