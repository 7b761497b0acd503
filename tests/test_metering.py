"""Usage metering against a real Redis: exact totals, exactly-once per (session, op_id), per owner, since."""

from __future__ import annotations

import threading

import redis

from treadle.metering import SDK_OWNER, Meter, OpUsage, Usage


def _op(session, seq, owner="alice", at=1000.0, **counts):
    return OpUsage(
        session_id=session, op_id=str(seq), op="forward_backward", owner=owner, base_model="tiny", at=at, **counts
    )


def test_totals_per_session_and_owner_are_exact(redis_client):
    meter = Meter(redis_client)
    assert meter.record(_op("s1", 1, prefill_tokens=14, trained_tokens=14, compute_s=0.25))
    assert meter.record(_op("s1", 2, prefill_tokens=3, sampled_tokens=40, compute_s=0.5))
    assert meter.record(_op("s2", 1, owner="bob", trained_tokens=7))
    assert meter.session_usage("s1") == Usage(
        ops=2, prefill_tokens=17, sampled_tokens=40, trained_tokens=14, compute_s=0.75
    )
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
        meter.record(_op("s1" if seq % 2 else "s2", seq, at=at, sampled_tokens=10**seq))
    assert meter.owner_usage("alice", since=300.0) == Usage(ops=2, sampled_tokens=100 + 1000)
    assert meter.owner_usage("alice", since=0) == meter.owner_usage("alice")
    assert meter.owner_usage("alice", since=401.0) == Usage()


def test_sdk_sessions_are_billed_to_the_sdk_owner_and_records_survive_a_new_client(redis_url):
    Meter(redis.Redis.from_url(redis_url)).record(OpUsage(session_id="s9", op_id="1", op="sample", sampled_tokens=3))
    again = Meter(redis.Redis.from_url(redis_url))
    assert again.owner_usage(SDK_OWNER).sampled_tokens == 3
    assert redis.Redis.from_url(redis_url).ttl("treadle:usage:ops:s9") > 300 * 24 * 3600


def test_owner_ops_window_is_half_open(redis_client):
    meter = Meter(redis_client)
    for seq, at in enumerate([3600.0, 7199.0, 7200.0]):
        meter.record(_op("s1", seq, at=at, trained_tokens=1))
    assert [o.op_id for o in meter.owner_ops("alice", since=3600.0, until=7200.0)] == ["0", "1"]
    assert [o.op_id for o in meter.owner_ops("alice", since=7200.0)] == ["2"]


def test_billing_events_bucket_by_hour_session_and_kind():
    """The gateway's get_billing_usage rows: training = forward_backward and forward tokens, sampling split
    into prefill and sampled, one checkpoint event per save, each hour its own bucket, bigger first."""
    from treadle.gateway.routes_billing import _events

    def op(name, at, session="s1", **counts):
        return OpUsage(session_id=session, op_id=str(at), op=name, owner="alice", base_model="tiny", at=at, **counts)

    events = _events(
        [
            op("forward_backward", 3600.0, trained_tokens=12),
            op("forward", 3700.0, prefill_tokens=5),
            op("sample", 3800.0, prefill_tokens=4, sampled_tokens=10),
            op("save_state", 3900.0),
            op("forward_backward", 7200.0, trained_tokens=3),
            op("optim_step", 7300.0, compute_s=1.0),
        ]
    )
    rows = [(e["bucket_start"][11:16], e["session_id"], e["event_info"]) for e in events]
    assert rows == [
        ("01:00", "s1", {"type": "training", "token_count": 17}),
        ("01:00", "s1", {"type": "sampling_sample", "token_count": 10}),
        ("01:00", "s1", {"type": "sampling_prefill", "token_count": 4, "cached": False}),
        ("01:00", "s1", {"type": "checkpoint", "count": 1}),
        ("02:00", "s1", {"type": "training", "token_count": 3}),
    ]
    assert events[0]["bucket_end"].startswith("1970-01-01T02:00")
