"""The device lock's turns: a released device goes to the waiter serving the least-served tenant.

Waiters are real threads queued one after another (each is seen waiting before the next starts); the
order in which they get the device is recorded, never timed.
"""

from __future__ import annotations

import threading
import time

import pytest

from treadle.gpu_worker.scheduling.device_lock import DeviceLock, serving

WAIT_S = 30.0


def _granted_order(lock: DeviceLock, waiters: list[tuple[str, dict[str, float] | None]]) -> list[str]:
    """Queue `waiters` (name, tenants) in this order behind a hold of this thread, release, and return the order
    in which they got the device."""
    order: list[str] = []

    def wait(name: str, tenants: dict[str, float] | None) -> None:
        with lock.hold(tenants) if tenants is not None else lock:
            order.append(name)

    lock.acquire({})
    threads = []
    for count, (name, tenants) in enumerate(waiters, start=1):
        threads.append(threading.Thread(target=wait, args=(name, tenants)))
        threads[-1].start()
        deadline = time.monotonic() + WAIT_S
        while len(lock._waiting) < count:  # the next one arrives only after this one waits
            assert time.monotonic() < deadline, "a waiter never queued"
            time.sleep(0.001)
    lock.release()
    for thread in threads:
        thread.join(WAIT_S)
    return order


def test_the_least_served_tenant_goes_first_whoever_arrived_first():
    lock = DeviceLock()
    lock.tags.charge("heavy", 1.0, turn=1)
    order = _granted_order(lock, [("heavy op", {"heavy": 1}), ("light op", {"light": 1})])
    assert order == ["light op", "heavy op"]


def test_a_decode_step_with_one_row_of_a_light_tenant_goes_before_the_heavy_tenants_op():
    lock = DeviceLock()
    lock.tags.charge("heavy", 1.0, turn=1)
    order = _granted_order(lock, [("heavy op", {"heavy": 1}), ("mixed step", {"heavy": 16, "light": 1})])
    assert order == ["mixed step", "heavy op"]


def test_equals_and_waiters_naming_no_tenant_go_in_arrival_order():
    lock = DeviceLock()
    order = _granted_order(lock, [("first", {"a": 1}), ("second", {"b": 1}), ("third", None), ("fourth", {"a": 1})])
    assert order == ["first", "second", "third", "fourth"]


def test_a_hold_is_charged_to_its_tenants_by_their_shares():
    lock = DeviceLock()
    with lock.hold({"a": 3, "b": 1}):
        time.sleep(0.01)
    assert lock.tags.tags["a"] > 0
    assert lock.tags.tags["a"] == pytest.approx(3 * lock.tags.tags["b"])


def test_serving_names_the_tenant_of_holds_that_name_none_and_nesting_charges_once():
    lock = DeviceLock()
    with serving("session-1"):
        with lock:
            with lock:  # an engine method calling another: one hold
                time.sleep(0.01)
    with lock:  # outside `serving`: nobody is charged
        time.sleep(0.01)
    assert set(lock.tags.tags) == {"session-1"}
    held = lock.tags.tags["session-1"]
    assert held >= 0.01
    with serving("session-1"), lock:
        pass
    assert lock.tags.tags["session-1"] >= held


def test_a_tenant_that_was_idle_rejoins_at_the_clock_with_no_credit_banked():
    lock = DeviceLock()
    lock.tags.charge("busy", 5.0, turn=1)
    lock.tags.charge("other", 4.0, turn=2)
    # "other" is granted: the clock moves to its tag, so a newcomer counts as having had that much.
    assert _granted_order(lock, [("busy", {"busy": 1}), ("other", {"other": 1})]) == ["other", "busy"]
    assert lock.tags.tag("newcomer") >= 4.0


def test_a_holder_keeps_the_device_between_forwards_while_it_serves_the_least_served_tenant():
    lock = DeviceLock()
    lock.tags.charge("heavy", 1.0, turn=1)
    kept = []

    def heavy_op() -> None:
        with serving("heavy"), lock:
            pass

    with lock.hold({"heavy": 16, "light": 1}):
        waiter = threading.Thread(target=heavy_op)
        waiter.start()
        deadline = time.monotonic() + WAIT_S
        while not lock._waiting:
            assert time.monotonic() < deadline, "the heavy op never queued"
            time.sleep(0.001)
        kept.append(lock.keep({"heavy": 16, "light": 1}))  # the light tenant's rows are still in the batch
        kept.append(lock.keep({"heavy": 16}))  # they ended: equals take turns, the waiting op goes next
    waiter.join(WAIT_S)
    assert kept == [True, False]
    assert not waiter.is_alive()


def test_each_tenants_device_seconds_add_up_over_holds_until_it_is_forgotten():
    lock = DeviceLock()
    with lock.hold({"a": 3, "b": 1}):
        time.sleep(0.01)
    first = dict(lock.seconds)
    assert first["a"] == pytest.approx(3 * first["b"]) and first["b"] > 0
    with lock.hold({"a": 1}):
        time.sleep(0.01)
    assert lock.seconds["a"] > first["a"] and lock.seconds["b"] == first["b"]
    lock.forget("a")
    assert "a" not in lock.seconds and lock.seconds["b"] == first["b"]


def test_an_op_inside_a_kept_hold_is_charged_when_its_own_hold_ends_not_when_the_kept_one_does():
    """The sequencer keeps the device across a session's ops; each op's time must be counted before its result is
    stored (a client that reads the session's device seconds after a result sees that op in them)."""
    lock = DeviceLock()
    with lock.hold({"session-1": 1.0}):  # the hold kept across ops
        with serving("session-1"), lock:  # one op
            time.sleep(0.01)
        after_op = lock.seconds["session-1"]
        assert after_op >= 0.01
        time.sleep(0.01)
    assert lock.seconds["session-1"] >= after_op + 0.01  # the kept hold's remaining time is charged at its end
