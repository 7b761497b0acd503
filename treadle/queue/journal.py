"""The op journal: every op envelope of a session, kept until a checkpoint covers it.

It is what makes the worker independent of Celery's delivery order: an op that arrives early is
parked here and runs when its predecessor has run, a redelivered op finds its seq already applied,
and a new owner after a crash replays the journal on top of the last checkpoint.
"""

from __future__ import annotations

from treadle.queue import names
from treadle.queue.envelope import BLOB_TTL_S, OpEnvelope


class Journal:
    def __init__(self, redis):
        self.redis = redis

    def record(self, envelope: OpEnvelope) -> bool:
        """Add an op; False if that seq is already recorded (a redelivery)."""
        key = names.journal_key(envelope.session_id)
        added = self.redis.hsetnx(key, str(envelope.seq), envelope.model_dump_json())
        self.redis.expire(key, BLOB_TTL_S)
        return bool(added)

    def get(self, session_id: str, seq: int) -> OpEnvelope | None:
        raw = self.redis.hget(names.journal_key(session_id), str(seq))
        return OpEnvelope.model_validate_json(raw) if raw else None

    def seqs(self, session_id: str) -> list[int]:
        return sorted(int(s) for s in self.redis.hkeys(names.journal_key(session_id)))

    def trim(self, session_id: str, upto_seq: int) -> int:
        """Forget ops with seq <= upto_seq (a checkpoint now covers them), and their payload blobs."""
        key = names.journal_key(session_id)
        old = [s for s in self.seqs(session_id) if s <= upto_seq]
        if not old:
            return 0
        refs = [OpEnvelope.model_validate_json(r).payload_ref for r in self.redis.hmget(key, [str(s) for s in old]) if r]
        pipe = self.redis.pipeline()
        pipe.hdel(key, *[str(s) for s in old])
        for ref in refs:
            if ref:
                pipe.delete(ref)
        pipe.execute()
        return len(old)

    def drop(self, session_id: str) -> None:
        self.trim(session_id, 1 << 62)
        self.redis.delete(names.journal_key(session_id))
