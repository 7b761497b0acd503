"""Session hosting: the sessions this worker owns, and how one is created, rebuilt and released.

A session is owned while this worker holds its lease (with a fencing epoch). Its engine state can
always be rebuilt from the registry: the last automatic checkpoint, then the journal's stateful ops
after it, replayed with the same handlers that ran them the first time. That is how a session is
adopted after a crash, reloaded after idle unloading, and created from a saved state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Callable

from redis import Redis

from treadle.errors import ServerError, SessionLostError, TreadleError, UnknownModelError
from treadle.gpu_worker.sessions.checkpoint_io import load_checkpoint
from treadle.gpu_worker.sessions.op_handlers import OpContext, handler_for
from treadle.metering import SDK_OWNER
from treadle.queue import names
from treadle.queue.journal import Journal
from treadle.queue.lease import LeaseManager
from treadle.queue.ops import CreateSessionRequest, CreateSessionResponse
from treadle.queue.sessions import SessionRecord, SessionRegistry
from treadle.quotas import SessionQuota
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.types import FullConfig

log = logging.getLogger("treadle.worker")


class LeaseLost(Exception):
    """The worker's lease on a session ended while one of its ops ran (the worker was paused, or starved long
    enough for its heartbeat to miss the TTL). Not an error of the op: the session's next owner runs it again
    from the journal, so the op's client must not see this; the sequencer hands the session over instead of
    storing a result."""


@dataclass
class OwnedSession:
    record: SessionRecord
    epoch: int
    applied: int
    unloaded: bool = False
    # Highest seq whose doorbell this worker has heard: a doorbell runs the ops up to it, so one
    # session's backlog does not run inside a single Celery task while other sessions wait.
    max_seen: int = 0
    stalled_at: int | None = None  # `applied` when the caretaker last saw an op waiting (Sequencer.nudge_stalled)
    anticipate: bool = True  # wait for its next op while others wait, when owed (False after a wait found none)
    last_checkpoint_at: float = field(default_factory=time.monotonic)
    checkpointed: int = 0  # the seq its last checkpoint covers (taken by this worker, or the one it was rebuilt from)
    pending_upload: Future | None = None
    # (seq, deaths): the next op, which killed `max_request_crashes` workers; answered with an error, not run
    crashed: tuple[int, int] | None = None

    @property
    def session_id(self) -> str:
        return self.record.session_id


@dataclass(frozen=True)
class SessionStores:
    """Where owned sessions' state lives in Redis: the connection, the session records, the op journals and the
    leases. The sequencer, failover, autosave and expiry are given these, not a path through the host."""

    redis: Redis
    registry: SessionRegistry
    journal: Journal
    lease: LeaseManager

    @classmethod
    def on(cls, redis: Redis, lease: LeaseManager) -> "SessionStores":
        return cls(redis=redis, registry=SessionRegistry(redis), journal=Journal(redis), lease=lease)


@dataclass(frozen=True)
class SessionLimits:
    """What a worker allows its sessions' owners: concurrent sessions (`quota`, checked on the worker so that no
    client can skip it) and queued ops per session and per owner (backpressure, treadle.queue.journal: written into
    each new session's record, where submits read them; 0: no bound)."""

    quota: SessionQuota | None = None
    max_queued_ops: int = 0
    max_owner_queued_ops: int = 0


def engine_of(engines: dict, hostname: str, base_model: str):
    """The engine of `engines` that serves `base_model` on worker `hostname`, or an error naming those it serves."""
    try:
        return engines[base_model]
    except KeyError:
        raise UnknownModelError(
            f"base_model: {base_model!r} is not served by worker {hostname}; it serves {', '.join(engines)}"
        ) from None


class SessionHost:
    """The sessions this worker owns (`owned`), and their life: create, rebuild (adoption, reload), release."""

    def __init__(
        self,
        *,
        hostname: str,
        engines: dict,
        stores: SessionStores,
        store: CheckpointStore,
        limits: SessionLimits = SessionLimits(),
        remember_sampler: Callable[[str, str], None],
        subscribe: Callable[[str], None],
        unsubscribe: Callable[[str], None],
    ):
        self.hostname = hostname
        self.limits = limits
        self.engines = engines
        self.store = store
        self.stores = stores
        self.lease, self.journal, self.registry = stores.lease, stores.journal, stores.registry
        # One op at a time on this worker's engines: the op loop, recovery, unloading, expiry, the sampler cache.
        self.op_lock = threading.RLock()
        self.owned: dict[str, OwnedSession] = {}
        self._remember_sampler = remember_sampler
        self.subscribe = subscribe
        self.unsubscribe = unsubscribe

    def engine(self, base_model: str):
        return engine_of(self.engines, self.hostname, base_model)

    def context(self, owned: OwnedSession, seq: int) -> OpContext:
        return OpContext(
            engine=self.engine(owned.record.base_model),
            session=owned.record,
            seq=seq,
            store=self.store,
            fence=lambda: self.fence(owned),
            remember_sampler=self._remember_sampler,
        )

    def fence(self, owned: OwnedSession) -> None:
        if owned.epoch >= 0 and not self.lease.holds(owned.session_id, owned.epoch):
            raise LeaseLost(f"session {owned.session_id}: this worker lost its lease; not writing")

    # ------------------------------------------------------------ create
    def create(self, req: CreateSessionRequest) -> CreateSessionResponse:
        engine = self.engine(req.base_model)
        owner = req.owner or SDK_OWNER
        if self.limits.quota is not None:  # before anything exists, so a refused create leaves nothing behind
            memory = engine.full_memory.session_bytes(req.full) if req.full else 0
            self.limits.quota.admit(owner, req.session_id, memory)
        record = self._new_record(req)
        if not self.registry.create(record):  # (a creation interrupted by a crash re-runs as `Failover.resume_create`)
            raise ServerError(f"session_id: {req.session_id!r} already exists")
        epoch = self.lease.acquire(req.session_id)
        if epoch is None:
            raise ServerError(f"session {req.session_id}: could not take its lease")
        with self.op_lock:
            self._load_new(engine, req, record, epoch)
            self.owned[req.session_id] = OwnedSession(record=record, epoch=epoch, applied=0)
        self.publish(record)
        self.subscribe(names.session_queue(req.session_id))
        log.info("session %s created on %s (epoch %d)", req.session_id, req.base_model, epoch)
        return CreateSessionResponse(session_id=record.session_id, run_id=record.run_id)

    def _new_record(self, req: CreateSessionRequest) -> SessionRecord:
        # A fixed seed makes the adapter's initialisation replayable after a crash.
        lora = (
            req.lora
            if req.lora.seed is not None
            else req.lora.model_copy(update={"seed": int.from_bytes(os.urandom(4), "little")})
        )
        return SessionRecord(
            session_id=req.session_id,
            run_id=req.session_id,
            base_model=req.base_model,
            lora=lora,
            full=req.full,
            owner=req.owner,
            user_metadata=req.user_metadata,
            checkpoint=req.from_state,
            checkpoint_seq=0,
            checkpoint_with_optimizer=req.with_optimizer,
            checkpoint_every=req.checkpoint_every,
            max_queued_ops=self.limits.max_queued_ops,
            max_owner_queued_ops=self.limits.max_owner_queued_ops,
        )

    def _load_new(self, engine, req: CreateSessionRequest, record: SessionRecord, epoch: int) -> None:
        """The new session's engine state: a fresh adapter, or the saved state it starts from. On a failure nothing
        is left behind: a record left would look like an orphan that every caretaker adopts (and fails to load)."""
        try:
            if req.from_state:
                manifest = load_checkpoint(engine, self.store, req.session_id, req.from_state, req.with_optimizer)
                if manifest.lora_config:
                    record.lora = record.lora.model_validate(manifest.lora_config)
                    self.registry.update(req.session_id, lora=record.lora)
                if manifest.extra.get("full_config"):
                    record.full = FullConfig.model_validate(manifest.extra["full_config"])
                    self.registry.update(req.session_id, full=record.full)
                self.registry.update(req.session_id, step=engine.step(req.session_id))
            else:
                engine.create_session(req.session_id, record.lora, full=record.full)
            record.memory_bytes = engine.session_memory(req.session_id)  # what status and the meter count it by
            self.registry.update(req.session_id, memory_bytes=record.memory_bytes)
        except Exception:
            self.registry.delete(req.session_id)
            self.lease.release(req.session_id, epoch)
            if self.limits.quota is not None:
                self.limits.quota.release(req.owner or SDK_OWNER, req.session_id)
            raise

    def publish(self, record: SessionRecord) -> None:
        """What shows a created session: its queued ops counted against its owner's bound (a stopped one leaves),
        its training run in the checkpoint store, where the REST API lists it. Doing it again changes nothing."""
        if self.limits.max_owner_queued_ops:
            self.stores.redis.sadd(names.owner_sessions_key(record.owner or SDK_OWNER), record.session_id)
        self.store.put_run(
            record.run_id,
            {
                "training_run_id": record.run_id,
                "base_model": record.base_model,
                "lora_rank": None if record.full else record.lora.rank,
                "lora_config": record.lora.model_dump(),
                "full_config": record.full.model_dump() if record.full else None,
                "created_at": record.created_at,
                "owner": record.owner,
                "user_metadata": record.user_metadata,
            },
        )

    # ------------------------------------------------------------ rebuild
    def rebuild(self, record: SessionRecord) -> dict:
        """Engine state of a session at `record.applied`: last checkpoint, then the journal replayed."""
        engine = self.engine(record.base_model)
        if engine.has_session(record.session_id):
            engine.drop_session(record.session_id)
        t0 = time.monotonic()
        if record.checkpoint:
            load_checkpoint(engine, self.store, record.session_id, record.checkpoint, record.checkpoint_with_optimizer)
        else:
            engine.create_session(record.session_id, record.lora, full=record.full)
        t1 = time.monotonic()
        replaying = OwnedSession(record=record, epoch=-1, applied=record.checkpoint_seq)
        for seq in range(record.checkpoint_seq + 1, record.applied + 1):
            entry = self.journal.get(record.session_id, seq)
            if entry is None:
                raise SessionLostError(f"session {record.session_id}: op {seq} is neither checkpointed nor journaled")
            if entry.stateful and seq not in record.crashed_ops:  # an op answered without running changed nothing
                try:
                    handler_for(entry.op)(entry.request(), self.context(replaying, seq))
                except TreadleError:
                    pass  # it failed the first time too, and left no state behind
            replaying.applied = seq
        return {
            "load_s": t1 - t0,
            "replay_s": time.monotonic() - t1,
            "replayed_ops": record.applied - record.checkpoint_seq,
        }

    # ------------------------------------------------------------ release
    def release(self, session_id: str, *, drop_lease: bool) -> None:
        owned = self.owned.pop(session_id, None)
        if owned is None:
            return
        self.unsubscribe(names.session_queue(session_id))
        engine = self.engine(owned.record.base_model)
        if engine.has_session(session_id):
            engine.drop_session(session_id)
        engine.device.forget(session_id)
        if drop_lease:
            self.lease.release(session_id, owned.epoch)

    def finish(self, session_id: str) -> None:
        """After a stop op: free the session for good."""
        # Marked stopped first, so that no caretaker adopts the session once its lease is gone.
        self.registry.update(session_id, status="stopped")
        self.release(session_id, drop_lease=True)
        # Nothing will replay a stopped session: free its journal, keep its record a week.
        self.journal.drop(session_id)
        self.stores.redis.expire(names.session_key(session_id), 7 * 24 * 3600)
