"""The op journal: the one copy of every op of a session, kept until a checkpoint covers it.

The client writes an op here before it rings the session's doorbell (a Celery message that carries
only `session_id` and `seq`), so a message lost in a crash never loses the op. It is also what makes
the worker independent of Celery's delivery order: an op that arrives early waits here for its
predecessor, a redelivered op finds its seq applied, and a new owner after a crash replays the journal
on top of the last checkpoint. An entry is `<op>\\n<submitted_at>\\n<request JSON>`: the op name is read
without parsing the request, and the request is parsed once, straight into its typed class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from treadle.queue import names
from treadle.queue.ops import OpRequest, op_request

# Long enough for any run to checkpoint (which trims), short enough that an abandoned session's ops go.
JOURNAL_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class JournalEntry:
    session_id: str
    seq: int
    op: str
    submitted_at: float
    raw_request: bytes

    @property
    def future_id(self) -> str:
        return names.future_id(self.session_id, self.seq)

    @property
    def stateful(self) -> bool:
        return op_request(self.op).stateful

    def request(self) -> OpRequest:
        """The typed request (InvalidRequestError if it does not parse)."""
        return op_request(self.op).decode(self.raw_request)


class Journal:
    def __init__(self, redis):
        self.redis = redis

    def record(self, session_id: str, seq: int, request: OpRequest) -> bool:
        """Add an op; False if that seq is already recorded (a retried publish)."""
        key = names.journal_key(session_id)
        entry = f"{request.op}\n{time.time():.6f}\n".encode() + request.encode()
        with self.redis.pipeline() as pipe:
            pipe.hsetnx(key, str(seq), entry)
            pipe.expire(key, JOURNAL_TTL_S)
            added, _ = pipe.execute()
        return bool(added)

    def get(self, session_id: str, seq: int) -> JournalEntry | None:
        return self._entry(session_id, seq, self.redis.hget(names.journal_key(session_id), str(seq)))

    def get_with(self, session_id: str, seq: int, key: str) -> tuple[JournalEntry | None, bytes | None]:
        """The entry and the value of another key, in one round trip (the worker reads its lease with
        each op it runs: fencing costs no extra trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(names.journal_key(session_id), str(seq))
            pipe.get(key)
            raw, value = pipe.execute()
        return self._entry(session_id, seq, raw), value

    @staticmethod
    def _entry(session_id: str, seq: int, raw: bytes | None) -> JournalEntry | None:
        if raw is None:
            return None
        op, submitted_at, body = raw.split(b"\n", 2)
        return JournalEntry(session_id, seq, op.decode(), float(submitted_at), body)

    def has(self, session_id: str, seq: int) -> bool:
        return bool(self.redis.hexists(names.journal_key(session_id), str(seq)))

    def seqs(self, session_id: str) -> list[int]:
        return sorted(int(s) for s in self.redis.hkeys(names.journal_key(session_id)))

    def trim(self, session_id: str, upto_seq: int) -> int:
        """Forget ops with seq <= upto_seq: a checkpoint now covers them."""
        old = [str(s) for s in self.seqs(session_id) if s <= upto_seq]
        if old:
            self.redis.hdel(names.journal_key(session_id), *old)
        return len(old)

    def drop(self, session_id: str) -> None:
        self.redis.delete(names.journal_key(session_id))
