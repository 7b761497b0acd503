"""Session ownership: a Redis lease with a fencing epoch.

A worker owns a session while it holds `treadle:lease:<sid>` (SET NX PX), renewed from a background
thread that a long op does not block. Every takeover bumps the session's epoch; the owner checks
`holder:epoch` before each op and each checkpoint write, so a worker that lost its lease (paused,
partitioned) can never write over its successor's state.

The same lease, under another key, is a worker's claim on a control request it runs
(`treadle.queue.control_requests`): one token format, one renewal (a claim's release also marks its request).
"""

from __future__ import annotations

from typing import Callable

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
    def __init__(self, redis, holder: str, ttl_ms: int = LEASE_TTL_MS, key: Callable[[str], str] = names.lease_key):
        """`key`: the lease's Redis key for an id (a session's lease; a control request's claim)."""
        self.redis = redis
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.key = key
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    def token(self, epoch: int) -> str:
        return f"{self.holder}:{epoch}"

    def acquire(self, session_id: str) -> int | None:
        """Take a session's lease if nobody holds it; returns the new fencing epoch, or None."""
        placeholder = f"{self.holder}:?"
        if not self.redis.set(self.key(session_id), placeholder, nx=True, px=self.ttl_ms):
            return None
        epoch = int(self.redis.hincrby(names.session_key(session_id), "epoch", 1))
        self.redis.set(self.key(session_id), self.token(epoch), px=self.ttl_ms)
        self.redis.hset(names.session_key(session_id), "worker", self.holder)
        return epoch

    def renew(self, session_id: str, epoch: int) -> bool:
        return bool(self._renew(keys=[self.key(session_id)], args=[self.token(epoch), self.ttl_ms]))

    def renew_all(self, held: dict[str, int]) -> list[str]:
        """Renew every lease of `held` (id -> epoch) in one round trip; the ids whose lease was not ours any more."""
        if not held:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for lease_id, epoch in held.items():
                self._renew(keys=[self.key(lease_id)], args=[self.token(epoch), self.ttl_ms], client=pipe)
            renewed = pipe.execute()
        return [lease_id for lease_id, ok in zip(held, renewed) if not ok]

    def holds(self, session_id: str, epoch: int) -> bool:
        return self.is_ours(self.redis.get(self.key(session_id)), epoch)

    def is_ours(self, value: bytes | str | None, epoch: int) -> bool:
        """Whether a value read from the lease key (see `holds`) is this holder's lease at `epoch`."""
        value = value.decode() if isinstance(value, bytes) else value
        return value == self.token(epoch)

    def release(self, session_id: str, epoch: int) -> None:
        self._release(keys=[self.key(session_id)], args=[self.token(epoch)])

    def is_held(self, session_id: str) -> bool:
        return bool(self.redis.exists(self.key(session_id)))
