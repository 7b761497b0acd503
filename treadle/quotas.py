"""Per-owner quotas on concurrent training sessions, counted in Redis.

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

# KEYS: the owner's set (zset session -> admitted at). ARGV: session id, now, limit, pending_s, session key prefix.
_ADMIT = """
for _, sid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local status = redis.call('HGET', ARGV[5] .. sid, 'status')
  local admitted = tonumber(redis.call('ZSCORE', KEYS[1], sid))
  if (status and status ~= 'active') or ((not status) and admitted < tonumber(ARGV[2]) - tonumber(ARGV[4])) then
    redis.call('ZREM', KEYS[1], sid)
  end
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return -1 end
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[3]) then return n end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return -1
"""


class SessionQuota:
    """`admit(owner, session_id)` before creating a session; QuotaExceededError when the owner is at its limit."""

    def __init__(
        self, redis, default_limit: int | None = None, limits: dict[str, int] | None = None, pending_s: float = 900.0
    ):
        self.redis = redis
        self.default_limit = default_limit
        self.limits = dict(limits or {})
        self.pending_s = pending_s
        self._admit = redis.register_script(_ADMIT)

    def limit_for(self, owner: str) -> int | None:
        """The owner's own limit, else the default; None: unlimited."""
        return self.limits.get(owner, self.default_limit)

    def admit(self, owner: str, session_id: str) -> None:
        limit = self.limit_for(owner)
        if limit is None:
            return
        active = int(
            self._admit(
                keys=[names.quota_sessions_key(owner)],
                args=[session_id, repr(time.time()), limit, self.pending_s, session_key("")],
            )
        )
        if active >= 0:
            raise QuotaExceededError(
                f"max_sessions_per_owner: owner {owner!r} has {active} active training sessions and the limit is "
                f"{limit}; stop one (TrainingClient.stop(), or let it expire) before creating another"
            )

    def release(self, owner: str, session_id: str) -> None:
        self.redis.zrem(names.quota_sessions_key(owner), session_id)

    def active(self, owner: str) -> list[str]:
        return sorted(
            s.decode() if isinstance(s, bytes) else s for s in self.redis.zrange(names.quota_sessions_key(owner), 0, -1)
        )
