"""Connections both halves of the queue use: a fail-fast Redis client, and an op's doorbell.

The client (`ops_client`) rings an op it journaled; the worker (`executor.sequencer`) rings the next op it
found journaled behind one it ran. Both import this module, so neither imports the other's half.
"""

from __future__ import annotations

import redis as redis_lib

from treadle.errors import BrokerUnavailableError
from treadle.queue import names
from treadle.queue.ops import task_name

CONNECT_TIMEOUT_S = 3.0


def connect_redis(url: str) -> "redis_lib.Redis":
    """A Redis client that fails fast (seconds, not minutes) when the server is unreachable."""
    client = redis_lib.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=30,
        health_check_interval=30,
        retry_on_timeout=True,
    )
    try:
        client.ping()
    except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError) as exc:
        raise BrokerUnavailableError(
            f"cannot reach Redis at {url} within {CONNECT_TIMEOUT_S:.0f} s ({exc}); start a stack with "
            "`treadle up` or set TREADLE_BROKER_URL"
        ) from None
    return client


def ring(app, session_id: str, seq: int, op: str) -> None:
    """The doorbell of a journaled op: whoever owns the session runs it (and any before it)."""
    app.send_task(
        task_name(op),
        args=[session_id, seq],
        queue=names.session_queue(session_id),
        task_id=names.future_id(session_id, seq),
        ignore_result=True,
    )
