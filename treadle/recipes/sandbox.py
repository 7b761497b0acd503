"""Run untrusted Python programs (model-written solutions) in a throwaway Linux sandbox.

`LocalSandbox` starts every run in fresh namespaces with util-linux `unshare` (no network: a new,
empty network namespace; its own pid, mount, IPC and UTS namespaces) and `chroot`s into a root
assembled for that run from read-only bind mounts of `/usr` and the interpreter's prefix, with
tmpfs `/work` (the program's directory) and `/tmp`. Nothing else of the host is visible: not the
caller's home, working tree, `/proc` entries or environment (the run gets a three-variable
environment). The program runs under a uid of its own (one per pool slot), with no capabilities
and `no_new_privs`, and under rlimits on CPU time, address space, processes (per uid, so one
run's fork bomb cannot starve another's), file size (which also caps stdout and stderr, written
to files) and core dumps. A shell is the namespace's pid 1 and the program its child, so when the
program ends, or when the wall-time limit kills the whole process group, the kernel kills
everything left in the namespace: nothing outlives a run.

It needs root (to create the namespaces and switch uids); anything else can implement the
`Sandbox` protocol instead, e.g. a client of an HTTP sandbox service such as SandboxFusion.
Many runs may be in flight from many threads; `pool_size` bounds how many execute at once.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

from pydantic import BaseModel, Field

Status = Literal["ok", "runtime_error", "timeout", "memory_limit", "output_limit", "sandbox_error"]

SETUP_FAILED = "treadle sandbox: setup failed"
SLOT_UID_BASE = 231_000  # uids no real account uses
MAX_POOL_SIZE = 64
SETUP_EXIT = 125

# Runs inside the new namespaces as root, in the host-side run directory: assemble the run's root in
# $1 (a fresh tmpfs). Arguments: root, work MiB, uid, interpreter, then the directories to bind read-only.
_SETUP = r"""
root=$1 work_mb=$2 uid=$3; shift 4
mount -t tmpfs -o size=1m,mode=755 sandbox-root "$root"
for dir in "$@"; do
  mkdir -p "$root$dir"
  mount --bind "$dir" "$root$dir"
  mount -o remount,bind,ro,nosuid,nodev "$root$dir"
done
for link in bin lib lib64 sbin; do
  if [ -L "/$link" ]; then ln -s "$(readlink "/$link")" "$root/$link"; fi
done
mkdir -p "$root/work" "$root/tmp" "$root/proc" "$root/dev"
mount -t tmpfs -o "size=${work_mb}m,mode=700,uid=$uid,gid=$uid,nosuid,nodev" sandbox-work "$root/work"
mount -t tmpfs -o "size=${work_mb}m,mode=1777,nosuid,nodev" sandbox-tmp "$root/tmp"
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
for dev in null zero random urandom; do
  touch "$root/dev/$dev"
  mount --bind "/dev/$dev" "$root/dev/$dev"
done
cp main.py "$root/work/main.py"
mount -o remount,ro "$root"
"""
# pid 1 of the namespace: set up (a failure gets its own exit status), then the program as a child,
# so that its end ends the namespace. Arguments: the setup script, then the setup's arguments.
_RUN = f"""
setup=$1; shift
sh -eu -c "$setup" setup "$@" || {{ echo "{SETUP_FAILED}" >&2; exit {SETUP_EXIT}; }}
unshare --root="$1" --wd=/work setpriv --reuid="$3" --regid="$3" --clear-groups --no-new-privs \\
  --bounding-set=-all --inh-caps=-all -- /usr/bin/env -i PATH=/usr/bin:/bin LANG=C.UTF-8 HOME=/work "$4" -I -S main.py
"""


class Limits(BaseModel):
    """Resource limits of one run."""

    cpu_seconds: int = Field(default=2, ge=1, le=600, description="CPU time (RLIMIT_CPU), then SIGKILL.")
    wall_seconds: float = Field(default=5.0, gt=0.0, le=600.0, description="Wall time, then the process group is killed.")
    memory_mb: int = Field(default=512, ge=64, le=65536, description="Address space per process (RLIMIT_AS).")
    max_processes: int = Field(default=16, ge=1, le=4096, description="Processes and threads of the run's uid (RLIMIT_NPROC).")
    max_output_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30, description="Largest stdout, stderr or written file (RLIMIT_FSIZE).")
    work_mb: int = Field(default=16, ge=1, le=4096, description="Size of the tmpfs /work and /tmp.")


@dataclass
class Execution:
    """What one run did: a verdict, the exit status and what it printed (each capped at max_output_bytes)."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float


class Sandbox(Protocol):
    """Runs a Python program on one stdin; safe to call from many threads at once."""

    def run(self, program: str, stdin: str = "") -> Execution: ...


def run_all(sandbox: Sandbox, jobs: Sequence[tuple[str, str]], parallelism: int = 8) -> list[Execution]:
    """Run (program, stdin) pairs concurrently; results in the order of `jobs`."""
    with ThreadPoolExecutor(max_workers=max(1, min(parallelism, len(jobs)))) as pool:
        return list(pool.map(lambda job: sandbox.run(*job), jobs))


def _prlimit(limits: Limits) -> list[str]:
    """The rlimits every process of the run inherits, set by `prlimit` (no preexec_fn: runs start from many threads)."""
    cpu = limits.cpu_seconds
    return ["prlimit", f"--cpu={cpu}:{cpu + 1}",  # soft: SIGXCPU, hard: SIGKILL
            f"--as={limits.memory_mb << 20}", f"--nproc={limits.max_processes}", f"--fsize={limits.max_output_bytes}", "--core=0"]


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


class LocalSandbox:
    """The `Sandbox` of this machine: namespaces, a private root, rlimits and a uid per pool slot."""

    def __init__(self, limits: Limits | None = None, pool_size: int = 4, python: str | None = None):
        if os.geteuid() != 0:
            raise PermissionError("LocalSandbox needs root (it creates namespaces and runs programs under their own uids); "
                                  "run as root (e.g. in a container) or implement the Sandbox protocol over another sandbox")
        missing = [tool for tool in ("unshare", "setpriv", "prlimit") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"LocalSandbox needs util-linux's {', '.join(missing)} on PATH")
        if not 1 <= pool_size <= MAX_POOL_SIZE:
            raise ValueError(f"pool_size must be in [1, {MAX_POOL_SIZE}], got {pool_size}")
        self.limits = limits or Limits()
        self.pool_size = pool_size
        # The interpreter outside any virtualenv (the program runs with -I -S: the standard library only).
        self.python = python or os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        prefix = os.path.realpath(sys.base_prefix) if python is None else os.path.dirname(os.path.dirname(self.python))
        self._binds = ["/usr"] + ([] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix])
        # One uid per slot, and a block of uids per process, so RLIMIT_NPROC (counted per uid) keeps one
        # run's fork bomb from starving any other run, of this sandbox or of another process's.
        self.uids = [SLOT_UID_BASE + (os.getpid() % 4096) * MAX_POOL_SIZE + slot for slot in range(pool_size)]
        self._slots: queue.Queue[int] = queue.Queue()
        for uid in self.uids:
            self._slots.put(uid)

    def run(self, program: str, stdin: str = "") -> Execution:
        uid = self._slots.get()  # blocks while pool_size runs are executing
        try:
            return self._run(program, stdin, uid)
        finally:
            self._slots.put(uid)

    def _run(self, program: str, stdin: str, uid: int) -> Execution:
        limits = self.limits
        run_dir = tempfile.mkdtemp(prefix="treadle-sandbox-")  # mode 700: only its root mount point is ever visible inside
        try:
            os.mkdir(os.path.join(run_dir, "root"))
            with open(os.path.join(run_dir, "main.py"), "w") as f:
                f.write(program)
            with open(os.path.join(run_dir, "stdin"), "w") as f:
                f.write(stdin)
            paths = {name: os.path.join(run_dir, name) for name in ("stdin", "stdout", "stderr")}
            args = [*_prlimit(limits), "unshare", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--propagation", "private",
                    "sh", "-c", _RUN, "sandbox", _SETUP, os.path.join(run_dir, "root"), str(limits.work_mb), str(uid), self.python, *self._binds]
            started = time.monotonic()
            with open(paths["stdin"], "rb") as stdin_f, open(paths["stdout"], "wb") as out_f, open(paths["stderr"], "wb") as err_f:
                proc = subprocess.Popen(args, cwd=run_dir, stdin=stdin_f, stdout=out_f, stderr=err_f, start_new_session=True,
                                        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/work"})
                timed_out = False
                try:
                    proc.wait(timeout=limits.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)  # --kill-child then takes the whole namespace down
                    proc.wait(timeout=30)
            wall = time.monotonic() - started
            stdout = _read(paths["stdout"], limits.max_output_bytes)
            stderr = _read(paths["stderr"], limits.max_output_bytes)
            too_big = max(os.path.getsize(paths["stdout"]), os.path.getsize(paths["stderr"])) >= limits.max_output_bytes
            return Execution(self._status(proc.returncode, timed_out, too_big, stderr), proc.returncode, stdout, stderr, wall)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    @staticmethod
    def _status(code: int, timed_out: bool, too_big: bool, stderr: str) -> Status:
        # The shell that is pid 1 reports a program killed by signal N as exit status 128 + N.
        if timed_out or code in (128 + signal.SIGKILL, 128 + signal.SIGXCPU, -signal.SIGKILL):
            return "timeout"
        if code == SETUP_EXIT and SETUP_FAILED in stderr:
            return "sandbox_error"
        if too_big:
            return "output_limit"
        if code == 0:
            return "ok"
        if "MemoryError" in stderr:
            return "memory_limit"
        return "runtime_error"
