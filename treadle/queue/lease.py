"""Session ownership: a Redis lease with a fencing epoch.

A worker owns a session while it holds `treadle:lease:<sid>` (SET NX PX), renewed from a background
thread that a long op does not block. Every takeover bumps the session's epoch; the owner checks
`holder:epoch` before each op and each checkpoint write, so a worker that lost its lease (paused,
partitioned) can never write over its successor's state.
"""

from __future__ import annotations

from treadle.queue import names

LEASE_TTL_MS = 15_000

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseManager:
    def __init__(self, redis, holder: str, ttl_ms: int = LEASE_TTL_MS):
        self.redis = redis
        self.holder = holder
        self.ttl_ms = ttl_ms
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    def _token(self, epoch: int) -> str:
        return f"{self.holder}:{epoch}"

    def acquire(self, session_id: str) -> int | None:
        """Take the lease if nobody holds it; returns the new fencing epoch, or None."""
        placeholder = f"{self.holder}:?"
        if not self.redis.set(names.lease_key(session_id), placeholder, nx=True, px=self.ttl_ms):
            return None
        epoch = int(self.redis.hincrby(names.session_key(session_id), "epoch", 1))
        self.redis.set(names.lease_key(session_id), self._token(epoch), px=self.ttl_ms)
        self.redis.hset(names.session_key(session_id), "worker", self.holder)
        return epoch

    def renew(self, session_id: str, epoch: int) -> bool:
        return bool(self._renew(keys=[names.lease_key(session_id)], args=[self._token(epoch), self.ttl_ms]))

    def holds(self, session_id: str, epoch: int) -> bool:
        return self.is_ours(self.redis.get(names.lease_key(session_id)), epoch)

    def is_ours(self, value: bytes | str | None, epoch: int) -> bool:
        """Whether a value read from the lease key (see `holds`) is this holder's lease at `epoch`."""
        value = value.decode() if isinstance(value, bytes) else value
        return value == self._token(epoch)

    def release(self, session_id: str, epoch: int) -> None:
        self._release(keys=[names.lease_key(session_id)], args=[self._token(epoch)])

    def is_held(self, session_id: str) -> bool:
        return bool(self.redis.exists(names.lease_key(session_id)))
