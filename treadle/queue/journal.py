"""The op journal: the one copy of every op of a session, kept until a checkpoint covers it.

The client writes an op here before it rings the session's doorbell (a Celery message that carries
only `session_id` and `seq`), so a message lost in a crash never loses the op. It is also what makes
the worker independent of Celery's delivery order: an op that arrives early waits here for its
predecessor, a redelivered op finds its seq applied, and a new owner after a crash replays the journal
on top of the last checkpoint. An entry is `<op>\\n<submitted_at>\\n<request JSON>`: the op name is read
without parsing the request, and the request is parsed once, straight into its typed class.

A submit takes its seq and journals the op in one atomic step (`Journal.append`), which also checks
that the session takes ops. Each submit carries a token: when a reply is lost and the client retries,
the retry finds the token and gets the seq the first try took, so an op is never journaled twice
(it would run twice) and no seq is skipped (the session would stall waiting for it).

The same step says whether the op needs a doorbell. The worker's write that marks seq `s-1` applied also
reads entry `s` (treadle.gpu_worker.executor.sequencer); both are atomic in Redis, so an op journaled while its
predecessor is still to be marked applied is found by that read and needs no message. Only an op whose
predecessor is already applied (the worker is idle, or it is the first) rings. A pipelining client so
sends one message per burst, not one per op.

Nor does an op whose owner is waiting for it. A worker that has just run a session's last op waits a
few milliseconds for the next one (treadle.gpu_worker.executor.linger) with its idle key set; the append takes
that key (the session record names its owner) and puts `<session_id> <seq>` on the owner's wake list,
which the waiting thread pops at once. Taking the key is atomic with the journal write, and the worker
ends its wait by deleting the same key, so each op either wakes the waiting worker or rings. (The keys
are named inside the script, from the record: treadle runs on a single Redis or Sentinel, not Cluster.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from treadle.queue import names
from treadle.queue.ops import OpRequest, op_request

# Long enough for any run to checkpoint (which trims), short enough that an abandoned session's ops go.
JOURNAL_TTL_S = 7 * 24 * 3600
# A submit's token outlives the client's retries through a Redis outage (treadle.queue.ops_client).
SUBMIT_TOKEN_TTL_S = 600
# A wake left on a dead worker's list: its op runs when the session is adopted (from the journal), so the
# entry only needs to outlive the wait it was meant for.
WAKE_TTL_MS = 60_000

# KEYS: session hash, journal hash, submit token. ARGV: wanted seq ('' = the next one), '1' for a stop, the
# entry, the journal's TTL, the token's TTL, the session id, the idle and wake key prefixes, the wake list's
# TTL (ms). Answers {seq, 1 if the op needs a doorbell}; seq is -1 when the session does not exist, is
# stopping or stopped, expired or lost. A retry rings (a duplicate
# doorbell is harmless; a missing one would stall the op). An explicit seq (the gateway's) moves the counter too, so
# a later automatic seq never reuses it. A stop records its seq, after which nothing is accepted, except
# an explicit seq below the stop's: a gateway client's op that arrived late (chunks come concurrently)
# runs before the stop it precedes.
_APPEND = """
local taken = redis.call('GET', KEYS[3])
if taken then return {tonumber(taken), 1} end
local st = redis.call('HMGET', KEYS[1], 'status', 'stop_seq', 'applied')
if (not st[1]) or st[1] ~= 'active' then return {-1, 0} end
local stop = tonumber(st[2] or '0') or 0
if stop > 0 and (ARGV[1] == '' or tonumber(ARGV[1]) >= stop) then return {-1, 0} end
local seq
if ARGV[1] == '' then
  seq = redis.call('HINCRBY', KEYS[1], 'next_seq', 1)
else
  seq = tonumber(ARGV[1])
  local cur = tonumber(redis.call('HGET', KEYS[1], 'next_seq') or '0')
  if cur < seq then redis.call('HSET', KEYS[1], 'next_seq', seq) end
end
if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 'stop_seq', seq) end
redis.call('HSETNX', KEYS[2], seq, ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('SET', KEYS[3], seq, 'EX', ARGV[5])
if (tonumber(st[3] or '0') or 0) < seq - 1 then return {seq, 0} end
local worker = redis.call('HGET', KEYS[1], 'worker')
if worker and redis.call('DEL', ARGV[7] .. worker) == 1 then
  local wake = ARGV[8] .. worker
  redis.call('RPUSH', wake, ARGV[6] .. ' ' .. seq)
  redis.call('PEXPIRE', wake, ARGV[9])
  return {seq, 0}
end
return {seq, 1}
"""


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
        self._append = redis.register_script(_APPEND)

    def append(self, session_id: str, request: OpRequest, *, token: str, seq: int | None = None) -> tuple[int, bool]:
        """Give the op the session's next seq (or `seq`, the gateway's) and journal it: (seq, whether it needs a
        doorbell); seq is -1 when the session takes no ops. Repeating it with the same `token` answers the same
        seq and journals nothing new."""
        entry = f"{request.op}\n{time.time():.6f}\n".encode() + request.encode()
        keys = [names.session_key(session_id), names.journal_key(session_id), names.submit_key(session_id, token)]
        args = ["" if seq is None else str(seq), "1" if request.op == "stop" else "", entry, JOURNAL_TTL_S, SUBMIT_TOKEN_TTL_S,
                session_id, names.IDLE_PREFIX, names.WAKE_PREFIX, WAKE_TTL_MS]
        seq, needs_doorbell = self._append(keys=keys, args=args)
        return int(seq), bool(needs_doorbell)

    def get(self, session_id: str, seq: int) -> JournalEntry | None:
        return self.parse(session_id, seq, self.redis.hget(names.journal_key(session_id), str(seq)))

    def get_with(self, session_id: str, seq: int, key: str) -> tuple[JournalEntry | None, bytes | None]:
        """The entry and the value of another key, in one round trip (the worker reads its lease with
        each op it runs: fencing costs no extra trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            self.read_with(pipe, session_id, seq, key)
            raw, value = pipe.execute()
        return self.parse(session_id, seq, raw), value

    @staticmethod
    def read_with(pipe, session_id: str, seq: int, key: str) -> None:
        """Queue the reads of `get_with` on `pipe`: its last two answers are the raw entry and the value."""
        pipe.hget(names.journal_key(session_id), str(seq))
        pipe.get(key)

    @staticmethod
    def parse(session_id: str, seq: int, raw: bytes | None) -> JournalEntry | None:
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
