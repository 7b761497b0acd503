"""Run untrusted Python programs (model-written solutions) in a throwaway Linux sandbox.

`LocalSandbox` starts every run in fresh namespaces with util-linux `unshare` (no network: a new,
empty network namespace; its own pid, mount, IPC, UTS and cgroup namespaces) and `chroot`s into a root
assembled for that run from read-only bind mounts of `/usr` and the interpreter's prefix, with tmpfs
`/work` (the program's directory) and `/tmp`, and a `/proc` that shows only the run's processes. The
program runs under a uid of its own (one per pool slot, from a block drawn at random per sandbox), with
no capabilities and `no_new_privs`, under rlimits (CPU time, address space, processes, open files, file
size, which also caps stdout and stderr) and a seccomp filter (`host.DENIED_CALLS`, in
`treadle/sandbox/host.py`). All the memory a run can pin is bounded by `Limits.run_memory_mb`: a cgroup's `memory.max` where the host has a
writable one, and everywhere the channels RLIMIT_AS misses closed or capped (no memfds, IPC namespace
caps). A shell is the namespace's pid 1 and the program its child, so when the program ends, or when
the wall-time limit kills the whole process group, the kernel kills everything left in the namespace:
nothing outlives a run. docs/security.md ("The code sandbox") has the whole list and the reasons.

At start it reports the protections the host offers (the `treadle.sandbox` logger and
`LocalSandbox.protections`), proves them with one probe run, and refuses to start without seccomp
unless the caller names it in `allow_missing`, or when `pool_size` runs would not fit in its memory
budget. It needs root; anything else can implement the `Sandbox` protocol instead, e.g. a client of an
HTTP sandbox service such as SandboxFusion. Many runs may be in flight from many threads; `pool_size`
bounds how many execute at once.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Collection

from pydantic import BaseModel, Field

from treadle.sandbox import host
from treadle.sandbox.protocol import Execution, Status

log = logging.getLogger("treadle.sandbox")

SETUP_FAILED = "treadle sandbox: setup failed"
SETUP_EXIT = 125
MAX_POOL_SIZE = 64
# Slot uids: a block of MAX_POOL_SIZE drawn at random per sandbox from a range above login accounts,
# systemd's dynamic users and the uid ranges container runtimes map (systemd-nspawn stops at 0x6FFFFFFF).
# Two live sandboxes on one host share a block with odds of about 1 in 3.6 million.
SLOT_UIDS = range(0x7100_0000, 0x7F00_0000)
OPEN_FILES = 64  # RLIMIT_NOFILE: each open pipe or socket can hold kernel buffers no other limit counts
# The run's IPC namespace: at most 1 MiB of SysV shared memory in 16 segments, 8 message queues of
# 16 KiB and 8 semaphore sets (the kernel's defaults allow terabytes of each).
IPC_SYSCTLS = {"shmmax": 1 << 20, "shmall": 256, "shmmni": 16, "msgmni": 8, "msgmnb": 16384, "sem": "32 256 32 8"}
IPC_MB = 2  # what IPC_SYSCTLS let a run hold, rounded up
# What the sandbox refuses to start without unless the caller names it in allow_missing. Without namespaces
# no run starts (the probe fails); without a cgroup the channels RLIMIT_AS misses are closed one by one.
REQUIRED = ("seccomp",)

# Not bubblewrap: it would replace the mounts below and nothing else. Without a user namespace it cannot
# run the program as the slot's uid (setpriv would remain), it neither caps an IPC namespace nor joins a
# cgroup (the shell would remain), and it would be one more system package on every host.
#
# Runs inside the new namespaces as root, in the host-side run directory: assemble the run's root in
# $1 (a fresh tmpfs) and cap its IPC namespace. Arguments: root, work MiB, uid, interpreter, then the
# directories to bind read-only.
_SETUP = (
    r"""
root=$1 work_mb=$2 uid=$3; shift 4
"""
    + "".join(f'echo "{value}" > /proc/sys/kernel/{name}\n' for name, value in IPC_SYSCTLS.items())
    + r"""
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
mount -t proc -o nosuid,nodev,noexec,hidepid=invisible proc "$root/proc"
for dev in null zero random urandom; do
  touch "$root/dev/$dev"
  mount --bind "/dev/$dev" "$root/dev/$dev"
done
cp main.py "$root/work/main.py"
mount -o remount,ro "$root"
"""
)
# pid 1 of the namespace: join the run's cgroups (before anything else, so everything is counted), set
# up (a failure gets its own exit status), then the program as a child, so that its end ends the
# namespace. Arguments: the setup script, the cgroup.procs files, the seccomp loader and filter, then
# the setup's arguments.
_RUN = f"""
setup=$1 cgroups=$2 loader=$3 filter=$4; shift 4
for procs in $cgroups; do echo 0 > "$procs" || {{ echo "{SETUP_FAILED}: cgroup" >&2; exit {SETUP_EXIT}; }}; done
sh -eu -c "$setup" setup "$@" || {{ echo "{SETUP_FAILED}" >&2; exit {SETUP_EXIT}; }}
unshare --cgroup --root="$1" --wd=/work setpriv --reuid="$3" --regid="$3" --clear-groups --no-new-privs \\
  --bounding-set=-all --inh-caps=-all -- /usr/bin/env -i PATH=/usr/bin:/bin LANG=C.UTF-8 HOME=/work "$4" -I -S -c "$loader" "$filter"
"""
_LOADER = host.seccomp_loader(SETUP_FAILED, SETUP_EXIT)


class Limits(BaseModel):
    """Resource limits of one run."""

    cpu_seconds: int = Field(default=2, ge=1, le=600, description="CPU time (RLIMIT_CPU), then SIGKILL.")
    wall_seconds: float = Field(
        default=5.0, gt=0.0, le=600.0, description="Wall time, then the process group is killed."
    )
    memory_mb: int = Field(default=512, ge=64, le=65536, description="Address space per process (RLIMIT_AS).")
    max_processes: int = Field(
        default=4, ge=1, le=4096, description="Processes and threads of the run's uid (RLIMIT_NPROC)."
    )
    max_output_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30, description="Largest stdout, stderr or written file (RLIMIT_FSIZE)."
    )
    work_mb: int = Field(default=16, ge=1, le=4096, description="Size of the tmpfs /work and /tmp.")

    @property
    def run_memory_mb(self) -> int:
        """All the memory one run can hold: every process at its address-space limit, both tmpfs full, the IPC caps."""
        return self.memory_mb * self.max_processes + 2 * self.work_mb + IPC_MB


def _prlimit(limits: Limits) -> list[str]:
    """The rlimits every process of the run inherits, set by `prlimit` (no preexec_fn: runs start from many threads)."""
    cpu = limits.cpu_seconds
    return [
        "prlimit",
        f"--cpu={cpu}:{cpu + 1}",  # soft: SIGXCPU, hard: SIGKILL
        f"--as={limits.memory_mb << 20}",
        f"--nproc={limits.max_processes}",
        f"--fsize={limits.max_output_bytes}",
        "--core=0",
        f"--nofile={OPEN_FILES}",
        "--msgqueue=0",
    ]


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


class LocalSandbox:
    """The `Sandbox` of this machine: namespaces, a private root, rlimits, seccomp, a cgroup where there is one, a uid per slot."""

    def __init__(
        self,
        limits: Limits | None = None,
        pool_size: int = 4,
        python: str | None = None,
        allow_missing: Collection[str] = (),
        memory_budget_mb: int | None = None,
    ):
        """`allow_missing` names protections the caller accepts to run without ("seccomp"); `memory_budget_mb` is what
        `pool_size` runs may hold together (default: half the host's memory)."""
        if os.geteuid() != 0:
            raise PermissionError(
                "LocalSandbox needs root (it creates namespaces and runs programs under their own uids); "
                "run as root (e.g. in a container) or implement the Sandbox protocol over another sandbox"
            )
        missing = [tool for tool in ("unshare", "setpriv", "prlimit") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"LocalSandbox needs util-linux's {', '.join(missing)} on PATH")
        if not 1 <= pool_size <= MAX_POOL_SIZE:
            raise ValueError(f"pool_size must be in [1, {MAX_POOL_SIZE}], got {pool_size}")
        unknown = set(allow_missing) - set(REQUIRED)
        if unknown:
            raise ValueError(f"allow_missing may name only {', '.join(map(repr, REQUIRED))}, got {sorted(unknown)}")
        self.limits = limits or Limits()
        self.pool_size = pool_size
        host_mb = host.host_memory_mb()
        budget = memory_budget_mb if memory_budget_mb is not None else host_mb // 2
        if pool_size * self.limits.run_memory_mb > budget:
            raise ValueError(
                f"pool_size x run memory = {pool_size} x {self.limits.run_memory_mb} MiB = {pool_size * self.limits.run_memory_mb} MiB "
                f"exceeds the sandbox's memory budget of {budget} MiB (this host has {host_mb} MiB); a run holds up to "
                f"memory_mb x max_processes + 2 x work_mb + {IPC_MB} = {self.limits.memory_mb} x {self.limits.max_processes} + "
                f"2 x {self.limits.work_mb} + {IPC_MB} MiB: lower one of them or pool_size, or pass memory_budget_mb"
            )
        # The interpreter outside any virtualenv (the program runs with -I -S: the standard library only).
        self.python = python or os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        prefix = os.path.realpath(sys.base_prefix) if python is None else os.path.dirname(os.path.dirname(self.python))
        self._binds = ["/usr"] + ([] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix])
        # One uid per slot, so RLIMIT_NPROC (counted per uid) keeps one run's fork bomb from starving any other
        # run, of this sandbox or of another grader's (see SLOT_UIDS).
        base = SLOT_UIDS.start + secrets.randbelow(len(SLOT_UIDS) // MAX_POOL_SIZE) * MAX_POOL_SIZE
        self.uids = [base + slot for slot in range(pool_size)]
        self._slots: queue.Queue[int] = queue.Queue()
        for uid in self.uids:
            self._slots.put(uid)
        self.protections = self._check_host(set(allow_missing))

    def _check_host(self, allow_missing: set[str]) -> dict[str, str]:
        """Find the protections this host offers, prove them with one probe run, report them once; refuse if one is missing."""
        found: dict[str, str] = {}
        try:
            self._filter = host.seccomp_filter()
            found["seccomp"] = (
                f"filter of {len(self._filter) // 8} BPF instructions refusing {', '.join(host.DENIED_CALLS)}, "
                f"clone({'|'.join(hex(f) for f in host.CLONE_NAMESPACE_FLAGS)}), clone3 (ENOSYS)"
            )
        except (
            ImportError,
            OSError,
            RuntimeError,
        ) as e:  # pyseccomp raises RuntimeError where libseccomp.so.2 is missing
            self._filter = b""
            found["seccomp"] = f"missing: {type(e).__name__}: {e}"
        self._cgroup_parents, cgroup_found = host.find_cgroup_parents()
        found["cgroup"] = (
            f"{cgroup_found}: memory.max {self.limits.run_memory_mb} MiB and pids.max {self._max_tasks} per run"
            if self._cgroup_parents
            else f"missing: {cgroup_found}"
        )
        probe = self._run(host.SECCOMP_PROBE, "", self.uids[0])
        if probe.status != "ok":
            raise RuntimeError(
                f"LocalSandbox cannot run programs on this host ({probe.status}, exit {probe.exit_code}): "
                f"{probe.stderr.strip()[-2000:]}"
            )
        if self._filter and probe.stdout != host.SECCOMP_PROBE_REFUSED:
            raise RuntimeError(
                f"LocalSandbox loaded its seccomp filter but memfd_create was not refused: {probe.stdout!r}"
            )
        found["namespaces"] = (
            "net, pid, mount, ipc, uts, cgroup (util-linux unshare), chroot to a read-only root, /proc with hidepid"
        )
        found["rlimits"] = (
            f"address space {self.limits.memory_mb} MiB x {self.limits.max_processes} processes, "
            f"{OPEN_FILES} open files, no POSIX message queues; IPC namespace caps {IPC_SYSCTLS}; "
            f"run total {self.limits.run_memory_mb} MiB"
        )
        found["uids"] = f"{self.uids[0]}..{self.uids[-1]}"
        log.info(
            "treadle sandbox protections on this host: %s", "; ".join(f"{name}: {what}" for name, what in found.items())
        )
        refused = [name for name in REQUIRED if found[name].startswith("missing") and name not in allow_missing]
        if refused:
            raise RuntimeError(
                f"LocalSandbox needs {', '.join(refused)}, missing on this host "
                f"({'; '.join(found[name] for name in refused)}); pass allow_missing={tuple(refused)!r} to run without"
            )
        return found

    @property
    def _max_tasks(self) -> int:
        return self.limits.max_processes + 2  # the namespace's pid 1 (a shell) and the short-lived setup shell

    def run(self, program: str, stdin: str = "") -> Execution:
        uid = self._slots.get()  # blocks while pool_size runs are executing
        try:
            return self._run(program, stdin, uid)
        finally:
            self._slots.put(uid)

    def _run(self, program: str, stdin: str, uid: int) -> Execution:
        limits = self.limits
        run_dir = tempfile.mkdtemp(
            prefix="treadle-sandbox-"
        )  # mode 700: only its root mount point is ever visible inside
        cgroup = None
        try:
            if self._cgroup_parents:
                cgroup = host.RunCgroup(
                    self._cgroup_parents, f"treadle-sandbox-{uid}", limits.run_memory_mb << 20, self._max_tasks
                )
            os.mkdir(os.path.join(run_dir, "root"))
            for name, text in (("main.py", program), ("stdin", stdin)):
                with open(os.path.join(run_dir, name), "w") as f:
                    f.write(text)
            args = self._command(run_dir, uid, cgroup)
            started = time.monotonic()
            code, timed_out = self._execute(args, run_dir)
            wall = time.monotonic() - started
            outputs = [os.path.join(run_dir, name) for name in ("stdout", "stderr")]
            stdout, stderr = (_read(path, limits.max_output_bytes) for path in outputs)
            too_big = max(os.path.getsize(path) for path in outputs) >= limits.max_output_bytes
            oom = cgroup is not None and cgroup.oom_killed()
            return Execution(self._status(code, timed_out, too_big, oom, stderr), code, stdout, stderr, wall)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            if cgroup:
                cgroup.remove()

    def _command(self, run_dir: str, uid: int, cgroup: host.RunCgroup | None) -> list[str]:
        """The run's command line: its rlimits, then fresh namespaces whose pid 1 is the `_RUN` shell."""
        return [
            *_prlimit(self.limits),
            "unshare",
            "--net",
            "--pid",
            "--mount",
            "--ipc",
            "--uts",
            "--fork",
            "--kill-child",
            "--propagation",
            "private",
            "sh",
            "-c",
            _RUN,
            "sandbox",
            _SETUP,
            " ".join(cgroup.procs_files if cgroup else []),
            _LOADER,
            self._filter.hex(),
            os.path.join(run_dir, "root"),
            str(self.limits.work_mb),
            str(uid),
            self.python,
            *self._binds,
        ]

    def _execute(self, args: list[str], run_dir: str) -> tuple[int, bool]:
        """Run `args` in `run_dir` from its file stdin into its files stdout and stderr, killed at the wall-time
        limit: (exit status, whether it timed out)."""
        with (
            open(os.path.join(run_dir, "stdin"), "rb") as stdin_f,
            open(os.path.join(run_dir, "stdout"), "wb") as out_f,
            open(os.path.join(run_dir, "stderr"), "wb") as err_f,
        ):
            proc = subprocess.Popen(
                args,
                cwd=run_dir,
                stdin=stdin_f,
                stdout=out_f,
                stderr=err_f,
                start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/work"},
            )
            try:
                return proc.wait(timeout=self.limits.wall_seconds), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # --kill-child then takes the whole namespace down
                return proc.wait(timeout=30), True

    @staticmethod
    def _status(code: int, timed_out: bool, too_big: bool, oom: bool, stderr: str) -> Status:
        if oom:  # the cgroup's memory limit: the kernel killed a process of the run
            return "memory_limit"
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
