"""Per-owner concurrent-session quotas against a real Redis: the limit, races, and slots freed by stop/expiry."""

from __future__ import annotations

import threading

import pytest
import redis

from treadle.errors import QuotaExceededError
from treadle.queue.sessions import SessionRecord, SessionRegistry
from treadle.quotas import SessionQuota


def _session(registry, sid, owner="alice", status="active"):
    registry.create(SessionRecord(session_id=sid, run_id=sid, base_model="tiny", owner=owner, status=status))


def test_the_limit_holds_and_a_stopped_or_expired_session_frees_its_slot(redis_client):
    quota, sessions = SessionQuota(redis_client, default_limit=2), SessionRegistry(redis_client)
    for sid in ("s1", "s2"):
        quota.admit("alice", sid)
        _session(sessions, sid)
    with pytest.raises(QuotaExceededError, match=r"owner 'alice' has 2 active training sessions and the limit is 2"):
        quota.admit("alice", "s3")
    quota.admit("alice", "s2")  # admitting a session again (a retried create) takes no second slot
    sessions.update("s1", status="stopped")
    quota.admit("alice", "s3")
    _session(sessions, "s3")
    sessions.update("s2", status="expired")
    quota.admit("alice", "s4")
    assert quota.active("alice") == ["s3", "s4"]
    assert QuotaExceededError("x").category == "user"


def test_per_owner_limits_and_unlimited_owners(redis_client):
    quota = SessionQuota(redis_client, default_limit=None, limits={"bob": 1})
    for i in range(5):
        quota.admit("alice", f"a{i}")
    quota.admit("bob", "b1")
    with pytest.raises(QuotaExceededError, match="limit is 1"):
        quota.admit("bob", "b2")
    quota.release("bob", "b1")
    quota.admit("bob", "b2")


def test_full_sessions_count_by_their_memory(redis_client):
    quota, sessions = SessionQuota(redis_client, memory_limit=1000), SessionRegistry(redis_client)
    quota.admit("erin", "f1", memory_bytes=600)
    _session(sessions, "f1", owner="erin")
    with pytest.raises(QuotaExceededError, match=r"holding 600 bytes; this one needs 500 more and the limit is 1000"):
        quota.admit("erin", "f2", memory_bytes=500)
    quota.admit("erin", "f3", memory_bytes=400)  # fits beside f1
    sessions.update("f1", status="stopped")
    quota.admit("erin", "f2", memory_bytes=500)  # a stopped session's bytes are free again
    assert quota.active("erin") == ["f2", "f3"]


def test_a_create_that_never_made_a_record_stops_counting_after_pending_s(redis_client):
    quota = SessionQuota(redis_client, default_limit=1, pending_s=0.0)
    quota.admit("carol", "never-created")
    quota.admit("carol", "next")  # the first has no record and its grace is over
    strict = SessionQuota(redis_client, default_limit=1, pending_s=3600)
    with pytest.raises(QuotaExceededError):
        strict.admit("carol", "third")  # `next` has no record yet but is still within its grace


def test_racing_creates_never_exceed_the_limit(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    admitted, lock = [], threading.Lock()

    def create(i):
        try:
            SessionQuota(redis.Redis.from_url(redis_url), default_limit=3).admit("dave", f"d{i}")
            with lock:
                admitted.append(i)
        except QuotaExceededError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(admitted) == 3
