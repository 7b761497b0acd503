"""The runner: starts submitted batch runs, restarts them when they fail, and adopts orphaned ones.

`treadle runner` (and `treadle up`, which starts one) loops every `poll_s`: for each run it holds, it
flushes the command's output to the log store, copies the last metrics line and the checkpoints of
the run's log_dir into the run's record, and looks at the command. A zero exit ends the run
`succeeded`; a non-zero one (or a signal) restarts the command with the run's resume arguments after
an exponential backoff, up to `max_restarts` times, then ends it `failed`. So does a stall: a loop that
has had ops answered in this attempt (the treadle SDK reports each, `treadle.queue.run_progress`) and then
none for the run's `stall_s` is stopped (SIGTERM, SIGKILL after `stop_grace_s`) and restarted the same
way, the reason written into its log. A stop request ends it
`stopped`. Between those it claims open runs that no runner holds: new ones, and ones whose runner
died (its lease expired) or shut down (it released the lease); an adopted run starts again with its
resume arguments, so a recipe continues from its last checkpoint.

Each command runs in its own session and process group, told by the kernel to die with the runner
(PR_SET_PDEATHSIG), and the runner kills the whole group when an attempt ends, so nothing outlives
its attempt. SIGTERM (or Ctrl-C) stops the commands (SIGTERM to their groups, SIGKILL after
`stop_grace_s`) and releases their leases, so that the next runner adopts them at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import redis as redis_lib
from pydantic import BaseModel, Field

from treadle.errors import TreadleError
from treadle.queue import names
from treadle.queue.run_progress import last_progress
from treadle.runs.logs import LogCapture, last_json_line, read_checkpoints, segment_key
from treadle.runs.process import die_with_runner, has_exited, kill_group, process_start_time
from treadle.runs.records import RunRecord, RunStore
from treadle.storage import BlobStore

log = logging.getLogger("treadle.runner")
RUNNER_PREFIX = names.RUNNER_PREFIX


class RunnerConfig(BaseModel):
    """A runner process: supervises batch runs submitted with `treadle runs submit`."""

    broker_url: str | None = Field(
        default=None, description="Redis URL of the stack (default: TREADLE_BROKER_URL, then `treadle up`)."
    )
    log_url: str | None = Field(
        default=None,
        description="Blob store of run logs, file:///dir or s3://bucket/prefix (default: the checkpoint store).",
    )
    runner_id: str | None = Field(
        default=None, description="Name of this runner in run records (default: <host>-<pid>)."
    )
    max_runs: int = Field(default=8, ge=1, le=1000, description="Runs this runner supervises at once.")
    poll_s: float = Field(
        default=0.5, gt=0.0, le=60.0, description="Seconds between looks at the commands and the records."
    )
    lease_ttl_s: float = Field(
        default=15.0, ge=1.0, le=3600.0, description="A run whose runner died is adopted this long after."
    )
    log_flush_s: float = Field(
        default=2.0, gt=0.0, le=600.0, description="Output is written to the log store at least this often."
    )
    stop_grace_s: float = Field(
        default=10.0, ge=0.0, le=600.0, description="SIGTERM to SIGKILL, when a command is stopped."
    )


@dataclass
class Supervised:
    """A run this runner holds: its lease token and, while an attempt runs, the process and its log."""

    name: str
    token: str
    proc: subprocess.Popen | None = None
    capture: LogCapture | None = None
    flushed_at: float = 0.0
    files_seen: tuple = ()
    lost: bool = False


class Runner:
    def __init__(self, cfg: RunnerConfig, store: RunStore, blobs: BlobStore, runner_id: str):
        self.cfg, self.store, self.blobs, self.id = cfg, store, blobs, runner_id
        self.host = socket.gethostname()
        self.runs: dict[str, Supervised] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = threading.Event()

    # ------------------------------------------------------------ main loop
    def serve(self) -> None:
        """Supervise until `shutdown()` is called (from a signal handler), then stop the commands."""
        renewer = threading.Thread(target=self._renew_leases, name="runner-leases", daemon=True)
        renewer.start()
        self._announce()
        log.info("runner %s: supervising batch runs, logs in %s", self.id, self.blobs.url)
        try:
            while not self._stopping.is_set():
                try:
                    self.tick()
                except (redis_lib.RedisError, TreadleError, OSError) as exc:
                    log.warning("runner %s: %s (retrying)", self.id, exc)
                self._stopping.wait(self.cfg.poll_s)
            self._shut_down_runs()
        finally:
            self._stopped.set()
            renewer.join(timeout=5)
            with contextlib.suppress(redis_lib.RedisError):
                self.store.redis.delete(RUNNER_PREFIX + self.id)

    def _announce(self) -> None:
        """A key with the lease's TTL: `treadle runs submit` warns when no runner is alive."""
        self.store.redis.set(
            RUNNER_PREFIX + self.id,
            json.dumps({"host": self.host, "pid": os.getpid()}),
            px=int(self.cfg.lease_ttl_s * 1000),
        )

    def shutdown(self) -> None:
        self._stopping.set()

    def tick(self) -> None:
        for sup in list(self.runs.values()):
            self.supervise(sup)
        if len(self.runs) < self.cfg.max_runs:
            self.claim_open_runs()

    def _renew_leases(self) -> None:
        """Renew the leases (and this runner's announcement) until the commands are stopped: a long
        shutdown must not let another runner adopt a run whose command is still exiting."""
        interval = self.cfg.lease_ttl_s / 3
        while not self._stopped.wait(interval):
            with self._lock:
                tokens = {name: sup.token for name, sup in self.runs.items()}
            try:
                self._announce()
                lost = self.store.renew(tokens)
            except redis_lib.RedisError as exc:
                log.warning("runner %s: could not renew leases: %s", self.id, exc)
                continue
            for name in lost:
                log.warning("runner %s: lost the lease of run %s; stopping its command", self.id, name)
                with self._lock:
                    if name in self.runs:
                        self.runs[name].lost = True

    # ------------------------------------------------------------ claiming
    def claim_open_runs(self) -> None:
        for name in self.store.open_names():
            if len(self.runs) >= self.cfg.max_runs:
                return
            if name in self.runs or self.store.lease_holder(name) is not None:
                continue
            epoch = self.store.claim(name, self.id)
            if epoch is None:
                continue
            sup = Supervised(name, self.store.token(self.id, epoch))
            record = self.store.get(name)
            if record.finished:  # it finished (stopped) between the scan and the claim
                self.store.update(name, sup.token, release=True)
                continue
            fields = {"runner": self.id, "log_url": self.blobs.url}
            if record.status.state in ("running", "restarting"):
                self._kill_leftovers(record)
                fields.update(
                    adoptions=record.status.adoptions + 1,
                    pid=None,
                    message=f"adopted by runner {self.id} from {record.status.runner}",
                )
                log.info("runner %s: adopting run %s from %s", self.id, name, record.status.runner)
            if self.store.update(name, sup.token, **fields):
                with self._lock:
                    self.runs[name] = sup

    def _kill_leftovers(self, record: RunRecord) -> None:
        """A dead runner's command on this host may have outlived it (a grandchild, say): kill its group,
        unless its pid now belongs to another process."""
        status = record.status
        if status.pid is None or status.host != self.host:
            return
        started = process_start_time(status.pid)
        if started is None or started == status.pid_start:
            kill_group(status.pid, signal.SIGKILL)

    # ------------------------------------------------------------ one run
    def supervise(self, sup: Supervised) -> None:
        if sup.lost:
            self._end_attempt(sup, grace=0.0)
            with self._lock:
                self.runs.pop(sup.name, None)
            return
        record = self.store.get(sup.name)
        if record.status.stop_requested:
            code = self._end_attempt(sup, grace=self.cfg.stop_grace_s)
            self._finish(sup, record, "stopped", last_exit_code=code, message="stopped on request")
            return
        if sup.proc is None:
            if time.time() >= (record.status.next_start_at or 0.0):
                self.start(sup, record)
            return
        if time.monotonic() - sup.flushed_at >= self.cfg.log_flush_s:
            sup.capture.flush()
            sup.flushed_at = time.monotonic()
        self._watch_files(sup, record)
        if has_exited(sup.proc):
            self._after_exit(sup, record, self._end_attempt(sup, grace=0.0))
        elif (quiet_s := self._stalled_for(record)) is not None:
            why = f"no op answered for {quiet_s:.0f} s (stall_s={record.spec.stall_s:g})"
            sup.capture.note(f"[treadle runner {self.id}] {why}: stopping attempt {record.status.attempt}\n")
            self._after_exit(sup, record, self._end_attempt(sup, grace=self.cfg.stop_grace_s), why=why)

    def _stalled_for(self, record: RunRecord) -> float | None:
        """Seconds since the attempt's loop last had an op answered, if past the run's stall_s; None while it
        progresses, or before its first answered op (a command that reports none is never stopped for it)."""
        stall_s, started_at = record.spec.stall_s, record.status.started_at
        if not stall_s or started_at is None:
            return None
        progress = last_progress(self.store.redis, record.name)
        if progress is None or progress < started_at:
            return None
        quiet_s = time.time() - progress
        return quiet_s if quiet_s > stall_s else None

    def start(self, sup: Supervised, record: RunRecord) -> None:
        spec, attempt = record.spec, record.status.attempt + 1
        argv = spec.command + (spec.resume_args if attempt > 1 else [])
        env = {**spec.env, "TREADLE_RUN_NAME": spec.name, "TREADLE_RUN_ATTEMPT": str(attempt)}
        header = f"[treadle runner {self.id}] attempt {attempt}: {shlex.join(argv)}\n"
        try:
            proc = subprocess.Popen(
                argv,
                cwd=spec.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_runner,
            )
        except OSError as exc:
            # A command that cannot start (missing program or directory) fails like one that exits 127.
            self.blobs.put_bytes(segment_key(spec.name, attempt, 0), f"{header}cannot start: {exc}\n".encode())
            self.store.update(spec.name, sup.token, attempt=attempt, started_at=time.time())
            self._after_exit(sup, self.store.get(spec.name), 127, [f"cannot start: {exc}"])
            return
        sup.proc, sup.capture, sup.flushed_at = (
            proc,
            LogCapture(self.blobs, spec.name, attempt, proc.stdout, header),
            0.0,
        )
        log.info("runner %s: run %s attempt %d started (pid %d)", self.id, spec.name, attempt, proc.pid)
        if not self.store.update(
            spec.name,
            sup.token,
            state="running",
            attempt=attempt,
            pid=proc.pid,
            pid_start=process_start_time(proc.pid),
            host=self.host,
            runner=self.id,
            started_at=time.time(),
            next_start_at=None,
        ):
            sup.lost = True

    def _end_attempt(self, sup: Supervised, grace: float) -> int | None:
        """Stop what is left of the attempt's process group, reap the command, flush its output."""
        proc = sup.proc
        if proc is None:
            return None
        if grace > 0 and not has_exited(proc):
            kill_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        kill_group(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
        sup.capture.close()
        sup.proc = None
        return code

    def _after_exit(
        self, sup: Supervised, record: RunRecord, code: int, lines: list[str] | None = None, why: str | None = None
    ) -> None:
        """Finish or restart the run after its attempt ended: with exit `code`, or stopped by the runner for `why`
        (which then restarts it whatever the code)."""
        spec, restarts = record.spec, record.status.restarts
        lines = lines if lines is not None else sup.capture.last_lines()
        stopped, why = why is not None, why or f"exit code {code}"
        if code == 0 and not stopped:
            self._finish(sup, record, "succeeded", last_exit_code=0, last_lines=lines, message="exit code 0")
        elif restarts < spec.max_restarts:
            delay = spec.backoff(restarts + 1)
            log.info(
                "runner %s: run %s: %s; restart %d of %d in %.1f s",
                self.id,
                spec.name,
                why,
                restarts + 1,
                spec.max_restarts,
                delay,
            )
            if not self.store.update(
                spec.name,
                sup.token,
                state="restarting",
                restarts=restarts + 1,
                last_exit_code=code,
                last_lines=lines,
                pid=None,
                next_start_at=time.time() + delay,
                message=f"{why}; restart {restarts + 1} of {spec.max_restarts} in {delay:.1f} s",
            ):
                sup.lost = True
        else:
            self._finish(
                sup,
                record,
                "failed",
                last_exit_code=code,
                last_lines=lines,
                message=f"{why} after {restarts} restarts (max_restarts={spec.max_restarts})",
            )

    def _finish(self, sup: Supervised, record: RunRecord, state: str, **fields) -> None:
        sup.files_seen = ()
        self._watch_files(sup, record)
        self.store.update(sup.name, sup.token, release=True, state=state, finished_at=time.time(), pid=None, **fields)
        log.info("runner %s: run %s %s", self.id, sup.name, state)
        with self._lock:
            self.runs.pop(sup.name, None)

    def _watch_files(self, sup: Supervised, record: RunRecord) -> None:
        """Copy the last metrics line and the checkpoints of the run's log_dir into its record, when they change."""
        if record.spec.log_dir is None:
            return
        metrics, checkpoints = (os.path.join(record.spec.log_dir, f) for f in ("metrics.jsonl", "checkpoints.jsonl"))
        seen = tuple(os.stat(p).st_mtime_ns if os.path.exists(p) else None for p in (metrics, checkpoints))
        if seen == sup.files_seen:
            return
        sup.files_seen = seen
        self.store.update(
            sup.name, sup.token, last_metrics=last_json_line(metrics), checkpoints=read_checkpoints(checkpoints)
        )

    def _shut_down_runs(self) -> None:
        """Stop every command and release its run, left running/restarting for the next runner to adopt."""
        for sup in list(self.runs.values()):
            self._end_attempt(sup, grace=self.cfg.stop_grace_s)
            self.store.update(
                sup.name,
                sup.token,
                release=True,
                pid=None,
                message=f"runner {self.id} shut down; the next runner resumes it",
            )
            log.info("runner %s: released run %s", self.id, sup.name)
        with self._lock:
            self.runs.clear()


def live_runners(redis) -> list[str]:
    return sorted(k.decode()[len(RUNNER_PREFIX) :] for k in redis.scan_iter(RUNNER_PREFIX + "*", count=500))
