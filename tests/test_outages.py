"""One retry loop rides out a Redis outage for both halves of the queue (treadle.queue.outages)."""

from __future__ import annotations

import functools

import pytest
import redis as redis_lib

from treadle.errors import BrokerUnavailableError
from treadle.queue import ops_client, outages
from treadle.queue.ops_client import OpsClient


class FakeClock:
    """Time that passes only when the retry loop sleeps, so no assertion depends on the wall clock."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, error: Exception):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "stored"

    return call, calls


def test_retries_through_a_connection_error_with_bounded_backoff():
    clock = FakeClock()
    call, calls = failing(8, redis_lib.ConnectionError("Connection refused"))
    assert outages.through_outages(call, what="testing", clock=clock, sleep=clock.sleep) == "stored"
    assert len(calls) == 9
    assert clock.sleeps == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]  # doubling, then capped at MAX_DELAY_S


@pytest.mark.parametrize("error", [redis_lib.TimeoutError("timed out"), OSError("reset"), ConnectionResetError()])
def test_every_kind_of_lost_connection_is_ridden_out(error):
    clock = FakeClock()
    call, _ = failing(1, error)
    assert outages.through_outages(call, what="testing", clock=clock, sleep=clock.sleep) == "stored"


def test_gives_up_after_the_tolerance_with_the_outage_error():
    clock = FakeClock()
    call, calls = failing(10**6, redis_lib.ConnectionError("Connection refused"))
    with pytest.raises(redis_lib.ConnectionError, match="refused"):
        outages.through_outages(call, what="testing", tolerance_s=12.0, clock=clock, sleep=clock.sleep)
    # It tried for the whole tolerance and stopped at the first failure past it, not much later.
    assert 12.0 < sum(clock.sleeps) <= 12.0 + outages.MAX_DELAY_S
    assert len(calls) == len(clock.sleeps) + 1


def test_other_errors_are_not_retried():
    clock = FakeClock()
    call, calls = failing(1, ValueError("a bug, not an outage"))
    with pytest.raises(ValueError):
        outages.through_outages(call, what="testing", clock=clock, sleep=clock.sleep)
    assert calls == [1] and clock.sleeps == []


def test_the_client_reports_an_outage_past_the_tolerance_as_broker_unavailable(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(
        ops_client, "through_outages", functools.partial(outages.through_outages, clock=clock, sleep=clock.sleep)
    )
    client = OpsClient.__new__(OpsClient)  # no Redis needed: only the retry path runs
    client.broker_url = "redis://127.0.0.1:1/0"
    call, _ = failing(10**6, redis_lib.ConnectionError("Connection refused"))
    with pytest.raises(BrokerUnavailableError, match=r"127\.0\.0\.1:1.*300 s"):
        client._retrying(call)
    assert sum(clock.sleeps) > outages.REDIS_OUTAGE_TOLERANCE_S
