"""The hand-off: a worker that has just run a session's ops waits a moment for the next one.

A training loop sends its next op right after it reads a result. Through Celery that op costs a
publish on the client and a delivery on the worker, each of them more Python than the op's own
bookkeeping; on a small machine, where the client, Redis and the worker share the cores, that was
the largest part of the queue's overhead on a short op. So the write that stores an op's result (its
record's one MULTI/EXEC, treadle.gpu_worker.executor.op_record) also sets this worker's idle key, and after its drain the op thread does
not go back to Celery at once: it blocks on its wake list for up to `window_s`. A submit that finds
the key (treadle.queue.journal: the session record names its owner) takes it and pushes
`<session_id> <seq>` instead of ringing, and the same thread runs the op, on the same torch threads,
a fraction of a millisecond later.

Every op still either reaches the thread or rings: a submit takes the key atomically with its journal
write, and the wait ends by deleting the key and popping what was pushed before that. The journals
are the truth, the wake only ends a wait early: every `POLL_S` the thread looks for an owned session
whose next op is journaled (one submitted while no key was set rang too; its doorbell later finds it
run) and for a message on a control queue (a sample request, a session to create), which ends the
wait. A warm shutdown ends it too (`close`).

Redis ends a blocking pop that nothing woke only when it next checks its clients' timeouts, every
1/`hz` seconds (100 ms at Redis's default hz 10), and it reads the timeout in whole milliseconds:
below 1 ms it becomes 0, which blocks for ever. So every pop asks for `POLL_S`, never the window's
remainder (the key's slack covers the overshoot), and the stacks treadle starts run Redis at hz 100,
where a control message waits about 10 ms at most.

The same wait, shorter, runs while other sessions have ops ready (`expect`: anticipation). A session in a closed
loop (submit, read the result, submit the next step) has no op journaled for the few milliseconds its client
takes between two steps. Were the turn given to a tenant with a heavy op ready meanwhile, each of its light steps
would wait for one heavy op. So when the session that just ran is still owed the device, the turns wait up
to `anticipate_s` for its next op first, and charge the wait to it as device time: a client that takes long
to answer pays for the idle device out of its own share (treadle.gpu_worker.executor.turn_scheduler).

The key expires `KEY_SLACK_MS` after its window, so one left by a worker that died lets submits ring
again; an op pushed to a dead worker runs when its session is adopted, from the journal, and one
pushed while an op failed is rung on (`abandon`).
"""

from __future__ import annotations

import logging
import time
from enum import Enum

import redis as redis_lib

from treadle.queue import names

log = logging.getLogger("treadle.worker")

# KEYS: the idle key, the wake list, the control queues this worker consumes, then the journals of the sessions
# it owns. ARGV: the number of control queues, then per session its next seq, then per session its id.
# Answers 'celery' when a control queue holds a message, else '<session_id> <seq>' of the first owned session
# whose next op is journaled (dropping that op's wake, if its submit pushed one: it runs now), else nil.
# Other wakes stay: one may be for a session adopted since the wait began, which is not among KEYS.
_CHECK = """
local n = tonumber(ARGV[1])
for i = 1, n do
  if redis.call('LLEN', KEYS[2 + i]) > 0 then return 'celery' end
end
local m = #KEYS - 2 - n
for j = 1, m do
  if redis.call('HEXISTS', KEYS[2 + n + j], ARGV[1 + j]) == 1 then
    local found = ARGV[1 + m + j] .. ' ' .. ARGV[1 + j]
    redis.call('LREM', KEYS[2], 0, found)
    return found
  end
end
return false
"""
# KEYS: the idle key, the wake list. Deleting the key ends the wait: a submit after it rings. A key already
# gone was taken by a submit, whose op is then on the list (or it expired, and the pop finds nothing).
_END = """
if redis.call('DEL', KEYS[1]) == 1 then return false end
return redis.call('LPOP', KEYS[2])
"""

KEY_SLACK_MS = 500
# How often a wait looks at the journals and the control queues.
POLL_S = 0.005
# How often an anticipation looks. A client's next step comes a millisecond or two after its result, and the
# device idles from its arrival to the next look: at 1 ms a light tenant's median step beside a heavy one was
# 1.17x alone, at a quarter millisecond 1.12x (benchmarks/fairness.py). Each look is one short Lua call.
ANTICIPATION_POLL_S = 0.00025


class Arrival(Enum):
    """What an anticipation's wait (`Linger.expect`) found; the value is the metrics' label."""

    OP = "op"  # the session's next op was journaled
    CONTROL = "control"  # a control message waits, which must be delivered: the wait ends
    NOTHING = "none"  # neither came within the window (or Redis failed)


class Linger:
    def __init__(self, redis, hostname: str, window_s: float, anticipate_s: float = 0.0):
        self.redis = redis
        self.window_s = window_s
        self.anticipate_s = anticipate_s
        self.idle_key, self.wake_key = names.idle_key(hostname), names.wake_key(hostname)
        self._check = redis.register_script(_CHECK)
        self._end = redis.register_script(_END)
        self._closed = False

    def close(self) -> None:
        """No more waits (a warm shutdown: the running Celery task should end)."""
        self._closed = True

    def mark(self, pipe) -> None:
        """Queue on `pipe` (the write that stores an op's result) the idle key: submits from now on hand their
        op to this worker, until `next` ends the wait."""
        if self.window_s > 0 and not self._closed:
            pipe.set(self.idle_key, b"1", px=int(self.window_s * 1000) + KEY_SLACK_MS)

    def next(self, control_queues: list[str], next_ops: list[tuple[str, int]]) -> tuple[str, int] | None:
        """The next op (session_id, seq) to run: one that a submit handed over within the window, or one of
        `next_ops` (each owned session's next seq) that is journaled. None when none came, when a control queue
        holds a message, or after `close` (the wait is over then: submits ring again)."""
        if self.window_s <= 0:
            return None
        keys = [self.idle_key, self.wake_key, *control_queues, *(names.journal_key(sid) for sid, _ in next_ops)]
        args = [len(control_queues), *(seq for _, seq in next_ops), *(sid for sid, _ in next_ops)]
        deadline, raw = time.monotonic() + self.window_s, None
        try:
            while not self._closed and time.monotonic() < deadline:
                raw = self._check(keys=keys, args=args)
                if raw is not None:
                    break
                popped = self.redis.blpop([self.wake_key], timeout=POLL_S)  # see the module docstring
                if popped:
                    raw = popped[1]
                    break
            if raw is None or raw == b"celery":
                raw = self._end(keys=[self.idle_key, self.wake_key])
        except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError):
            log.warning("hand-off wait failed; back to Celery", exc_info=True)
            return self.abandon()  # what was handed over meanwhile runs now
        return None if raw is None else _parse(raw)

    def expect(self, control_queues: list[str], session_id: str, seq: int) -> Arrival:
        """Wait up to `anticipate_s` for the session's op `seq` to be journaled: OP once it is, CONTROL when a control
        queue holds a message first (it must be delivered: the wait ends), NOTHING when neither came (or Redis
        failed: the turns go on, and the next write meets the outage where it is handled)."""
        keys = [self.idle_key, self.wake_key, *control_queues, names.journal_key(session_id)]
        args = [len(control_queues), seq, session_id]
        deadline = time.monotonic() + self.anticipate_s
        try:
            while not self._closed:
                raw = self._check(keys=keys, args=args)  # drops the op's wake, if its submit pushed one: it runs now
                if raw is not None:
                    return Arrival.CONTROL if raw == b"celery" else Arrival.OP
                if time.monotonic() >= deadline:
                    return Arrival.NOTHING
                # Polled, not popped: the wake list may hold another session's wake, which the hand-off wait needs.
                time.sleep(ANTICIPATION_POLL_S)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError):
            log.warning("anticipation wait failed; giving the turn on", exc_info=True)
        return Arrival.NOTHING

    def abandon(self) -> tuple[str, int] | None:
        """End the wait after a failure, so that submits ring again at once: what was handed over meanwhile.
        Should Redis be down, the key expires by itself (the window plus `KEY_SLACK_MS`), and an op handed
        over till then waits for the caretaker's nudge."""
        if self.window_s <= 0:
            return None
        try:
            raw = self._end(keys=[self.idle_key, self.wake_key])
        except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError):
            return None
        return None if raw is None else _parse(raw)


def _parse(raw: bytes) -> tuple[str, int]:
    session_id, _, seq = raw.decode().rpartition(" ")
    return session_id, int(seq)
