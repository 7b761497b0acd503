"""Control requests (sample, compute_logprobs, create_session) held in Redis until they are answered.

A session's ops survive their worker through the journal; a control request has no session to journal it in,
so it is held on its own: the client writes it under its future id (`hold`) before it rings the base model's
control queue, and the Celery message is only a doorbell naming that id. Any worker serving the model may run
it, but only under a claim (`claim`): a lease as a session's is (treadle.queue.lease, `<worker>:<epoch>`),
taken atomically with reading the request, renewed by the worker's heartbeat while the request runs. A
doorbell for a request that is claimed or answered runs nothing.

A request whose claimer died keeps its record and loses its claim when the lease lapses: every worker's
caretaker looks for such requests of the models it serves (`orphans`) and runs them again from the record. A
request never claimed at all (its doorbell was lost with a worker that had taken it off the queue, or with
the client) counts as orphaned once it has waited `UNCLAIMED_RERUN_S`. The answer removes the record and the
claim in the transaction that stores it (`queue_done`), and only while the claim is still the answerer's
(treadle.gpu_worker.executor.control_ops): an answer is stored once, and a worker that lost its claim has its
late answer dropped.

A request that kills every worker that runs it (a prefill that gets the process OOM-killed, a kernel that crashes
it) would otherwise take down each worker of its model in turn: the worker that claims it after
`max_request_crashes` deaths of its claimers answers it with an error instead of running it
(treadle.gpu_worker.executor.control_ops). A claim that lapsed is a death unless its claimer says it is alive:
a claimer that was stalled past the lease (a long pause, a starved heartbeat) and finds its claim lost, at its
next renewal or at its answer, says so (`alive`), and a claim given back at a warm shutdown (`release`) is no
death either. The next claim counts a lapse its claimer has not spoken for (`crashes`, one record field per
claim's fate, so one lapse counts once), and `alive` takes back a count made before the claimer woke. A lapse
that would stop the request is judged only once its claimer has had a lease TTL more to speak: until then the
request is not claimed (a claimer silent that long counts as dead).

A request not answered within its lifetime expires: its record goes, no worker runs it any more, and `is_held`
says so. A sample's lifetime is the one its waits are bounded by (`sample_ttl_s`, treadle.queue.wait_bounds), so a
wait that gives up on a sample gives up on a request no worker would still run; a session creation's is
`CONTROL_REQUEST_TTL_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from treadle.queue import names
from treadle.queue.lease import LEASE_TTL_MS, LeaseManager
from treadle.queue.ops import CreateSessionRequest, OpRequest, SampleRequest, op_request

# The ops of a base model's control queue (route `model`).
ControlRequest = SampleRequest | CreateSessionRequest

# How long a session creation stays runnable when nothing answers it (no worker serves its model meanwhile).
CONTROL_REQUEST_TTL_S = 24 * 3600
# A request nobody claimed for this long lost its doorbell: a caretaker runs it. A doorbell only waits this
# long behind a busy worker's long training op, and running such a request early is harmless (claims dedupe).
UNCLAIMED_RERUN_S = 60.0

# KEYS: the request's hash, its claim. ARGV: the claimer, the claim's TTL (ms), max_request_crashes. Answers {epoch, op,
# body, model, crashes} when claimed, {-1} when the request is not held (answered, or expired), {-2} when another
# worker's claim is live, {-3} while the last claim's lapse would stop the request and its claimer may still speak.
# Field `fate:<epoch>` is what became of that claim: "died" (counted), "alive" (its claimer said so, or gave it back).
_CLAIM = """
local req = redis.call('HMGET', KEYS[1], 'op', 'body', 'model', 'epoch', 'crashes')
if not req[2] then return {-1} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {-2} end
local last = tonumber(req[4]) or 0
local crashes = tonumber(req[5]) or 0
if last > 0 and not redis.call('HGET', KEYS[1], 'fate:' .. last) then
  if crashes + 1 >= tonumber(ARGV[3]) then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local seen = tonumber(redis.call('HGET', KEYS[1], 'lapsed:' .. last))
    if not seen then redis.call('HSET', KEYS[1], 'lapsed:' .. last, now) end
    if not seen or now - seen < tonumber(ARGV[2]) then return {-3} end
  end
  redis.call('HSET', KEYS[1], 'fate:' .. last, 'died')
  crashes = redis.call('HINCRBY', KEYS[1], 'crashes', 1)
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'worker', ARGV[1])
redis.call('SET', KEYS[2], ARGV[1] .. ':' .. epoch, 'PX', ARGV[2])
return {epoch, req[1], req[2], req[3], crashes}
"""
# KEYS: the request's hash, its claim. ARGV: the claim's token, its epoch. Gives the claim back if it is still
# this one, and marks its claimer alive in the record (if the request is still held): it counts no death.
_RELEASE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'fate:' .. ARGV[2], 'alive') end
return 1
"""
# KEYS: the request's hash. ARGV: the epoch of a claim its claimer lost while alive. No death: a count already made
# for it is taken back.
_ALIVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local fate = 'fate:' .. ARGV[1]
if redis.call('HGET', KEYS[1], fate) == 'died' then redis.call('HINCRBY', KEYS[1], 'crashes', -1) end
redis.call('HSET', KEYS[1], fate, 'alive')
return 1
"""


@dataclass(frozen=True)
class ClaimedRequest:
    """A control request this worker claimed: run it, then answer under the claim's epoch."""

    future_id: str
    epoch: int
    op: str
    raw_request: bytes
    base_model: str
    crashes: int = 0  # earlier claims that ended with their claimer's death (lapsed, and it never said it was alive)

    @property
    def rerun(self) -> bool:
        """Whether an earlier claim ran it before (its claimer died or gave it back)."""
        return self.epoch > 1

    def request(self) -> OpRequest:
        """The typed request (InvalidRequestError if it does not parse)."""
        return op_request(self.op).decode(self.raw_request)


class ControlRequests:
    """The held control requests, and this process's claims on them (`holder`: the worker's hostname)."""

    def __init__(self, redis, holder: str = "", ttl_ms: int = LEASE_TTL_MS):
        self.redis = redis
        self.claims = LeaseManager(redis, holder, ttl_ms, key=names.control_claim_key)
        self._claim = redis.register_script(_CLAIM)
        self._release = redis.register_script(_RELEASE)
        self._alive = redis.register_script(_ALIVE)

    # ------------------------------------------------------------ the client
    @staticmethod
    def queue_hold(pipe, future_id: str, request: ControlRequest, ttl_s: float = CONTROL_REQUEST_TTL_S) -> None:
        """Queue on `pipe` the record of a request about to be rung (its model's control queue), runnable `ttl_s`."""
        base_model = request.base_model
        now = time.time()
        key = names.control_request_key(future_id)
        pipe.hset(key, mapping={"op": request.op, "model": base_model, "body": request.encode(), "at": repr(now)})
        pipe.expire(key, max(1, int(ttl_s)))
        pipe.zadd(names.control_pending_key(base_model), {future_id: now})
        pipe.expire(names.control_pending_key(base_model), max(CONTROL_REQUEST_TTL_S, int(ttl_s)))

    def is_held(self, future_id: str) -> bool:
        """Whether the request is still to be answered: held, neither answered nor expired."""
        return bool(self.redis.exists(names.control_request_key(future_id)))

    def claimer(self, future_id: str) -> str | None:
        """The worker whose claim on the request is live, if any."""
        value = self.redis.get(names.control_claim_key(future_id))
        return None if value is None else value.decode().rsplit(":", 1)[0]

    # ------------------------------------------------------------ the worker
    def claim(self, future_id: str, max_crashes: int) -> ClaimedRequest | None:
        """Claim the request to run it; None when it is answered, expired, or another worker's claim is live, or
        while the lapse of the last claim would bring its deaths to `max_crashes` and its claimer may yet say it is
        alive (for a lease TTL after the lapse is first seen here)."""
        keys = [names.control_request_key(future_id), names.control_claim_key(future_id)]
        answer = self._claim(keys=keys, args=[self.claims.holder, self.claims.ttl_ms, max_crashes])
        if int(answer[0]) < 0:
            return None
        op, model = (v.decode() if isinstance(v, bytes) else v for v in (answer[1], answer[3]))
        return ClaimedRequest(future_id, int(answer[0]), op, answer[2], model, int(answer[4]))

    def release(self, future_id: str, epoch: int) -> None:
        """Give back this worker's claim at `epoch` (a warm shutdown): the next claim runs the request at once, and
        does not count this one as a death."""
        keys = [names.control_request_key(future_id), names.control_claim_key(future_id)]
        self._release(keys=keys, args=[self.claims.token(epoch), epoch])

    def alive(self, future_id: str, epoch: int) -> None:
        """This worker's claim at `epoch` is lost, and this worker alive (it was paused or starved past the lease):
        the lapse is no death, and a count a later claim made of it is taken back."""
        self._alive(keys=[names.control_request_key(future_id)], args=[epoch])

    def orphans(self, base_model: str, unclaimed_after_s: float = UNCLAIMED_RERUN_S) -> list[str]:
        """The model's held requests that nobody runs: claimed before and the claim lapsed, or never claimed for
        `unclaimed_after_s`; oldest first. Entries of requests that expired are dropped from the pending set."""
        pending_key = names.control_pending_key(base_model)
        entries = self.redis.zrange(pending_key, 0, -1, withscores=True)
        if not entries:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for fid, _ in entries:
                pipe.hget(names.control_request_key(fid.decode()), "epoch")
                pipe.exists(names.control_request_key(fid.decode()))
                pipe.exists(names.control_claim_key(fid.decode()))
            found = pipe.execute()
        stale, orphans, now = [], [], time.time()
        for (fid, at), epoch, held, claimed in zip(entries, found[::3], found[1::3], found[2::3]):
            if not held:  # expired (an answer removes its pending entry itself)
                stale.append(fid)
            elif not claimed and (int(epoch or 0) > 0 or at < now - unclaimed_after_s):
                orphans.append(fid.decode())
        if stale:
            self.redis.zrem(pending_key, *stale)
        return orphans

    def queue_done(self, pipe, future_id: str, base_model: str) -> None:
        """Queue on `pipe` (the answer's transaction) the end of the request: its record, claim and pending entry."""
        pipe.delete(names.control_request_key(future_id), names.control_claim_key(future_id))
        pipe.zrem(names.control_pending_key(base_model), future_id)
