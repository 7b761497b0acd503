"""Failover helpers: put a dead worker's in-flight message back at the head of its session queue.

kombu keeps a delivered-but-unacked message in the `unacked` hash until the visibility timeout (hours,
on purpose). When a session changes owner we move its entry back ourselves, to the head (RPUSH: kombu
consumes with BRPOP from the right), in one transaction like kombu's own `restore_by_tag`.
"""

from __future__ import annotations

import json

UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"


def restore_unacked(redis, queue: str, session_id: str) -> int:
    """Move the session's delivered-but-unacked messages back to the head of its queue."""
    session_prefix = f"{session_id}:"
    restored = 0
    for tag, raw in list(redis.hgetall(UNACKED).items()):
        try:
            payload, _exchange, _routing_key = json.loads(raw)
            delivery = payload["properties"].get("delivery_info") or {}
            target = delivery.get("routing_key") or payload["headers"].get("routing_key")
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if target != queue and not str(payload.get("headers", {}).get("id", "")).startswith(session_prefix):
            continue
        payload.get("headers", {})["redelivered"] = True
        with redis.pipeline(transaction=True) as pipe:
            pipe.hdel(UNACKED, tag)
            pipe.zrem(UNACKED_INDEX, tag)
            pipe.rpush(queue, json.dumps(payload))
            removed, _, _ = pipe.execute()
        restored += 1 if removed else 0
    return restored
