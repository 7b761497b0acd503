"""Usage metering: what each op processed, durable in Redis, counted exactly once.

The worker records one `OpUsage` per op it runs: the tokens it prefilled (prompt and training inputs),
sampled (generated) and trained (the inputs of forward_backward), and the seconds of compute. Tokens
count what the loop sent, never padding: a forward_backward over datums of 5 and 9 tokens trains 14.

An op is identified by `(session_id, op_id)`; `op_id` is the op's `seq` for ordered ops. Recording is
one Lua script, so it is atomic: the first record of an id adds to the totals, a second one (a replay
after a failover, a redelivered message, a retried sample) changes nothing. Totals are kept per session
and per owner (`SDK_OWNER` for sessions created with the treadle SDK, which has no API keys); per-op
records also sit in a per-owner time index, so `usage(owner, since=...)` is exact for any instant.
Records and indexes expire `retention_s` after their last write (default 400 days).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from treadle.queue import names

SDK_OWNER = "sdk"
METRICS = ("prefill_tokens", "sampled_tokens", "trained_tokens", "compute_s", "memory_gib_s")
_FLOAT_METRICS = ("compute_s", "memory_gib_s")
DEFAULT_RETENTION_S = 400 * 24 * 3600


class OpUsage(BaseModel):
    """What one op consumed."""

    session_id: str = Field(description="The training session (or sampler) the op belongs to.")
    op_id: str = Field(description="Unique within the session: the op's seq for ordered ops.")
    op: str = Field(description="Op name, e.g. forward_backward, sample.")
    owner: str = Field(default=SDK_OWNER, description="Who pays: the gateway owner, or `sdk`.")
    base_model: str = Field(default="", description="Base model the op ran on.")
    prefill_tokens: int = Field(
        default=0, ge=0, description="Prompt / input tokens run through the model (no padding)."
    )
    sampled_tokens: int = Field(default=0, ge=0, description="Tokens generated.")
    trained_tokens: int = Field(
        default=0, ge=0, description="Input tokens of forward_backward (the tokens gradients flow from)."
    )
    compute_s: float = Field(default=0.0, ge=0.0, description="Seconds the op held the accelerator.")
    memory_gib_s: float = Field(
        default=0.0,
        ge=0.0,
        description="GiB the session's trained weights hold on the device (weights, gradients, AdamW moments) times "
        "the op's seconds: a full fine-tuning session's ops count by its memory.",
    )
    at: float = Field(default_factory=time.time, description="When the op finished (Unix seconds).")


class Usage(BaseModel):
    """Totals over a set of ops."""

    ops: int = Field(default=0, description="Ops counted.")
    prefill_tokens: int = Field(default=0, description="Prompt / input tokens run through the model.")
    sampled_tokens: int = Field(default=0, description="Tokens generated.")
    trained_tokens: int = Field(default=0, description="Input tokens of forward_backward.")
    compute_s: float = Field(default=0.0, description="Seconds of accelerator time.")
    memory_gib_s: float = Field(default=0.0, description="GiB-seconds of trained-weight memory held while ops ran.")

    def add(self, op: OpUsage) -> None:
        self.ops += 1
        for name in METRICS:
            setattr(self, name, getattr(self, name) + getattr(op, name))


# KEYS: ops hash, session totals, owner totals, owner timeline, owners set.
# ARGV: op_id, record JSON, at, retention, timeline member, owner, then name/increment pairs.
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
for i = 7, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBYFLOAT', KEYS[3], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[5])
redis.call('SADD', KEYS[5], ARGV[6])
for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""


class Meter:
    """Records and sums usage in Redis (any client: the worker records, anyone reads)."""

    def __init__(self, redis, retention_s: int = DEFAULT_RETENTION_S):
        self.redis = redis
        self.retention_s = retention_s
        self._script = redis.register_script(_RECORD)

    def record(self, usage: OpUsage, client=None) -> bool:
        """Add one op's usage; False (and nothing counted) when this (session, op_id) was recorded before.

        `client`: a pipeline to queue the record on (its answer then comes with the pipeline's)."""
        keys = [
            names.usage_ops_key(usage.session_id),
            names.usage_totals_key("session", usage.session_id),
            names.usage_totals_key("owner", usage.owner),
            names.usage_timeline_key(usage.owner),
            names.USAGE_OWNERS_KEY,
        ]
        args = [
            usage.op_id,
            usage.model_dump_json(),
            repr(usage.at),
            self.retention_s,
            f"{usage.op_id}@{usage.session_id}",
            usage.owner,
            "ops",
            1,
        ]
        for name in METRICS:  # zeros are left out: a missing field reads as 0, and each one is a write
            if getattr(usage, name):
                args += [name, repr(getattr(usage, name))]
        if client is not None:  # EVAL, not the cached script: a pipeline would first ask Redis if it has it
            client.eval(_RECORD, len(keys), *keys, *args)
            return True
        return bool(self._script(keys=keys, args=args))

    def session_usage(self, session_id: str) -> Usage:
        return _totals(self.redis.hgetall(names.usage_totals_key("session", session_id)))

    def owner_usage(self, owner: str, since: float | None = None) -> Usage:
        """All-time totals, or the exact sum of the ops that finished at or after `since`."""
        if since is None:
            return _totals(self.redis.hgetall(names.usage_totals_key("owner", owner)))
        usage = Usage()
        for op in self.owner_ops(owner, since=since):
            usage.add(op)
        return usage

    def owner_ops(self, owner: str, since: float | None = None, until: float | None = None) -> list[OpUsage]:
        """The owner's op records that finished in [since, until), oldest first (from the time index)."""
        members = self.redis.zrangebyscore(
            names.usage_timeline_key(owner),
            "-inf" if since is None else repr(since),
            "+inf" if until is None else f"({until!r}",
        )
        by_session: dict[str, list[str]] = {}
        for member in members:
            op_id, _, session_id = (member.decode() if isinstance(member, bytes) else member).partition("@")
            by_session.setdefault(session_id, []).append(op_id)
        records = []
        for session_id, op_ids in by_session.items():
            records += [
                OpUsage.model_validate_json(raw)
                for raw in self.redis.hmget(names.usage_ops_key(session_id), op_ids)
                if raw
            ]
        return sorted(records, key=lambda r: r.at)

    def session_ops(self, session_id: str) -> list[OpUsage]:
        """Every recorded op of a session, oldest first."""
        records = [OpUsage.model_validate_json(v) for v in self.redis.hvals(names.usage_ops_key(session_id))]
        return sorted(records, key=lambda r: (r.at, len(r.op_id), r.op_id))  # seqs in numeric order

    def owners(self) -> list[str]:
        return sorted(o.decode() if isinstance(o, bytes) else o for o in self.redis.smembers(names.USAGE_OWNERS_KEY))


def _totals(raw: dict) -> Usage:
    values = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}
    return Usage(
        ops=int(values.get("ops", 0)),
        **{name: values.get(name, 0.0) for name in _FLOAT_METRICS},
        **{name: int(values.get(name, 0)) for name in METRICS if name not in _FLOAT_METRICS},
    )
