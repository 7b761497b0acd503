"""What the host kernel offers `LocalSandbox` beyond namespaces: a seccomp filter and per-run cgroups.

The seccomp filter is compiled by libseccomp (through the `pyseccomp` binding) into a BPF program
once, in the grader; each run loads those bytes as its last step before the program (see
`local._LOADER`), after `no_new_privs` is set, so that the filter binds the program and
everything it starts and cannot be lifted.

`DENIED_CALLS` is the list, and why each call is on it. Calls that need a capability (mount,
module loading, raw sockets, reboot, ...) are not listed: the program has no capabilities, so the
kernel refuses them already. What is listed can be made by an unprivileged process and is never
needed by a graded program.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time

DENIED_CALLS = {
    # Kernel keyrings are not namespaced: a run could read or plant keys in the grader's session
    # keyring (inherited across the uid switch) and leave keys in its slot uid's user keyring for the
    # next run on that slot.
    "add_key": "keyrings are shared with the host and outlive the run",
    "keyctl": "keyrings are shared with the host and outlive the run",
    "request_key": "keyrings are shared with the host and outlive the run",
    # Pages of a memfd are not in any address space until mapped, so RLIMIT_AS does not count them.
    "memfd_create": "its pages escape the address-space limit",
    "memfd_secret": "its pages escape the address-space limit",
    # A user namespace makes the program root over new namespaces: a fresh IPC namespace without the
    # shared-memory caps, tmpfs mounts of any size. clone with CLONE_NEWUSER is refused by argument
    # (below); clone3 passes its flags in memory a filter cannot read, so it answers ENOSYS and the C
    # library falls back to clone.
    "unshare": "new namespaces would escape the run's limits",
    "setns": "new namespaces would escape the run's limits",
    # Kernel interfaces that graded code never uses and that are common ways into kernel bugs.
    "io_uring_setup": "io_uring runs operations the filter never sees",
    "io_uring_enter": "io_uring runs operations the filter never sees",
    "io_uring_register": "io_uring runs operations the filter never sees",
    "userfaultfd": "stalls kernel threads, a staple of kernel exploits",
    "bpf": "kernel attack surface",
    "perf_event_open": "kernel attack surface and a timing side channel",
    "ptrace": "debugging other processes",
    "process_vm_readv": "reading another process's memory",
    "process_vm_writev": "writing another process's memory",
    "syslog": "the host kernel's log",
}
CLONE_NAMESPACE_FLAGS = (
    0x10000000,
)  # CLONE_NEWUSER: the other CLONE_NEW* flags need CAP_SYS_ADMIN, which only a user namespace would give
CLONE3 = "clone3"


def seccomp_filter() -> bytes:
    """The run's seccomp program (BPF bytes, compiled by libseccomp): refuse `DENIED_CALLS` with EPERM, allow the rest.

    System calls of another architecture (32-bit `int 0x80`, x32) kill the process: the filter's rules
    are written for the native numbers only.
    """
    import pyseccomp as seccomp  # loads libseccomp.so.2: imported here so that importing treadle.sandbox needs neither

    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_CALLS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in CLONE_NAMESPACE_FLAGS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), CLONE3)
    with tempfile.TemporaryFile() as f:
        rules.export_bpf(f)
        f.seek(0)
        return f.read()


def seccomp_loader(failed: str, exit_code: int) -> str:
    """The run's last step, as its uid with no_new_privs: load the filter (argv[1], hex; empty when opted
    out), then become the program. The filter survives the exec and binds every process the program starts."""
    return f"""
import ctypes, os, sys
bpf = bytes.fromhex(sys.argv[1])
if bpf:
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(22, 2, ctypes.byref(Program(len(bpf) // 8, bpf)), 0, 0):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        print("{failed}: seccomp:", os.strerror(ctypes.get_errno()), file=sys.stderr)
        os._exit({exit_code})
os.execv(sys.executable, [sys.executable, "-I", "-S", "main.py"])
"""


# Run once when a sandbox starts: proves that the whole chain works and that the filter is in force.
SECCOMP_PROBE = """
import os
try:
    os.memfd_create("probe")
    print("memfd allowed")
except OSError:
    print("memfd refused")
"""
SECCOMP_PROBE_REFUSED = "memfd refused\n"


def host_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024


# ---- cgroups ----------------------------------------------------------------------------------------


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _writable_parent(candidates: list[str], controllers: set[str]) -> str | None:
    """The first directory among `candidates` whose children get `controllers` and that we may create children in."""
    for parent in candidates:
        try:
            if not controllers <= set(_read(os.path.join(parent, "cgroup.subtree_control")).split()):
                continue
            probe = tempfile.mkdtemp(prefix="treadle-probe-", dir=parent)
            os.rmdir(probe)
            return parent
        except OSError:
            continue
    return None


def find_cgroup_parents(
    mountinfo: str = "/proc/self/mountinfo", own_cgroups: str = "/proc/self/cgroup"
) -> tuple[dict[str, str], str]:
    """Where the runs' cgroups go, by controller ({'memory': dir, 'pids': dir}), and a sentence on what was found.

    cgroup v2 first: the process's own cgroup if it already hands memory and pids to its children (the
    root of a hierarchy), else its parent (a delegated subtree, e.g. systemd's Delegate=yes, where the
    grader runs in one leaf). Then cgroup v1's memory and pids hierarchies, under the process's own
    cgroups (v1 has no rule against processes beside children). Empty where none is writable.
    """
    mounts: dict[str, str] = {}
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            fstype, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3]
            if fields[3] != "/":
                continue  # a bind mount of a sub-tree: our paths from /proc/self/cgroup do not apply below it
            if fstype == "cgroup2":
                mounts.setdefault("v2", fields[4])
            elif fstype == "cgroup":
                for controller in set(options.split(",")) & {"memory", "pids"}:
                    mounts[controller] = fields[4]
    own: dict[str, str] = {}
    with open(own_cgroups) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else ["v2"]:
                own[controller] = path
    if "v2" in mounts and "v2" in own:
        here = os.path.normpath(mounts["v2"] + own["v2"])
        candidates = [here] + ([os.path.dirname(here)] if own["v2"] != "/" else [])
        parent = _writable_parent(candidates, {"memory", "pids"})
        if parent:
            return {"memory": parent, "pids": parent}, f"cgroup v2 under {parent}"
    if {"memory", "pids"} <= mounts.keys() & own.keys():
        parents = {c: os.path.normpath(mounts[c] + own[c]) for c in ("memory", "pids")}
        try:
            for parent in parents.values():
                os.rmdir(tempfile.mkdtemp(prefix="treadle-probe-", dir=parent))
            return parents, f"cgroup v1 memory under {parents['memory']}, pids under {parents['pids']}"
        except OSError:
            pass
    return {}, "no writable cgroup with the memory and pids controllers (v2, or v1's memory and pids hierarchies)"


class RunCgroup:
    """The cgroups of one run: created with their limits before it, joined by its first process, removed after it."""

    def __init__(self, parents: dict[str, str], name: str, memory_bytes: int, max_tasks: int):
        self.dirs = sorted({os.path.join(parent, name) for parent in parents.values()})
        self.memory_dir = os.path.join(parents["memory"], name)
        v2 = parents["memory"] == parents["pids"]
        limits = {
            self.memory_dir: (
                {"memory.max": memory_bytes, "memory.swap.max": 0}
                if v2
                # memsw (memory + swap) must be set after, and may not be below, the memory limit
                else {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}
            )
        }
        pids_dir = os.path.join(parents["pids"], name)
        limits.setdefault(pids_dir, {})["pids.max"] = max_tasks
        for path, files in limits.items():
            os.makedirs(path, exist_ok=True)
            for file, value in files.items():
                if os.path.exists(os.path.join(path, file)):  # swap accounting is optional in the kernel
                    with open(os.path.join(path, file), "w") as f:
                        f.write(str(value))

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the memory limit (v2 memory.events, v1 memory.oom_control)."""
        for file in ("memory.events", "memory.oom_control"):
            try:
                lines = _read(os.path.join(self.memory_dir, file)).splitlines()
            except FileNotFoundError:
                continue
            return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in lines if line.strip())
        return False

    def remove(self) -> None:
        # The run's processes are gone when its namespace's pid 1 has been reaped, but the kernel may take a
        # moment to mark the cgroup empty.
        for path in self.dirs:
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.005)
