"""Failover: adopting the sessions of a dead worker, so that its crash is invisible to the loop.

When a session's lease lapses (its owner died), a worker serving its base model takes it: it rebuilds
the session from its last checkpoint and journal, subscribes to the queue, and runs whatever the
journal holds. The client's futures simply resolve later. A caretaker pass does this for every orphan,
and unloads sessions that sat idle.

The adopter also counts the death against the op the owner was running, if it was running one (its seq is
marked running in the record before it runs, treadle.gpu_worker.executor.sequencer): an op that killed
`max_request_crashes` workers is answered with CrashingRequestError instead of being run again, so one op
that crashes its worker cannot take down every worker of its model in turn.

Nothing is taken back from the dead owner's Celery messages: they are doorbells, and the journal has
every op they rang for (the broker runs without kombu's ack emulation, see treadle.queue.celery_app).
"""

from __future__ import annotations

import json
import logging
import time

from treadle.errors import ServerError, SessionLostError
from treadle.gpu_worker.sessions.autosave import Autosaver
from treadle.gpu_worker.sessions.expiry import expire_idle
from treadle.gpu_worker.sessions.hosting import OwnedSession, SessionHost
from treadle.gpu_worker.executor.sequencer import Sequencer
from treadle.observability import metrics
from treadle.queue import names
from treadle.queue.ops import CreateSessionRequest, CreateSessionResponse

log = logging.getLogger("treadle.worker")


class Failover:
    def __init__(
        self,
        host: SessionHost,
        sequencer: Sequencer,
        autosaver: Autosaver,
        *,
        idle_unload_s: float,
        session_idle_ttl_s: float = 0.0,
    ):
        self.host = host
        self.sequencer = sequencer
        self.autosaver = autosaver
        self.idle_unload_s = idle_unload_s
        self.session_idle_ttl_s = session_idle_ttl_s

    def caretaker_pass(self) -> None:
        """Adopt every orphaned session this worker can serve, then expire and unload idle ones."""
        host = self.host
        for record in host.registry.all():
            if (
                record.status == "active"
                and record.worker
                and record.base_model in host.engines
                and record.session_id not in host.owned
                and not host.lease.is_held(record.session_id)
            ):
                self.take_over(record.session_id)
        self.sequencer.nudge_stalled()
        if self.session_idle_ttl_s:
            expire_idle(host, self.autosaver, self.sequencer.results, self.session_idle_ttl_s)
        if self.idle_unload_s:
            self.autosaver.unload_idle(self.idle_unload_s)

    def take_over(self, session_id: str) -> bool:
        """Adopt a session whose owner died: restore its in-flight message, load, replay, subscribe."""
        host = self.host
        record = host.registry.get(session_id)
        if record is None or record.status != "active" or record.base_model not in host.engines:
            return False
        epoch = host.lease.acquire(session_id)
        if epoch is None:
            return False
        t0 = time.monotonic()
        with host.op_lock:
            crashed = self._count_crash(session_id)
            record = host.registry.get(session_id)
            # Owned before the rebuild, so the heartbeat renews the lease while a long replay runs
            # (a replay longer than the lease TTL would otherwise lose the session it is rebuilding).
            host.owned[session_id] = OwnedSession(
                record=record,
                epoch=epoch,
                applied=record.applied,
                checkpointed=record.checkpoint_seq,
                crashed=crashed if crashed[0] == record.applied + 1 else None,
            )
            try:
                timings = host.rebuild(record)
            except SessionLostError as exc:
                # Nothing can rebuild it, here or elsewhere: say so to every waiting future instead of
                # letting each caretaker adopt and fail again.
                host.owned.pop(session_id, None)
                host.registry.update(session_id, status="lost", last_recovery=exc.message)
                host.lease.release(session_id, epoch)
                log.error("session %s is lost: %s", session_id, exc.message)
                return False
            except Exception:
                host.owned.pop(session_id, None)
                host.lease.release(session_id, epoch)
                raise
            timings["total_s"] = time.monotonic() - t0
            host.registry.update(
                session_id,
                worker=host.hostname,
                last_recovery=json.dumps({**timings, "at": time.time(), "replayed_to": record.applied}),
            )
            metrics.LEASE_TAKEOVERS.labels(record.base_model).inc()
            log.info(
                "took over session %s (epoch %d, applied %d) in %.2f s",
                session_id,
                epoch,
                record.applied,
                timings["total_s"],
            )
        host.subscribe(names.session_queue(session_id))
        with host.op_lock:
            # Ops whose doorbell died with the old owner are in the journal: run them now.
            owned = host.owned[session_id]
            owned.max_seen = max([owned.applied, *host.journal.seqs(session_id)])
            self.sequencer.drain(session_id)
        return True

    def _count_crash(self, session_id: str) -> tuple[int, int]:
        """The op that killed the previous owner, counted (`SessionRegistry.count_crash`): (seq, deaths) when its
        deaths reach `max_request_crashes`, else (0, 0)."""
        seq, deaths, counted = self.host.registry.count_crash(session_id)
        if counted:
            log.warning(
                "session %s: its worker died running op %d (workers that died running it: %d)", session_id, seq, deaths
            )
        return (seq, deaths) if deaths >= self.sequencer.max_crashes else (0, 0)

    def resume_create(self, req: CreateSessionRequest) -> CreateSessionResponse:
        """Run again a session creation whose worker died in it (treadle.gpu_worker.executor.control_ops): a session
        it registered is adopted here, unless another worker owns it already; one it did not is created."""
        host = self.host
        record = host.registry.get(req.session_id)
        if record is None or record.status != "active":
            return host.create(req)
        adopted = req.session_id in host.owned or self.take_over(req.session_id)
        if not adopted and not host.lease.is_held(req.session_id):  # held: another worker adopted it
            raise ServerError(f"session {req.session_id}: its creation was interrupted and it could not be adopted")
        host.publish(record)
        return CreateSessionResponse(session_id=record.session_id, run_id=record.run_id)
