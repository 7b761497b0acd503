"""Automatic checkpoints and idle unloading: what makes a crash cheap and an idle session free.

Every N optimizer steps (or T seconds), and after M ops of any kind since the last one, a session's full
state (gradients accumulated so far included) is written to a local directory in the op loop (fast), then
uploaded on a background thread, which points the registry at it and trims the journal it covers. A
session nobody used for a while is checkpointed and dropped from the engine; its next op rebuilds it
from that checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from treadle.errors import TreadleError
from treadle.gpu_worker.sessions.hosting import OwnedSession, SessionHost
from treadle.observability import metrics
from treadle.queue.ops import OptimStepRequest, StopRequest
from treadle.storage.paths import CheckpointPath

log = logging.getLogger("treadle.worker")

AUTO_CHECKPOINT_TTL_S = 7 * 24 * 3600


class Autosaver:
    def __init__(self, host: SessionHost, *, checkpoint_every: int, checkpoint_interval_s: float, journal_ops: int = 0):
        self.host = host
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval_s = checkpoint_interval_s
        self.journal_ops = journal_ops
        # Uploads run here, off the op loop; one at a time keeps them ordered.
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-ckpt")

    def after_op(self, owned: OwnedSession, op: str) -> bool:
        """Checkpoint the session if one is due after this op; True when it did."""
        if (op == OptimStepRequest.op and self._due(owned)) or self._journal_full(owned, op):
            self.checkpoint(owned, background=True)
            return True
        return False

    def _journal_full(self, owned: OwnedSession, op: str) -> bool:
        """Whether `journal_ops` ops ran since the checkpoint the journal was last trimmed to (a stopping session's
        journal goes with it)."""
        return (
            bool(self.journal_ops) and op != StopRequest.op and owned.applied - owned.checkpointed >= self.journal_ops
        )

    def _due(self, owned: OwnedSession) -> bool:
        every = owned.record.checkpoint_every if owned.record.checkpoint_every is not None else self.checkpoint_every
        step = self.host.engine(owned.record.base_model).step(owned.session_id)
        if every and step % every == 0:
            return True
        return (
            bool(self.checkpoint_interval_s)
            and time.monotonic() - owned.last_checkpoint_at >= self.checkpoint_interval_s
        )

    def checkpoint(self, owned: OwnedSession, *, background: bool = False) -> str | None:
        """Save the session's full state, point the registry at it, and trim the journal it covers."""
        sid, host = owned.session_id, self.host
        if owned.pending_upload is not None:
            owned.pending_upload.result()  # one at a time per session, in order
        if not host.lease.holds(sid, owned.epoch):
            return None
        engine = host.engine(owned.record.base_model)
        path = CheckpointPath(run_id=owned.record.run_id, kind="weights", name=f"auto-{owned.applied:08d}")
        tmp = tempfile.mkdtemp(prefix="treadle-ckpt-")
        engine.save_state(sid, tmp, include_optimizer=True)
        step, applied = engine.step(sid), owned.applied
        owned.last_checkpoint_at, owned.checkpointed = time.monotonic(), applied

        def upload() -> str | None:
            try:
                if not host.lease.holds(sid, owned.epoch):
                    return None
                started = time.monotonic()
                manifest = host.store.save(
                    tmp,
                    path,
                    base_model=owned.record.base_model,
                    lora_config=owned.record.lora.model_dump(),
                    step=step,
                    applied_seq=applied,
                    overwrite=True,
                    ttl_seconds=AUTO_CHECKPOINT_TTL_S,
                    extra={"automatic": True, "base_model_path": engine.base_model},
                )
                metrics.observe_checkpoint("auto", time.monotonic() - started, manifest.size_bytes)
                previous = host.registry.get(sid)
                host.registry.update(sid, checkpoint=path.uri(), checkpoint_seq=applied, checkpoint_with_optimizer=True)
                host.journal.trim(sid, applied)
                if (
                    previous
                    and previous.checkpoint
                    and "/weights/auto-" in previous.checkpoint
                    and previous.checkpoint != path.uri()
                ):
                    try:
                        host.store.delete(CheckpointPath.parse(previous.checkpoint))
                    except TreadleError:
                        pass  # already gone (its TTL, or gc): nothing to free
                return path.uri()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        if background:
            owned.pending_upload = self._uploads.submit(upload)
            return path.uri()
        return upload()

    def unload_idle(self, idle_seconds: float) -> list[str]:
        """Checkpoint and free sessions nobody has used for a while; they reload on their next op."""
        unloaded, now = [], time.time()
        for sid, owned in list(self.host.owned.items()):
            record = self.host.registry.get(sid)
            if owned.unloaded or record is None or now - record.last_activity < idle_seconds:
                continue
            with self.host.op_lock:
                if self.host.journal.has(sid, owned.applied + 1):
                    continue  # work is waiting
                if self.checkpoint(owned) is None:
                    continue
                self.host.engine(owned.record.base_model).drop_session(sid)
                owned.unloaded = True
                unloaded.append(sid)
                log.info("unloaded idle session %s", sid)
        return unloaded

    def reload(self, owned: OwnedSession) -> None:
        self.host.rebuild(self.host.registry.get(owned.session_id))
        owned.unloaded = False
        log.info("reloaded session %s", owned.session_id)
