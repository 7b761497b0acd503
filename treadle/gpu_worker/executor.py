"""The ordered op executor: runs each session's ops strictly in seq order on this worker's engine.

Celery delivers at least once and, after a crash, out of order (see shared/reference/celery.md).
So the executor never trusts delivery order: every arriving op is recorded in the session's journal,
then the executor runs ops `applied+1, applied+2, ...` for as long as the journal has them. An op that
arrives early waits in the journal for its predecessor; a redelivered op finds its seq applied and
its result already stored. Results are stored under the op's future id, whichever message ran it.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from treadle.errors import ServerError, SessionLostError, SessionNotFoundError, TreadleError
from treadle.queue import names
from treadle.queue.envelope import OpEnvelope, load_payload
from treadle.queue.journal import Journal
from treadle.queue.lease import LeaseManager
from treadle.gpu_worker.op_handlers import HANDLERS
from treadle.queue.ops import OP_REQUESTS, STATEFUL_OPS, CreateSessionRequest, SampleRequest, parse_request
from treadle.queue.results import ResultStore
from treadle.queue.sessions import SessionRecord, SessionRegistry
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.paths import CheckpointPath

log = logging.getLogger("treadle.worker")

# In-memory sampler snapshots kept per worker; older ones are reloaded from the store on demand.
MAX_CACHED_SAMPLERS = 8


@dataclass
class OwnedSession:
    record: SessionRecord
    epoch: int
    applied: int
    unloaded: bool = False
    # Highest seq whose message this worker has received: a message runs the ops up to it, so one
    # session's backlog does not run inside a single Celery task while other sessions wait.
    max_seen: int = 0
    last_checkpoint_at: float = field(default_factory=time.monotonic)
    pending_upload: Future | None = None


class OpExecutor:
    def __init__(self, *, hostname: str, engines: dict, redis, app, store: CheckpointStore,
                 lease: LeaseManager, checkpoint_every: int = 0, checkpoint_interval_s: float = 0.0,
                 slow_ops: dict[str, float] | None = None, subscribe=None, unsubscribe=None):
        self.hostname = hostname
        self.engines = engines
        self.redis = redis
        self.app = app
        self.store = store
        self.lease = lease
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval_s = checkpoint_interval_s
        self.slow_ops = slow_ops or {}
        # Uploads of automatic checkpoints run here, off the op loop; one at a time keeps them ordered.
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-ckpt")
        self.journal = Journal(redis)
        self.results = ResultStore(app)
        self.sessions = SessionRegistry(redis)
        self.owned: dict[str, OwnedSession] = {}
        # One op at a time touches an engine: Celery's pool thread, recovery and idle unloading share it.
        self.compute_lock = threading.RLock()
        self._samplers: OrderedDict[str, str] = OrderedDict()  # sampler id -> base model
        self._subscribe = subscribe or (lambda queue: None)
        self._unsubscribe = unsubscribe or (lambda queue: None)

    # ------------------------------------------------------------ message entry points
    def on_op_message(self, envelope: dict) -> None:
        env = OpEnvelope.model_validate(envelope)
        self.journal.record(env)
        with self.compute_lock:
            owned = self.owned.get(env.session_id)
            if owned is None:
                self._not_ours(env)
                return
            owned.max_seen = max(owned.max_seen, env.seq)
            self.drain(env.session_id)

    def on_create_session(self, future_id: str, payload: dict) -> None:
        try:
            req = parse_request(CreateSessionRequest, payload)
            record = self.create_session(req)
            self.results.store_ok(future_id, {"session_id": record.session_id, "run_id": record.run_id})
        except TreadleError as exc:
            self.results.store_error(future_id, exc)
        except Exception as exc:  # a bug or a broken model must still answer the client
            log.exception("create_session failed")
            self.results.store_error(future_id, ServerError(f"create_session failed: {type(exc).__name__}: {exc}"))

    def on_sample(self, future_id: str, body: dict) -> None:
        try:
            payload = body.get("payload") or load_payload(self.redis, OpEnvelope(session_id="-", seq=1, op="sample", payload_ref=body["payload_ref"]))
            req = parse_request(SampleRequest, payload)
            with self.compute_lock:
                engine, sampler_id = self._sampler_for(body["base_model"], req.model_path)
                out = engine.sample(
                    sampler_id, _model_input(req.prompt), req.num_samples, req.sampling_params,
                    include_prompt_logprobs=req.include_prompt_logprobs,
                    topk_prompt_logprobs=req.topk_prompt_logprobs,
                )
            self.results.store_ok(future_id, out.model_dump(mode="json"))
        except TreadleError as exc:
            self.results.store_error(future_id, exc)
        except Exception as exc:
            log.exception("sample failed")
            self.results.store_error(future_id, ServerError(f"sample failed: {type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------ sessions
    def create_session(self, req: CreateSessionRequest) -> SessionRecord:
        engine = self._engine(req.base_model)
        lora = req.lora
        if lora.seed is None:
            # A fixed seed makes the adapter's initialisation replayable after a crash.
            lora = lora.model_copy(update={"seed": int.from_bytes(__import__("os").urandom(4), "little")})
        record = SessionRecord(
            session_id=req.session_id, run_id=req.session_id, base_model=req.base_model, lora=lora,
            owner=req.owner, user_metadata=req.user_metadata,
            checkpoint=req.from_state, checkpoint_seq=0, checkpoint_with_optimizer=req.with_optimizer,
            checkpoint_every=req.checkpoint_every,
        )
        if not self.sessions.create(record):
            existing = self.sessions.get(req.session_id)
            if existing is not None and req.session_id in self.owned:
                return existing  # a redelivered create
            raise ServerError(f"session_id: {req.session_id!r} already exists")
        epoch = self.lease.acquire(req.session_id)
        if epoch is None:
            raise ServerError(f"session {req.session_id}: could not take its lease")
        with self.compute_lock:
            try:
                if req.from_state:
                    manifest = self.load_state_into(engine, req.session_id, req.from_state, req.with_optimizer)
                    if manifest.lora_config:
                        record.lora = record.lora.model_validate(manifest.lora_config)
                        self.sessions.update(req.session_id, lora=record.lora)
                else:
                    engine.create_session(req.session_id, lora)
            except Exception:
                # A record left behind would look like an orphan that every caretaker adopts (and fails to load).
                self.sessions.delete(req.session_id)
                self.lease.release(req.session_id, epoch)
                raise
            self.owned[req.session_id] = OwnedSession(record=record, epoch=epoch, applied=0)
        self.store.put_run(record.run_id, {
            "training_run_id": record.run_id, "base_model": record.base_model, "lora_rank": record.lora.rank,
            "lora_config": record.lora.model_dump(), "created_at": record.created_at,
            "owner": record.owner, "user_metadata": record.user_metadata,
        })
        self._subscribe(names.session_queue(req.session_id))
        log.info("session %s created on %s (epoch %d)", req.session_id, req.base_model, epoch)
        return record

    def take_over(self, session_id: str) -> bool:
        """Adopt a session whose owner died: restore its in-flight message, load, replay, subscribe."""
        from treadle.gpu_worker.recovery import restore_unacked

        record = self.sessions.get(session_id)
        if record is None or record.status != "active" or record.base_model not in self.engines:
            return False
        epoch = self.lease.acquire(session_id)
        if epoch is None:
            return False
        t0 = time.monotonic()
        restored = restore_unacked(self.redis, names.session_queue(session_id), session_id)
        with self.compute_lock:
            record = self.sessions.get(session_id)
            timings = self._rebuild(record)
            self.owned[session_id] = OwnedSession(record=record, epoch=epoch, applied=record.applied)
            timings["total_s"] = time.monotonic() - t0
            self.sessions.update(session_id, worker=self.hostname, last_recovery=json.dumps(
                {**timings, "at": time.time(), "unacked_restored": restored, "replayed_to": record.applied}))
            log.info("took over session %s (epoch %d, %d unacked restored, applied %d) in %.2f s",
                     session_id, epoch, restored, record.applied, timings["total_s"])
        self._subscribe(names.session_queue(session_id))
        with self.compute_lock:
            # Ops whose message died with the old owner are in the journal: run them now.
            owned = self.owned[session_id]
            owned.max_seen = max([owned.applied, *self.journal.seqs(session_id)])
            self.drain(session_id)
        return True

    def _rebuild(self, record: SessionRecord) -> dict:
        """Engine state of a session at `record.applied`: last checkpoint, then the journal replayed."""
        engine = self._engine(record.base_model)
        if engine.has_session(record.session_id):
            engine.drop_session(record.session_id)
        t0 = time.monotonic()
        if record.checkpoint:
            self.load_state_into(engine, record.session_id, record.checkpoint, record.checkpoint_with_optimizer)
        else:
            engine.create_session(record.session_id, record.lora)
        t1 = time.monotonic()
        owned = OwnedSession(record=record, epoch=-1, applied=record.checkpoint_seq)
        for seq in range(record.checkpoint_seq + 1, record.applied + 1):
            env = self.journal.get(record.session_id, seq)
            if env is None:
                raise SessionLostError(f"session {record.session_id}: op {seq} is neither checkpointed nor journaled")
            if env.op in STATEFUL_OPS:
                try:
                    HANDLERS[env.op](self, engine, owned, env, load_payload(self.redis, env))
                except TreadleError:
                    pass  # it failed the first time too, and left no state behind
            owned.applied = seq
        t2 = time.monotonic()
        return {"load_s": t1 - t0, "replay_s": t2 - t1, "replayed_ops": record.applied - record.checkpoint_seq}

    # ------------------------------------------------------------ the ordered loop
    def drain(self, session_id: str) -> None:
        """Run every op of the session that is next in line, in seq order."""
        owned = self.owned[session_id]
        while owned.applied < owned.max_seen:
            env = self.journal.get(session_id, owned.applied + 1)
            if env is None:
                return
            if not self.lease.holds(session_id, owned.epoch):
                log.warning("lost the lease of session %s; handing it over", session_id)
                self._release(session_id, drop_lease=False)
                self._not_ours(env)
                return
            if owned.unloaded:
                self._reload(owned)
            self._run(owned, env)
            if env.op == "stop":
                # Marked stopped first, so that no caretaker adopts the session once its lease is gone.
                self.sessions.update(session_id, status="stopped")
                self._release(session_id, drop_lease=True)
                # Nothing will replay a stopped session: free its journal, keep its record a week.
                self.journal.drop(session_id)
                self.redis.expire(names.session_key(session_id), 7 * 24 * 3600)
                return

    def _run(self, owned: OwnedSession, env: OpEnvelope) -> None:
        engine = self._engine(owned.record.base_model)
        if env.op in self.slow_ops:  # fault-injection for recovery tests: widen the window to kill in
            time.sleep(self.slow_ops[env.op])
        try:
            value = HANDLERS[env.op](self, engine, owned, env, load_payload(self.redis, env))
            self.results.store_ok(env.future_id, {**value, "op": env.op})
        except KeyError:
            self.results.store_error(env.future_id, ServerError(f"op: unknown op {env.op!r}; known: {', '.join(OP_REQUESTS)}"))
        except TreadleError as exc:
            self.results.store_error(env.future_id, exc)
        except Exception as exc:
            log.exception("op %s of session %s failed", env.op, env.session_id)
            self.results.store_error(env.future_id, ServerError(f"{env.op} failed on the worker: {type(exc).__name__}: {exc}"))
        owned.applied = env.seq
        self.sessions.update(env.session_id, applied=env.seq, last_activity=time.time())
        if env.op == "optim_step" and self._checkpoint_due(owned, engine.step(env.session_id)):
            self.auto_checkpoint(owned, background=True)

    def _checkpoint_due(self, owned: OwnedSession, step: int) -> bool:
        every = owned.record.checkpoint_every if owned.record.checkpoint_every is not None else self.checkpoint_every
        if every and step % every == 0:
            return True
        return bool(self.checkpoint_interval_s) and time.monotonic() - owned.last_checkpoint_at >= self.checkpoint_interval_s

    def _not_ours(self, env: OpEnvelope) -> None:
        """An op for a session this worker does not own: answer if the session is gone, else pass it on."""
        record = self.sessions.get(env.session_id)
        if record is None or record.status != "active":
            if not self.results.is_done(env.future_id):
                self.results.store_error(env.future_id, SessionNotFoundError(f"session {env.session_id} does not exist or was stopped"))
            return
        # The journal holds the op; a fresh doorbell reaches whoever owns (or will own) the session.
        from treadle.queue.celery_app import OP_TASK

        self.app.send_task(OP_TASK, args=[env.model_dump(mode="json")], queue=names.session_queue(env.session_id),
                           task_id=env.future_id, ignore_result=True, countdown=None)

    def _release(self, session_id: str, *, drop_lease: bool) -> None:
        owned = self.owned.pop(session_id, None)
        if owned is None:
            return
        self._unsubscribe(names.session_queue(session_id))
        engine = self._engine(owned.record.base_model)
        if engine.has_session(session_id):
            engine.drop_session(session_id)
        if drop_lease:
            self.lease.release(session_id, owned.epoch)

    # ------------------------------------------------------------ checkpoints, idle sessions
    def auto_checkpoint(self, owned: OwnedSession, *, background: bool = False) -> str | None:
        """Save the session's full state, point the registry at it, and trim the journal it covers.

        The state is written to a local directory in the op loop (fast); the upload, the registry
        update and the journal trim run on the upload thread when `background` is set.
        """
        sid = owned.record.session_id
        if owned.pending_upload is not None:
            owned.pending_upload.result()  # one at a time per session, in order
        if not self.lease.holds(sid, owned.epoch):
            return None
        engine = self._engine(owned.record.base_model)
        path = CheckpointPath(run_id=owned.record.run_id, kind="weights", name=f"auto-{owned.applied:08d}")
        tmp = tempfile.mkdtemp(prefix="treadle-ckpt-")
        engine.save_state(sid, tmp, include_optimizer=True)
        step, applied = engine.step(sid), owned.applied
        owned.last_checkpoint_at = time.monotonic()

        def upload() -> str | None:
            try:
                if not self.lease.holds(sid, owned.epoch):
                    return None
                self.store.save(tmp, path, base_model=owned.record.base_model, lora_config=owned.record.lora.model_dump(),
                                step=step, applied_seq=applied, overwrite=True, ttl_seconds=7 * 24 * 3600,
                                extra={"automatic": True, "base_model_path": engine.base_model})
                previous = self.sessions.get(sid)
                self.sessions.update(sid, checkpoint=path.uri(), checkpoint_seq=applied, checkpoint_with_optimizer=True)
                self.journal.trim(sid, applied)
                if previous and previous.checkpoint and "/weights/auto-" in previous.checkpoint and previous.checkpoint != path.uri():
                    try:
                        self.store.delete(CheckpointPath.parse(previous.checkpoint))
                    except TreadleError:
                        pass
                return path.uri()
            finally:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)

        if background:
            owned.pending_upload = self._uploads.submit(upload)
            return path.uri()
        return upload()

    def unload_idle(self, idle_seconds: float) -> list[str]:
        """Checkpoint and free sessions nobody has used for a while; they reload on their next op."""
        unloaded = []
        now = time.time()
        for sid, owned in list(self.owned.items()):
            record = self.sessions.get(sid)
            if owned.unloaded or record is None or now - record.last_activity < idle_seconds:
                continue
            with self.compute_lock:
                if self.journal.get(sid, owned.applied + 1) is not None:
                    continue  # work is waiting
                if self.auto_checkpoint(owned) is None:
                    continue
                self._engine(owned.record.base_model).drop_session(sid)
                owned.unloaded = True
                unloaded.append(sid)
                log.info("unloaded idle session %s", sid)
        return unloaded

    def _reload(self, owned: OwnedSession) -> None:
        record = self.sessions.get(owned.record.session_id)
        self._rebuild(record)
        owned.unloaded = False
        log.info("reloaded session %s", record.session_id)

    # ------------------------------------------------------------ helpers
    def _engine(self, base_model: str):
        try:
            return self.engines[base_model]
        except KeyError:
            from treadle.errors import UnknownModelError

            raise UnknownModelError(f"base_model: {base_model!r} is not served by worker {self.hostname}; it serves {', '.join(self.engines)}") from None

    def fence(self, owned: OwnedSession) -> None:
        if owned.epoch >= 0 and not self.lease.holds(owned.record.session_id, owned.epoch):
            raise ServerError(f"session {owned.record.session_id}: this worker lost its lease; not writing")

    def load_state_into(self, engine, session_id: str, path: str, with_optimizer: bool):
        cpath = CheckpointPath.parse(path)
        if cpath.kind != "weights":
            from treadle.errors import InvalidRequestError

            raise InvalidRequestError(f"path: {path} is a sampler checkpoint; load_state needs a .../weights/<name> path (save_state's)")
        with tempfile.TemporaryDirectory(prefix="treadle-load-") as tmp:
            manifest = self.store.load(cpath, tmp)
            engine.load_state(session_id, tmp, with_optimizer=with_optimizer)
        return manifest

    def _sampler_for(self, base_model: str, model_path: str | None):
        if model_path is None:
            return self._engine(base_model), None
        cpath = CheckpointPath.parse(model_path)
        sampler_id = cpath.uri()
        if sampler_id in self._samplers:
            self._samplers.move_to_end(sampler_id)
            return self._engine(self._samplers[sampler_id]), sampler_id
        manifest = self.store.manifest(cpath)
        engine = self._engine(manifest.base_model)
        with tempfile.TemporaryDirectory(prefix="treadle-sampler-") as tmp:
            self.store.load(cpath, tmp)
            engine.load_sampler(sampler_id, tmp)
        self.remember_sampler(sampler_id, manifest.base_model)
        return engine, sampler_id

    def remember_sampler(self, sampler_id: str, base_model: str) -> None:
        self._samplers[sampler_id] = base_model
        self._samplers.move_to_end(sampler_id)
        while len(self._samplers) > MAX_CACHED_SAMPLERS:
            old, model = self._samplers.popitem(last=False)
            self.engines[model].drop_sampler(old)


def _model_input(tokens: list[int]):
    from treadle.types import ModelInput

    return ModelInput.from_ints(tokens)
