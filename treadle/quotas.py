"""Per-owner quotas on concurrent training sessions, counted in Redis: how many, and how many bytes full
fine-tuning sessions hold (their weights, gradients and AdamW moments; a LoRA session counts 0 bytes).

A session counts against its owner from the moment its creation is admitted until it is stopped or
expires. Admission is one Lua script (atomic, so two creates racing for the last slot cannot both
win): it first drops the owner's sessions whose record says stopped or expired, then admits the new
session if fewer than the limit remain. A session that never got a record (its creation failed) stops
counting after `pending_s`. Because stopped sessions are dropped from their own records, a session
stopped by any path (`stop()`, the gateway, idle expiry, a crashed create) frees its slot with no
explicit release; `release` only makes that immediate.
"""

from __future__ import annotations

import time

from treadle.errors import QuotaExceededError
from treadle.queue import names
from treadle.queue.names import session_key

# KEYS: the owner's set (zset session -> admitted at), the owner's bytes (hash session -> bytes). ARGV: session id,
# now, session limit (-1: none), pending_s, session key prefix, memory limit (-1: none), the new session's bytes.
# Returns {-1, 0} when admitted, {0, sessions} over the session limit, {1, bytes held} over the memory limit.
_ADMIT = """
for _, sid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local status = redis.call('HGET', ARGV[5] .. sid, 'status')
  local admitted = tonumber(redis.call('ZSCORE', KEYS[1], sid))
  if (status and status ~= 'active') or ((not status) and admitted < tonumber(ARGV[2]) - tonumber(ARGV[4])) then
    redis.call('ZREM', KEYS[1], sid)
    redis.call('HDEL', KEYS[2], sid)
  end
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {-1, 0} end
local n = redis.call('ZCARD', KEYS[1])
if tonumber(ARGV[3]) >= 0 and n >= tonumber(ARGV[3]) then return {0, n} end
if tonumber(ARGV[6]) >= 0 then
  local held = 0
  for _, bytes in ipairs(redis.call('HVALS', KEYS[2])) do held = held + tonumber(bytes) end
  if held + tonumber(ARGV[7]) > tonumber(ARGV[6]) then return {1, held} end
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if tonumber(ARGV[7]) > 0 then redis.call('HSET', KEYS[2], ARGV[1], ARGV[7]) end
return {-1, 0}
"""


class SessionQuota:
    """`admit(owner, session_id, memory_bytes)` before creating a session; QuotaExceededError when the owner is at its
    limit of sessions, or its full sessions would hold more than `memory_limit` bytes (None: no such limit)."""

    def __init__(
        self,
        redis,
        default_limit: int | None = None,
        limits: dict[str, int] | None = None,
        pending_s: float = 900.0,
        memory_limit: int | None = None,
    ):
        self.redis = redis
        self.default_limit = default_limit
        self.limits = dict(limits or {})
        self.pending_s = pending_s
        self.memory_limit = memory_limit
        self._admit = redis.register_script(_ADMIT)

    def limit_for(self, owner: str) -> int | None:
        """The owner's own limit, else the default; None: unlimited."""
        return self.limits.get(owner, self.default_limit)

    def admit(self, owner: str, session_id: str, memory_bytes: int = 0) -> None:
        """`memory_bytes`: what the new session will hold if it is a full fine-tuning session (0 for LoRA)."""
        limit = self.limit_for(owner)
        memory_limit = self.memory_limit if memory_bytes else None
        if limit is None and memory_limit is None:
            return
        over, value = self._admit(
            keys=[names.quota_sessions_key(owner), names.quota_memory_key(owner)],
            args=[
                session_id,
                repr(time.time()),
                -1 if limit is None else limit,
                self.pending_s,
                session_key(""),
                -1 if memory_limit is None else memory_limit,
                memory_bytes,
            ],
        )
        if int(over) == 0:
            raise QuotaExceededError(
                f"max_sessions_per_owner: owner {owner!r} has {value} active training sessions and the limit is "
                f"{limit}; stop one (TrainingClient.stop(), or let it expire) before creating another"
            )
        if int(over) == 1:
            raise QuotaExceededError(
                f"full_session_memory_per_owner: owner {owner!r} has full fine-tuning sessions holding {value} bytes; "
                f"this one needs {memory_bytes} more and the limit is {memory_limit}; stop one first"
            )

    def release(self, owner: str, session_id: str) -> None:
        self.redis.zrem(names.quota_sessions_key(owner), session_id)
        self.redis.hdel(names.quota_memory_key(owner), session_id)

    def active(self, owner: str) -> list[str]:
        return sorted(
            s.decode() if isinstance(s, bytes) else s for s in self.redis.zrange(names.quota_sessions_key(owner), 0, -1)
        )
