"""Usage metering against a real Redis: exact totals, exactly-once per (session, op_id), per owner, since."""

from __future__ import annotations

import threading

import redis

from treadle.metering import SDK_OWNER, Meter, OpUsage, Usage


def _op(session, seq, owner="alice", at=1000.0, **counts):
    return OpUsage(session_id=session, op_id=str(seq), op="forward_backward", owner=owner, base_model="tiny", at=at, **counts)


def test_totals_per_session_and_owner_are_exact(redis_client):
    meter = Meter(redis_client)
    assert meter.record(_op("s1", 1, prefill_tokens=14, trained_tokens=14, compute_s=0.25))
    assert meter.record(_op("s1", 2, prefill_tokens=3, sampled_tokens=40, compute_s=0.5))
    assert meter.record(_op("s2", 1, owner="bob", trained_tokens=7))
    assert meter.session_usage("s1") == Usage(ops=2, prefill_tokens=17, sampled_tokens=40, trained_tokens=14, compute_s=0.75)
    assert meter.owner_usage("alice") == meter.session_usage("s1")
    assert meter.owner_usage("bob") == Usage(ops=1, trained_tokens=7)
    assert meter.owners() == ["alice", "bob"]
    assert [o.op_id for o in meter.session_ops("s1")] == ["1", "2"]


def test_a_replayed_or_redelivered_op_is_never_counted_twice(redis_client):
    meter = Meter(redis_client)
    first = _op("s1", 5, trained_tokens=9, compute_s=1.0)
    assert meter.record(first)
    # A replay after a failover measures the op again (other seconds): still the first record only.
    assert not meter.record(first.model_copy(update={"compute_s": 2.0, "at": 2000.0}))
    assert meter.session_usage("s1") == Usage(ops=1, trained_tokens=9, compute_s=1.0)


def test_concurrent_duplicates_count_once(redis_url):
    """Eight clients record the same 50 ops at once (redelivery racing a replay): each counts once."""
    def record_all():
        meter = Meter(redis.Redis.from_url(redis_url))
        for seq in range(50):
            meter.record(_op("race", seq, trained_tokens=seq))

    redis.Redis.from_url(redis_url).flushdb()
    threads = [threading.Thread(target=record_all) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert Meter(redis.Redis.from_url(redis_url)).session_usage("race") == Usage(ops=50, trained_tokens=sum(range(50)))


def test_since_sums_exactly_the_ops_at_or_after_it(redis_client):
    meter = Meter(redis_client)
    for seq, at in enumerate([100.0, 200.0, 300.0, 400.0]):
        meter.record(_op("s1" if seq % 2 else "s2", seq, at=at, sampled_tokens=10 ** seq))
    assert meter.owner_usage("alice", since=300.0) == Usage(ops=2, sampled_tokens=100 + 1000)
    assert meter.owner_usage("alice", since=0) == meter.owner_usage("alice")
    assert meter.owner_usage("alice", since=401.0) == Usage()


def test_sdk_sessions_are_billed_to_the_sdk_owner_and_records_survive_a_new_client(redis_url):
    Meter(redis.Redis.from_url(redis_url)).record(OpUsage(session_id="s9", op_id="1", op="sample", sampled_tokens=3))
    again = Meter(redis.Redis.from_url(redis_url))
    assert again.owner_usage(SDK_OWNER).sampled_tokens == 3
    assert redis.Redis.from_url(redis_url).ttl("treadle:usage:ops:s9") > 300 * 24 * 3600
