"""Riding out a Redis outage: one tolerance and one retry loop for both halves of the queue.

The client (`ops_client`) retries publishing an op and polling for its result; the worker
(`executor.sequencer`) retries storing a result. Both ride out the same outage (a restart under a
supervisor, a failover), so both give up after the same time, and neither imports the other's half.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import redis as redis_lib
from kombu import exceptions as kombu_errors

T = TypeVar("T")

# What a lost Redis raises: redis-py's own errors, a refused socket, and kombu's wrapper around them.
REDIS_ERRORS = (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError, kombu_errors.OperationalError)

# How long an outage is ridden out before the call gives up loudly. Long enough for a restart that
# reloads its data from disk and for a Sentinel failover (whose default failover-timeout is 180 s);
# the worker must be at least as patient as the client waiting for its result, or a result stored a
# moment too late is lost to a client still waiting for it. Past this, it is no restart but a fault
# someone should see, rather than a worker and its clients silently stalled.
REDIS_OUTAGE_TOLERANCE_S = 300.0
FIRST_DELAY_S = 0.1  # the first retry comes soon: most outages are a reconnect
MAX_DELAY_S = 5.0  # then no more than this apart, so a restarted Redis is noticed within seconds

log = logging.getLogger("treadle.queue")


def through_outages(
    call: Callable[[], T],
    *,
    what: str,
    tolerance_s: float = REDIS_OUTAGE_TOLERANCE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `call`, retrying through a Redis outage with exponential backoff (FIRST_DELAY_S doubling
    up to MAX_DELAY_S); once the outage has lasted `tolerance_s`, re-raise its error."""
    delay, since = FIRST_DELAY_S, clock()
    while True:
        try:
            return call()
        except REDIS_ERRORS:
            if clock() - since > tolerance_s:
                raise
            log.warning("Redis unavailable while %s; retrying in %.1f s", what, delay)
            sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)
