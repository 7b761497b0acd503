"""The hand-off's wait (treadle.gpu_worker.scheduling.linger) against a real Redis, without a worker.

The worker-level behaviour (no doorbell, control messages, shutdown, a crash while waiting) is in
tests/test_handoff.py and tests/test_durability.py; these pin the wait's own edges.
"""

from __future__ import annotations


import pytest
import redis

from treadle.gpu_worker.scheduling.linger import Arrival, Linger
from treadle.queue import names

HOST = "linger-test-host"


@pytest.fixture()
def client(redis_client, redis_url):
    """A client that gives up on a silent socket after 5 s: a wait stuck in Redis fails (and says so in the log)."""
    return redis.Redis.from_url(redis_url, socket_timeout=5)


def _wait(linger: Linger, client, next_ops=()) -> tuple[str, int] | None:
    with client.pipeline() as pipe:  # as the sequencer's result write does
        linger.mark(pipe)
        pipe.execute()
    return linger.next([], list(next_ops))


def test_a_wait_ends_whatever_is_left_of_its_window(client, caplog):
    """Redis reads a blocking pop's timeout in whole milliseconds, and 0 blocks for ever: a wait must never
    ask for the sliver left of its window (it did, and a worker's op thread hung for a minute, its sessions
    with it). Windows below 1 ms, and many of the default 20 ms, each end by themselves: none is cut short by the
    client's socket timeout, which the wait reports as a failure."""
    for window_s in [0.0005] * 5 + [0.02] * 30:
        assert _wait(Linger(client, HOST, window_s), client) is None
        assert not client.exists(names.idle_key(HOST))  # ended: submits ring again
    assert "hand-off wait failed" not in caplog.text


def test_a_wake_for_a_session_the_wait_does_not_know_is_run(client):
    """A session adopted while the op thread waits is not among the journals the wait looks at, yet its record
    names this worker, so a submit hands its op over: the wait must run that wake, not drop it."""
    linger = Linger(client, HOST, 0.2)
    with client.pipeline() as pipe:
        linger.mark(pipe)
        pipe.execute()
    client.rpush(names.wake_key(HOST), "adopted 4")  # what the journal's append does with the key it takes
    client.delete(names.idle_key(HOST))
    handed = linger.next([], [("known", 1)])
    assert handed == ("adopted", 4)


def test_an_op_found_in_the_journal_takes_its_wake_with_it(client):
    """An op the wait finds in a journal may also have been handed over (its submit took the key): it runs
    once, and its wake does not come back as a second, empty turn."""
    linger = Linger(client, HOST, 0.2)
    client.hset(names.journal_key("known"), "1", b"noop\n0\n{}")
    client.rpush(names.wake_key(HOST), "known 1")
    assert _wait(linger, client, [("known", 1)]) == ("known", 1)
    assert client.llen(names.wake_key(HOST)) == 0


def test_anticipation_finds_the_sessions_next_op_ends_on_a_control_message_and_gives_up_after_its_window(client):
    """`expect` (the wait for one session's next op while others have ops ready): OP once that op is journaled,
    taking its wake with it; CONTROL when a control queue holds a message; NOTHING when its window passes."""
    linger = Linger(client, HOST, 0.2, anticipate_s=0.05)
    client.delete(names.journal_key("light"), names.wake_key(HOST), "control-queue")
    assert linger.expect(["control-queue"], "light", 3) is Arrival.NOTHING
    client.hset(names.journal_key("light"), "3", b"noop\n0\n{}")
    client.rpush(names.wake_key(HOST), "light 3", "other 7")
    assert linger.expect(["control-queue"], "light", 3) is Arrival.OP
    assert client.lrange(names.wake_key(HOST), 0, -1) == [b"other 7"]  # another session's wake stays
    client.rpush("control-queue", b"a sample request")
    assert linger.expect(["control-queue"], "light", 4) is Arrival.CONTROL
    linger.close()
    assert linger.expect([], "light", 4) is Arrival.NOTHING  # a warm shutdown ends it at once
