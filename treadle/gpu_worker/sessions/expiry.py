"""Idle expiry: a session nobody used for `session_idle_ttl_s` is checkpointed and stopped.

An abandoned session would otherwise hold its owner's quota slot and its worker's memory forever.
Expiring one: write its full state (adapter, optimizer, applied seq) as an automatic checkpoint (an
unloaded session has one already), mark its record `expired` with that checkpoint's path, and free it
(lease, journal, queue subscription). Any later op on it fails at once with SessionExpiredError naming
the path: `ServiceClient.create_training_client_from_state_with_optimizer(path)` resumes it exactly.
A session with work waiting in its journal is never idle, so nothing in flight is lost.
"""

from __future__ import annotations

import logging
import time

from treadle.gpu_worker.sessions.autosave import Autosaver
from treadle.gpu_worker.sessions.hosting import SessionHost
from treadle.queue import names
from treadle.queue.results import ResultStore
from treadle.queue.sessions import inactive_error

log = logging.getLogger("treadle.worker")

EXPIRED_RECORD_TTL_S = 30 * 24 * 3600


def expire_idle(host: SessionHost, autosaver: Autosaver, results: ResultStore, ttl_s: float) -> list[str]:
    """Expire every owned session idle for `ttl_s` seconds or more; returns their ids."""
    expired, now = [], time.time()
    for sid, owned in list(host.owned.items()):
        record = host.registry.get(sid)
        if record is None or now - record.last_activity < ttl_s:
            continue
        with host.op_lock:
            if host.journal.has(sid, owned.applied + 1):
                continue  # work is waiting: not idle
            path = record.checkpoint if owned.unloaded else autosaver.checkpoint(owned)
            if path is None:
                continue  # lost the lease meanwhile: its new owner decides
            host.registry.update(sid, status="expired", checkpoint=path, checkpoint_seq=owned.applied)
            # An op submitted while this ran (its client had not yet seen `expired`) is answered, not left waiting.
            error = inactive_error(sid, host.registry.get(sid))
            for seq in host.journal.seqs(sid):
                if seq > owned.applied and not results.is_done(names.future_id(sid, seq)):
                    results.store_error(names.future_id(sid, seq), error)
            host.release(sid, drop_lease=True)
            host.journal.drop(sid)
            host.registry.redis.expire(names.session_key(sid), EXPIRED_RECORD_TTL_S)
        expired.append(sid)
        log.info("session %s expired after %.0f s idle; its state is at %s", sid, now - record.last_activity, path)
    return expired
