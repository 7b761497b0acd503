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
few milliseconds for the next one (treadle.gpu_worker.scheduling.linger) with its idle key set; the append takes
that key (the session record names its owner) and puts `<session_id> <seq>` on the owner's wake list,
which the waiting thread pops at once. Taking the key is atomic with the journal write, and the worker
ends its wait by deleting the same key, so each op either wakes the waiting worker or rings. (The keys
are named inside the script, from the record: treadle runs on a single Redis or Sentinel, not Cluster.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from treadle.errors import CapacityError
from treadle.metering import SDK_OWNER
from treadle.queue import names
from treadle.queue.ops import OpRequest, StopRequest, op_request

# Long enough for any run to checkpoint (which trims), short enough that an abandoned session's ops go.
JOURNAL_TTL_S = 7 * 24 * 3600
# A submit's token outlives the client's retries through a Redis outage (treadle.queue.ops_client).
SUBMIT_TOKEN_TTL_S = 600
# A wake left on a dead worker's list: its op runs when the session is adopted (from the journal), so the
# entry only needs to outlive the wait it was meant for.
WAKE_TTL_MS = 60_000

# KEYS: session hash, journal hash, submit token. ARGV: wanted seq ('' = the next one), '1' for a stop, the entry,
# the journal's TTL, the token's TTL, the session id, the idle and wake key prefixes, the wake list's TTL (ms), the
# prefix of the owners' session sets, the prefix of session hashes, the suffix of the owners' session sets
# (`names.owner_sessions_key`; the owner is read from the session hash here). Answers {seq, 1 if the op needs a
# doorbell}; seq is -1 when the session does not exist, is stopping or stopped, expired or lost, and -2 when a
# queue is at its bound ({-2, queued, limit, 1 for the session's bound or 2 for its owner's}). A retry rings (a
# duplicate doorbell is harmless; a missing one would stall the op). An explicit seq (the gateway's) moves the
# counter too, so a later automatic seq never reuses it. A stop records its seq, after which nothing is accepted,
# except an explicit seq below the stop's: a gateway client's op that arrived late (chunks come concurrently) runs
# before the stop it precedes. Only an op that moves the counter is bounded, and it is refused when the queue
# (counter minus applied, gaps included) is already at the bound: a stop, a retry, and an explicit seq that fills a
# gap below the counter always pass. So a refusal only ever waits for queued ops to run, never for another refused
# op: the Tinker SDK sends a forward_backward's chunks concurrently, the first one last, and a bound on how far a
# seq lies past the applied one would refuse the later chunks until the first came, while the SDK holds the first
# back until the later ones are answered.
_APPEND = """
local taken = redis.call('GET', KEYS[3])
if taken then return {tonumber(taken), 1} end
local st = redis.call('HMGET', KEYS[1], 'status', 'stop_seq', 'applied', 'next_seq', 'max_queued_ops',
                      'max_owner_queued_ops', 'owner')
if (not st[1]) or st[1] ~= 'active' then return {-1, 0} end
local stop = tonumber(st[2] or '0') or 0
if stop > 0 and (ARGV[1] == '' or tonumber(ARGV[1]) >= stop) then return {-1, 0} end
local applied = tonumber(st[3] or '0') or 0
local cur = tonumber(st[4] or '0') or 0
local seq = cur + 1
if ARGV[1] ~= '' then seq = tonumber(ARGV[1]) end
if seq > cur and ARGV[2] ~= '1' then
  local queued = math.max(0, cur - applied)
  local limit = tonumber(st[5] or '0') or 0
  if limit > 0 and queued >= limit then return {-2, queued, limit, 1} end
  local olimit = tonumber(st[6] or '0') or 0
  if olimit > 0 then
    local owner = st[7]
    if (not owner) or owner == '' then owner = 'sdk' end
    local set = ARGV[10] .. owner .. ARGV[12]
    for _, sid in ipairs(redis.call('SMEMBERS', set)) do
      if sid ~= ARGV[6] then
        local o = redis.call('HMGET', ARGV[11] .. sid, 'status', 'next_seq', 'applied')
        if o[1] ~= 'active' then
          redis.call('SREM', set, sid)
        else
          queued = queued + math.max(0, (tonumber(o[2] or '0') or 0) - (tonumber(o[3] or '0') or 0))
        end
      end
    end
    if queued >= olimit then return {-2, queued, olimit, 2} end
  end
end
if seq > cur then redis.call('HSET', KEYS[1], 'next_seq', seq) end
if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 'stop_seq', seq) end
redis.call('HSETNX', KEYS[2], seq, ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('SET', KEYS[3], seq, 'EX', ARGV[5])
if applied < seq - 1 then return {seq, 0} end
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
        seq and journals nothing new. CapacityError when the session's or its owner's queue is at its bound."""
        entry = f"{request.op}\n{time.time():.6f}\n".encode() + request.encode()
        keys = [names.session_key(session_id), names.journal_key(session_id), names.submit_key(session_id, token)]
        args = [
            "" if seq is None else str(seq),
            "1" if request.op == StopRequest.op else "",
            entry,
            JOURNAL_TTL_S,
            SUBMIT_TOKEN_TTL_S,
            session_id,
            names.IDLE_PREFIX,
            names.WAKE_PREFIX,
            WAKE_TTL_MS,
            names.OWNER_PREFIX,
            names.session_key(""),
            names.OWNER_SESSIONS_SUFFIX,
        ]
        answer = self._append(keys=keys, args=args)
        if int(answer[0]) == -2:
            raise self._at_capacity(session_id, *(int(v) for v in answer[1:]))
        return int(answer[0]), bool(answer[1])

    def _at_capacity(self, session_id: str, queued: int, limit: int, which: int) -> CapacityError:
        """The error of a refused submit, with a retry hint: when the session's next op should have run."""
        position, wait_s, cost_s, owner = self.redis.hmget(
            names.session_key(session_id), "queue_position", "queue_wait_s", "op_cost_s", "owner"
        )
        retry_after_s = max(1.0, min(60.0, float(wait_s or 0) + float(cost_s or 0)))
        bound = "max_queued_ops_per_session" if which == 1 else "max_queued_ops_per_owner"
        if which == 1:
            what = f"{bound}: session {session_id} has {queued} ops queued and the limit is {limit}"
        else:
            what = (
                f"{bound}: owner {(owner or b'').decode() or SDK_OWNER!r} has {queued} ops queued "
                f"over its sessions and the limit is {limit}"
            )
        return CapacityError(
            f"{what}; nothing was queued: submit again in about {retry_after_s:.0f} s, when its next op "
            f"has run (queue position {int(position or 0)})",
            retry_after_s,
            bound,
        )

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
