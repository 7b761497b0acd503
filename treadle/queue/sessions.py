"""The session registry in Redis: what a session is, who owns it, and how far it has run."""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, Field

from treadle.errors import (
    SessionExpiredError,
    SessionLostError,
    SessionNotFoundError,
    SessionStoppedError,
    TreadleError,
)
from treadle.queue import names
from treadle.types import FullConfig, LoraConfig


class SessionRecord(BaseModel):
    session_id: str
    run_id: str = Field(description="Checkpoints are stored under treadle://<run_id>/...")
    base_model: str
    lora: LoraConfig = Field(default_factory=LoraConfig)
    full: FullConfig | None = Field(
        default=None, description="Set for a full fine-tuning session (its `lora` then describes nothing trained)."
    )
    memory_bytes: int = Field(
        default=0, description="Device bytes its trained weights hold on its worker: weights, gradients, AdamW moments."
    )
    owner: str | None = Field(default=None, description="The API owner (gateway auth); None for the SDK.")
    user_metadata: dict | None = None
    created_at: float = Field(default_factory=time.time)
    # mutable state
    worker: str | None = Field(default=None, description="Hostname of the worker holding the lease.")
    epoch: int = Field(default=0, description="Fencing epoch: bumped on every change of owner.")
    applied: int = Field(default=0, description="Highest seq whose op has run and whose result is stored.")
    step: int = Field(
        default=0,
        description="Optimizer steps of the session's weights after that op (a session "
        "created from a checkpoint starts at the checkpoint's).",
    )
    checkpoint: str | None = Field(default=None, description="Path of the latest automatic checkpoint.")
    checkpoint_seq: int = Field(default=0, description="Seq that checkpoint covers.")
    checkpoint_with_optimizer: bool = Field(default=True, description="Restore Adam moments from that checkpoint.")
    checkpoint_every: int | None = Field(
        default=None, description="Per-session automatic checkpoint period in steps (None: the worker's)."
    )
    last_recovery: str | None = Field(
        default=None, description="JSON timings of the last failover (load_s, replay_s, ...)."
    )
    status: str = Field(
        default="active",
        description="active | stopped | expired (idle past the workers' TTL; "
        "checkpointed) | lost (its state could not be rebuilt)",
    )
    stop_seq: int = Field(default=0, description="Seq of the queued stop op (0: none): no op is accepted after it.")
    last_activity: float = Field(default_factory=time.time)
    # backpressure and the visible queue (treadle.gpu_worker.scheduling.fair): set by the worker, read by submits
    # and status
    max_queued_ops: int = Field(
        default=0, description="Ops this session may have submitted and not yet applied (0: no bound)."
    )
    max_owner_queued_ops: int = Field(
        default=0, description="Ops all active sessions of its owner may have queued (0: no bound)."
    )
    op_cost_s: float = Field(
        default=0.0, description="Average seconds of device time of its recent ops, as its worker measured them."
    )
    queue_position: int = Field(
        default=0,
        description="Its next op's place in its worker's line (1: next or running) when its worker last decided.",
    )
    queue_wait_s: float = Field(
        default=0.0,
        description="Estimated seconds until its next op starts, from the measured costs of the ops ahead of it.",
    )
    # ops that crash their worker (treadle.gpu_worker.executor.failover)
    running: int = Field(
        default=0, description="Seq of the op its worker started last: above `applied`, the worker died running it."
    )
    crashed_seq: int = Field(default=0, description="Seq of the last op whose worker died running it.")
    crashes: int = Field(default=0, description="Workers that died running op `crashed_seq`.")
    crashed_ops: list[int] = Field(
        default_factory=list,
        description="Seqs answered with CrashingRequestError instead of running: a rebuild does not replay them.",
    )


def inactive_error(session_id: str, record: SessionRecord | None) -> TreadleError:
    """The error for an op on a session that takes no more ops: missing, stopping or stopped, expired
    (naming the checkpoint to resume from) or lost."""
    if record is None:
        return SessionNotFoundError(f"session {session_id} does not exist")
    if record.status == "lost":
        return SessionLostError(
            f"session {session_id} was lost: its state could not be rebuilt after its worker died "
            f"({record.last_recovery or 'no checkpoint or journal'})"
        )
    if record.status in ("stopped", "active"):  # active with a stop queued: stopping
        return SessionStoppedError(
            f"session {session_id} was stopped (its stop is op {record.stop_seq}); create a new training client"
        )
    if record.status == "expired":
        idle = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.last_activity))
        return SessionExpiredError(
            f"session {session_id} expired: idle since {idle}, past the workers' session_idle_ttl_s, it was "
            f"checkpointed and stopped; resume from {record.checkpoint} "
            f"(ServiceClient.create_training_client_from_state_with_optimizer({record.checkpoint!r}))"
        )
    return SessionNotFoundError(f"session {session_id} does not exist or was stopped")


_INT_FIELDS = {
    "epoch",
    "applied",
    "checkpoint_seq",
    "checkpoint_every",
    "stop_seq",
    "max_queued_ops",
    "max_owner_queued_ops",
    "queue_position",
    "memory_bytes",
    "running",
    "crashed_seq",
    "crashes",
}
_FLOAT_FIELDS = {"created_at", "last_activity", "op_cost_s", "queue_wait_s"}
_JSON_FIELDS = {"lora", "full", "user_metadata", "crashed_ops"}
_BOOL_FIELDS = {"checkpoint_with_optimizer"}


# KEYS: a session's record. Answers {crashed_seq, crashes, 1 if a death was counted now}: the op marked running
# above `applied` killed its worker (the mark is taken, so one death counts once, whoever adopts the session).
_COUNT_CRASH = """
local f = redis.call('HMGET', KEYS[1], 'running', 'applied', 'crashed_seq', 'crashes')
local running, applied = tonumber(f[1]) or 0, tonumber(f[2]) or 0
local seq, crashes = tonumber(f[3]) or 0, tonumber(f[4]) or 0
if running <= applied then return {seq, crashes, 0} end
redis.call('HDEL', KEYS[1], 'running')
if seq == running then crashes = crashes + 1 else seq, crashes = running, 1 end
redis.call('HSET', KEYS[1], 'crashed_seq', seq, 'crashes', crashes)
return {seq, crashes, 1}
"""


# KEYS: a session's record. ARGV: a seq. The running mark goes if it is that seq's.
_CLEAR_RUNNING = """
if tonumber(redis.call('HGET', KEYS[1], 'running') or 0) == tonumber(ARGV[1]) then redis.call('HDEL', KEYS[1], 'running') end
"""


class SessionRegistry:
    def __init__(self, redis):
        self.redis = redis
        self._count_crash = redis.register_script(_COUNT_CRASH)
        self._clear_running = redis.register_script(_CLEAR_RUNNING)

    def clear_running(self, session_id: str, seq: int) -> None:
        """The worker that marked op `seq` running is alive and hands the session over (it lost the lease inside the
        op): no death to count against the op."""
        self._clear_running(keys=[names.session_key(session_id)], args=[seq])

    def count_crash(self, session_id: str) -> tuple[int, int, bool]:
        """On adoption: count a death of the previous owner while it ran an op (see `SessionRecord.running`). The
        seq of the last op that killed a worker, how many workers it killed (0, 0: none), whether one counted now."""
        seq, crashes, counted = self._count_crash(keys=[names.session_key(session_id)])
        return int(seq), int(crashes), bool(counted)

    def create(self, record: SessionRecord) -> bool:
        key = names.session_key(record.session_id)
        if self.redis.exists(key):
            return False
        self.redis.hset(key, mapping=self._encode(record.model_dump()))
        return True

    def next_seq(self, session_id: str) -> int:
        """The highest seq given out so far (0 before the first op); kept by the journal's append script."""
        return int(self.redis.hget(names.session_key(session_id), "next_seq") or 0)

    def get(self, session_id: str) -> SessionRecord | None:
        raw = self.redis.hgetall(names.session_key(session_id))
        if not raw:
            return None
        return SessionRecord.model_validate(self._decode(raw))

    def update(self, session_id: str, *, client=None, **fields) -> None:
        """Set fields of the record; `client`: a pipeline to queue the write on."""
        (client or self.redis).hset(names.session_key(session_id), mapping=self._encode(fields))

    def all(self) -> list[SessionRecord]:
        out = []
        for key in self.redis.scan_iter(names.SESSION_PATTERN, count=500):
            sid = (key.decode() if isinstance(key, bytes) else key)[len(names.session_key("")) :]
            rec = self.get(sid)
            if rec is not None:
                out.append(rec)
        return out

    def delete(self, session_id: str) -> None:
        self.redis.delete(names.session_key(session_id))

    @staticmethod
    def _encode(fields: dict) -> dict:
        out = {}
        for k, v in fields.items():
            if k in _JSON_FIELDS:
                out[k] = json.dumps(v.model_dump() if hasattr(v, "model_dump") else v)
            elif v is None:
                out[k] = ""
            elif isinstance(v, bool):
                out[k] = "1" if v else "0"
            else:
                out[k] = repr(v) if isinstance(v, float) else str(v)
        return out

    @staticmethod
    def _decode(raw: dict) -> dict:
        out = {}
        for k, v in raw.items():
            k = k.decode() if isinstance(k, bytes) else k
            v = v.decode() if isinstance(v, bytes) else v
            if k in _JSON_FIELDS:
                out[k] = json.loads(v) if v else None
            elif v == "":
                out[k] = None
            elif k in _BOOL_FIELDS:
                out[k] = v == "1"
            elif k in _INT_FIELDS:
                out[k] = int(v)
            elif k in _FLOAT_FIELDS:
                out[k] = float(v)
            else:
                out[k] = v
        if out.get("lora") is None:
            out.pop("lora", None)
        return out
