"""The local sandbox against hostile programs, as an attacker would write them.

Every attempt is one sandboxed program that tries a way out and prints `contained <probe>` or
`ESCAPED <probe>` for each thing it tried; a test asserts the run's verdict, that every probe ran and
was contained, and (the autouse `host_untouched` fixture) that the host is as it was: the marker file,
the listeners on 127.0.0.1 and on a host Unix socket, the grader process, no process, SysV object or
key left under the sandbox's uids. Memory attempts are measured from the host as well.

Attempts are bounded: each probes a limit at a safe size (twice the limit at most) before it tries the
unbounded version, which it reaches only when the limit held.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
import time

import pytest

from treadle.sandbox import host as sandbox_host
from treadle.sandbox.local import IPC_MB, Limits, LocalSandbox

MEMORY_MB = 128
LIMITS = Limits(
    cpu_seconds=1, wall_seconds=20.0, memory_mb=MEMORY_MB, max_processes=4, max_output_bytes=64 * 1024, work_mb=4
)
# For the memory attempts: a file-size limit so large that it bounds no memfd or shared-memory file.
MEMORY_LIMITS = LIMITS.model_copy(update={"max_output_bytes": 1 << 30})
SECRET = "s3cr3t-on-the-host"

# Defined in every hostile program: `attempt(name, call)` prints `contained` when the call fails and
# `ESCAPED` when it succeeds; `sys_call` is a raw system call through ctypes that raises OSError on -1.
PRELUDE = """
import ctypes, os, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sys_call(number, *args):
    result = libc.syscall(number, *args)
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result
def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]  # a short write at a limit, then the error on the next
def attempt(name, call):
    try:
        result = call()
    except (OSError, ValueError, RuntimeError, MemoryError, subprocess.SubprocessError) as e:
        print("contained", name, type(e).__name__, e, flush=True)
        return None
    print("ESCAPED", name, result, flush=True)
    return result
"""
# x86_64 system call numbers the programs use through ctypes
SYSCALLS = dict(
    ptrace=101,
    mount=165,
    reboot=169,
    sethostname=170,
    init_module=175,
    add_key=248,
    request_key=249,
    keyctl=250,
    unshare=272,
    setns=308,
    perf_event_open=298,
    bpf=321,
    userfaultfd=323,
    io_uring_setup=425,
    clone=56,
)


def _uids_in(path: str, column: int, uids: list[int]) -> list[str]:
    """Lines of a /proc table whose `column` is one of `uids` (a header line has no number there)."""
    with open(path) as f:
        rows = [line.split() for line in f]
    return [" ".join(row) for row in rows if row[column].rstrip(":").isdigit() and int(row[column].rstrip(":")) in uids]


def _processes_of(uids: list[int]) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue  # the process ended while we looked
        if int(uid_line.split()[1]) in uids:
            found.append(int(pid))
    return found


class Host:
    """What the programs attack: a marker file, a TCP listener on loopback, a Unix socket, the grader's keyring."""

    def __init__(self, tmp: str):
        self.marker = os.path.join(tmp, "marker.txt")
        with open(self.marker, "w") as f:
            f.write(SECRET)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.unix_path = os.path.join(tmp, "host.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen()
        self.unix.setblocking(False)
        self.abstract = f"\0treadle-test-{os.getpid()}"
        self.abstract_sock = socket.socket(socket.AF_UNIX)
        self.abstract_sock.bind(self.abstract)
        self.abstract_sock.listen()
        self.abstract_sock.setblocking(False)

    def untouched(self) -> None:
        with open(self.marker) as f:
            assert f.read() == SECRET, "the host's marker file changed"
        assert sorted(os.listdir(os.path.dirname(self.marker))) == ["host.sock", "marker.txt"], (
            "a file appeared on the host"
        )
        for listener in (self.listener, self.unix, self.abstract_sock):
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever connected


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Host:
    return Host(str(tmp_path_factory.mktemp("host")))


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox(LIMITS, pool_size=2)


@pytest.fixture(autouse=True)
def host_untouched(sandbox, host):
    grader_parent = os.getppid()
    yield
    host.untouched()
    assert _processes_of(sandbox.uids) == [], "a sandboxed process outlived its run"
    assert _uids_in("/proc/sysvipc/shm", 7, sandbox.uids) == [], "a SysV segment of the sandbox is on the host"
    assert _uids_in("/proc/key-users", 0, sandbox.uids) == [], "a sandbox uid owns kernel keys"
    os.kill(grader_parent, 0)  # the grader's parent is alive (this process obviously is)


def _run_attempt(sandbox: LocalSandbox, body: str, stdin: str = ""):
    return sandbox.run(PRELUDE + body, stdin)


def _contained(result, probes: int, status: str = "ok") -> None:
    assert "ESCAPED" not in result.stdout, result
    assert result.stdout.count("contained") == probes, result
    assert result.status == status, result


# ---- host files, paths, environment ------------------------------------------------------------


def test_writes_to_host_files_and_the_root_fail(sandbox, host):
    body = f"""
for path in [{host.marker!r}, "/usr/x", "/x", "/etc/x", "/proc/sys/kernel/hostname", "/proc/sysrq-trigger", "../x", "/dev/x"]:
    attempt("write " + path, lambda: open(path, "w").write("x"))
"""
    _contained(_run_attempt(sandbox, body), 8)


def test_host_files_and_homes_cannot_be_read(sandbox, host):
    body = f"""
for path in [{host.marker!r}, "/etc/passwd", "/etc/shadow", "/root/.bashrc", "/proc/1/environ", "/dev/vda", "/sys/kernel/notes"]:
    attempt("read " + path, lambda: open(path, "rb").read())
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 7)
    assert SECRET not in result.stdout


def test_the_environment_and_other_processes_environments_are_empty(sandbox, monkeypatch):
    monkeypatch.setenv("TREADLE_TEST_SECRET", SECRET)
    body = """
print(sorted(os.environ))
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        attempt("environ of " + pid, lambda: open(f"/proc/{pid}/environ").read())
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) == [os.getpid()])
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 0)
    assert result.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH']" and "pids True" in result.stdout


def test_no_host_paths_are_visible_in_proc(sandbox, host):
    body = """
import glob
seen = ""
for path in ["/proc/1/cmdline", "/proc/self/cmdline", "/proc/self/mountinfo", "/proc/self/cgroup", "/proc/self/environ", "/proc/mounts"]:
    try:
        seen += open(path, "rb").read().decode(errors="replace")
    except OSError:
        pass
for path in glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/cwd") + glob.glob("/proc/*/root"):
    try:
        seen += open(path, "rb").read().decode(errors="replace") if path.endswith("cmdline") else os.readlink(path)
    except OSError:
        pass
attempt("pid 1 visible", lambda: os.stat("/proc/1"))
print(seen)
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 1)
    for host_path in ("treadle-sandbox-", os.path.dirname(host.marker), "/sys/fs/cgroup", "process_api", os.getcwd()):
        assert host_path not in result.stdout, host_path


def test_symlinks_and_proc_magic_links_stay_inside(sandbox, host):
    body = f"""
os.symlink({host.marker!r}, "link")
attempt("symlink to a host file", lambda: open("link").read())
for path in ["/proc/self/root/../../" + {host.marker!r}, "/proc/self/cwd/../../../" + {host.marker!r}, "/proc/self/root/etc/passwd"]:
    attempt("magic link " + path, lambda: open(path).read())
attempt("chroot escape", lambda: os.chroot("/tmp"))
print("root", sorted(os.listdir("/proc/self/root/")))
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 5)
    root = eval(result.stdout.splitlines()[-1].split(" ", 1)[1])
    # the interpreter's prefix (under /root here) and the /usr-merged links at most
    assert (
        {"dev", "proc", "tmp", "usr", "work"}
        <= set(root)
        <= {"bin", "dev", "lib", "lib64", "proc", "root", "sbin", "tmp", "usr", "work"}
    )


# ---- network ------------------------------------------------------------------------------------


def test_no_network_to_the_host_loopback_the_internet_or_dns(sandbox, host):
    body = f"""
import socket
for target in [("127.0.0.1", {host.port}), ("8.8.8.8", 53), ("::1", {host.port})]:
    attempt("connect " + str(target), lambda: socket.create_connection(target, timeout=1).close())
attempt("dns", lambda: socket.getaddrinfo("pypi.org", 443))
attempt("raw socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("packet socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
"""
    _contained(_run_attempt(sandbox, body), 6)


def test_host_unix_sockets_are_unreachable(sandbox, host):
    body = f"""
import socket
for address in [{host.unix_path!r}, {host.abstract!r}, "/run/docker.sock", "/var/run/dbus/system_bus_socket"]:
    attempt("unix " + repr(address), lambda: socket.socket(socket.AF_UNIX).connect(address))
"""
    _contained(_run_attempt(sandbox, body), 4)


# ---- processes, signals, privileges -------------------------------------------------------------


def test_signals_reach_no_host_process(sandbox):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        body = f"""
import signal
for pid in [{os.getpid()}, {bystander.pid}, {os.getppid()}]:
    attempt("kill " + str(pid), lambda: os.kill(pid, signal.SIGKILL))
attempt("kill every process", lambda: os.kill(-1, signal.SIGKILL))
"""
        result = _run_attempt(sandbox, body)
        _contained(result, 4)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_privileged_calls_through_ctypes_are_refused(sandbox):
    body = f"""
attempt("setuid 0", lambda: os.setuid(0))
attempt("setgid 0", lambda: os.setgid(0))
attempt("mount", lambda: sys_call({SYSCALLS["mount"]}, b"none", b"/tmp", b"tmpfs", 0, None))
attempt("sethostname", lambda: sys_call({SYSCALLS["sethostname"]}, b"pwned", 5))
attempt("reboot", lambda: sys_call({SYSCALLS["reboot"]}, 0xfee1dead, 672274793, 0x4321FEDC, None))
attempt("init_module", lambda: sys_call({SYSCALLS["init_module"]}, None, 0, b""))
attempt("mknod", lambda: os.mknod("/tmp/sda", 0o600 | 0o60000, os.makedev(8, 0)))
attempt("raise the address-space limit", lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_AS, (-1, -1)))
attempt("raise the process limit", lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_NPROC, (10**6, 10**6)))
"""
    _contained(_run_attempt(sandbox, body), 9)


def test_setuid_binaries_give_no_privilege(sandbox):
    body = """
import shutil, subprocess
for command in [["/usr/bin/su", "-c", "id -u"], ["/usr/bin/mount", "-t", "tmpfs", "x", "/tmp"], ["/usr/bin/passwd", "-d", "root"],
                ["/usr/bin/newgrp", "root"]]:
    if os.path.exists(command[0]):
        attempt(" ".join(command), lambda: subprocess.run(command, capture_output=True, timeout=5, stdin=subprocess.DEVNULL, check=True))
    else:
        print("contained", command[0], "absent")
shutil.copy("/usr/bin/id", "id")
os.chmod("id", 0o4755)
euid = subprocess.run(["./id", "-u"], capture_output=True, text=True).stdout.strip()
print("ESCAPED setuid copy" if euid == "0" else "contained setuid copy runs as " + euid)
"""
    _contained(_run_attempt(sandbox, body), 5)


def test_ptrace_and_other_processes_memory_are_refused(sandbox):
    body = f"""
attempt("ptrace attach to the parent", lambda: sys_call({SYSCALLS["ptrace"]}, 16, os.getppid(), None, None))
attempt("ptrace traceme", lambda: sys_call({SYSCALLS["ptrace"]}, 0, 0, None, None))
attempt("/proc/parent/mem", lambda: open(f"/proc/{{os.getppid()}}/mem", "rb").read(1))
"""
    _contained(_run_attempt(sandbox, body), 3)


def test_a_fork_bomb_probes_the_limit_then_is_contained(sandbox):
    body = f"""
import signal
children = []
for _ in range({2 * LIMITS.max_processes}):  # twice the limit first: this much must already fail
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    children.append(pid)
print("contained fork" if len(children) < {LIMITS.max_processes} else "ESCAPED fork", len(children), flush=True)
for pid in children:
    os.kill(pid, signal.SIGKILL)
while True:  # the unbounded version
    try:
        if os.fork() == 0:
            while True:
                pass
    except OSError:
        pass
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 1, "timeout")
    assert sandbox.run("print('fine')").stdout == "fine\n"  # the next run on the pool is unharmed


def test_runaway_threads_are_capped(sandbox):
    body = f"""
import threading
stop = threading.Event()
started = 0
for _ in range({2 * LIMITS.max_processes}):
    try:
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
    except RuntimeError:
        break
print("contained threads" if started < {LIMITS.max_processes} else "ESCAPED threads", started, flush=True)
"""
    _contained(_run_attempt(sandbox, body), 1)


def test_processes_that_try_to_outlive_the_run_are_killed(sandbox):
    body = """
import subprocess
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("contained parent exits", flush=True)
"""
    _contained(_run_attempt(sandbox, body), 1)
    # host_untouched asserts that no process of the sandbox's uids is left


def test_new_namespaces_and_kernel_surfaces_are_refused(sandbox):
    body = f"""
attempt("unshare user namespace", lambda: sys_call({SYSCALLS["unshare"]}, 0x10000000))
attempt("unshare ipc+mount", lambda: sys_call({SYSCALLS["unshare"]}, 0x08000000 | 0x20000))
attempt("clone into a user namespace", lambda: sys_call({SYSCALLS["clone"]}, 0x10000000 | 17, None, None, None, 0))
attempt("setns", lambda: sys_call({SYSCALLS["setns"]}, os.open("/proc/self/ns/net", os.O_RDONLY), 0))
attempt("io_uring_setup", lambda: sys_call({SYSCALLS["io_uring_setup"]}, 8, (ctypes.c_char * 120)()))
attempt("userfaultfd", lambda: sys_call({SYSCALLS["userfaultfd"]}, 0))
attempt("bpf", lambda: sys_call({SYSCALLS["bpf"]}, 0, (ctypes.c_char * 72)(), 72))
attempt("perf_event_open", lambda: sys_call({SYSCALLS["perf_event_open"]}, (ctypes.c_char * 128)(), 0, -1, -1, 0))
"""
    _contained(_run_attempt(sandbox, body), 8)


INT_80 = """
import mmap  # add_key through the 32-bit entry (int 0x80, eax = 286), from machine code in an executable page
code = bytes([0xb8, 0x1e, 0x01, 0x00, 0x00, 0x31, 0xdb, 0x31, 0xc9, 0x31, 0xd2, 0xcd, 0x80, 0xc3])
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
"""


@pytest.mark.parametrize(
    "call", [f"sys_call(0x40000000 | {SYSCALLS['keyctl']}, 0, -3, 0)", INT_80], ids=["x32", "int_0x80"]
)
def test_other_architectures_system_calls_kill_the_program(sandbox, call):
    # the filter's rules name native numbers, so it kills a call made under another numbering instead
    body = f"""
print("contained before the call", flush=True)
{call}
print("ESCAPED the call returned", flush=True)
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 1, "runtime_error")
    assert result.exit_code == 128 + 31  # SIGSYS


# ---- output, files ------------------------------------------------------------------------------


def test_a_gigabyte_of_output_is_capped(sandbox):
    result = sandbox.run("chunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    print(chunk)")
    assert result.status == "output_limit" and len(result.stdout) == LIMITS.max_output_bytes


def test_a_5_gb_file_hits_the_file_size_limit(sandbox):
    body = f"""
attempt("twice the file size limit", lambda: open("big", "wb").write(b"x" * {2 * LIMITS.max_output_bytes}))
attempt("5 GB sparse", lambda: (open("sparse", "wb").truncate(5 << 30), os.path.getsize("sparse"))[1])
"""
    _contained(_run_attempt(sandbox, body), 2)


def test_the_work_and_tmp_filesystems_are_bounded(sandbox):
    body = f"""
for directory in ["/work", "/tmp"]:  # files under the file-size limit, twice the filesystem's size in all
    attempt("fill " + directory, lambda: [open(f"{{directory}}/f{{i}}", "wb").write(b"x" * (60 << 10)) for i in range({2 * LIMITS.work_mb * 1024 // 60})])
"""
    _contained(_run_attempt(sandbox, body), 2)


def test_too_many_open_files_are_refused(sandbox):
    body = """
fds = []
def open_many():
    for _ in range(1 << 16):
        fds.extend(os.pipe())
attempt("65536 pipes", open_many)
print("open", len(fds))
"""
    result = _run_attempt(sandbox, body)
    _contained(result, 1)
    assert int(result.stdout.split()[-1]) < 64


# ---- memory -------------------------------------------------------------------------------------


def test_an_8_gb_allocation_hits_the_memory_limit(sandbox):
    body = f"""
attempt("twice the address-space limit", lambda: bytearray({2 * MEMORY_MB} << 20))
chunks = []
while True:  # then the unbounded version
    chunks.append(bytearray(64 << 20))
"""
    result = _run_attempt(sandbox, body)
    assert result.status == "memory_limit" and "MemoryError" in result.stderr and result.stdout.count("contained") == 1


def _shmem_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def _run_measured(sandbox: LocalSandbox, body: str):
    """Run a program and sample the host's shared memory (memfds, SysV and tmpfs pages) until it ends: (result, peak growth MiB)."""
    baseline = _shmem_kb()
    box: list = []
    runner = threading.Thread(target=lambda: box.append(_run_attempt(sandbox, body)))
    runner.start()
    peak = baseline
    while runner.is_alive():
        peak = max(peak, _shmem_kb())
        time.sleep(0.01)
    runner.join()
    return box[0], (peak - baseline) / 1024


# Each holds what it can up to twice memory_mb in 16 MiB pieces (a limit that holds stops it early), says
# how much, and keeps it for a while so that the host can measure it; only when the bounded piece was
# refused does it try the unbounded loop (which then ends at once, as the same call is refused).
HOGS = {
    "memfd": """
PIECE_MB = 16
def piece():
    fd = os.memfd_create("hog")
    write_all(fd, b"x" * (16 << 20))
    return fd
""",
    "sysv_shm": """
PIECE_MB = 16
libc.shmat.restype = ctypes.c_void_p
def piece():
    segment = sys_call(29, 0, 16 << 20, 0o1600)  # shmget(IPC_PRIVATE, 16 MiB)
    address = libc.shmat(segment, None, 0)
    ctypes.memset(address, 1, 16 << 20)
    libc.shmdt(ctypes.c_void_p(address))  # detached: the pages stay, outside the address space
    return segment
""",
    "sysv_shm_small": """
PIECE_MB = 1
libc.shmat.restype = ctypes.c_void_p
def piece():
    segment = sys_call(29, 0, 1 << 20, 0o1600)  # segments at the namespace's size cap, until its total cap
    address = libc.shmat(segment, None, 0)
    ctypes.memset(address, 1, 1 << 20)
    libc.shmdt(ctypes.c_void_p(address))
    return segment
""",
    "posix_shm": """
PIECE_MB = 16
def piece():
    import _posixshmem
    fd = _posixshmem.shm_open(f"/hog{len(held)}", os.O_CREAT | os.O_RDWR, 0o600)
    write_all(fd, b"x" * (16 << 20))
    return fd
""",
    "sysv_msg": """
PIECE_MB = 16
class Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 8192)]
def piece():
    queue = sys_call(68, 0, 0o1600)  # msgget(IPC_PRIVATE)
    for _ in range(2048):  # 16 MiB into each queue
        sys_call(69, queue, ctypes.byref(Message(1, b"x" * 8192)), 8192, 0o4000)  # msgsnd, IPC_NOWAIT
    return queue
""",
    "pipes": """
PIECE_MB = 16
import fcntl
def piece():
    pipes = []
    for _ in range(16):  # 16 x 1 MiB of pipe buffers
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, 1031, 1 << 20)  # F_SETPIPE_SZ
        os.write(write_end, b"x" * (1 << 20))
        pipes.append((read_end, write_end))
    return pipes
""",
}
HOLD = f"""
held = []
def bounded():
    while len(held) * PIECE_MB < {2 * MEMORY_MB}:
        held.append(piece())
    return len(held) * PIECE_MB
if attempt("hold twice memory_mb", bounded) is None:
    attempt("unbounded", lambda: [held.append(piece()) for _ in iter(int, 1)])
print("held_mb", len(held) * PIECE_MB, flush=True)
time.sleep(1.0)
"""


@pytest.fixture(scope="module")
def memory_sandbox() -> LocalSandbox:
    return LocalSandbox(MEMORY_LIMITS, pool_size=1)


@pytest.fixture(scope="module")
def memory_sandbox_without_cgroup() -> LocalSandbox:
    """On a host without writable cgroups (this one has v1's, hidden here): the channels are closed one by one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sandbox_host, "find_cgroup_parents", lambda: ({}, "none (the test hides them)"))
        box = LocalSandbox(MEMORY_LIMITS, pool_size=1)
    assert box.protections["cgroup"].startswith("missing")
    return box


@pytest.mark.parametrize("hog", sorted(HOGS))
@pytest.mark.parametrize("host_cgroups", [True, False], ids=["with_cgroup", "no_cgroup"])
def test_memory_outside_the_address_space_is_bounded(memory_sandbox, memory_sandbox_without_cgroup, hog, host_cgroups):
    box = memory_sandbox if host_cgroups else memory_sandbox_without_cgroup
    result, grown_mb = _run_measured(box, HOGS[hog] + HOLD)
    assert "ESCAPED" not in result.stdout, result
    held_mb = int(result.stdout.split("held_mb")[1].split()[0])
    print(
        f"{hog} {'with' if host_cgroups else 'without'} cgroup: held {held_mb} MiB, host shared memory grew {grown_mb:.1f} MiB"
    )
    assert held_mb < 2 * MEMORY_MB and grown_mb < 2 * MEMORY_MB
    assert result.status == "ok", result


# ---- keyrings -----------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _keyctl(*args) -> int:
    result = _libc.syscall(SYSCALLS["keyctl"], *args)
    assert result != -1, os.strerror(ctypes.get_errno())
    return result


def _keys_in(keyring: int) -> list[str]:
    """Descriptions of the keys in one of the grader's keyrings."""
    buffer = ctypes.create_string_buffer(4096)
    size = _keyctl(11, keyring, buffer, 4096)  # KEYCTL_READ: the serials, 4 bytes each
    serials = (ctypes.c_int32 * (size // 4)).from_buffer_copy(buffer.raw[:size])
    descriptions = []
    for serial in serials:
        _keyctl(6, serial, buffer, 4096)  # KEYCTL_DESCRIBE: "type;uid;gid;perm;description"
        descriptions.append(buffer.value.decode().split(";", 4)[-1])
    return descriptions


def test_keyrings_are_out_of_reach_and_nothing_carries_to_the_next_run():
    # The grader holds a session keyring with a secret, as under runc or a PAM login; its runs inherit it.
    _keyctl(1, None)  # KEYCTL_JOIN_SESSION_KEYRING: a fresh anonymous session keyring for this process
    key = _libc.syscall(SYSCALLS["add_key"], b"user", b"grader-secret", SECRET.encode(), len(SECRET), -3)
    assert key > 0
    box = LocalSandbox(LIMITS, pool_size=1)  # one slot: both runs below get the same uid
    plant = f"""
buffer = ctypes.create_string_buffer(4096)
attempt("read the grader's key", lambda: sys_call({SYSCALLS["keyctl"]}, 11, {key}, buffer, 4096))
attempt("search the session keyring", lambda: sys_call({SYSCALLS["keyctl"]}, 10, -3, b"user", b"grader-secret", 0))
attempt("request_key", lambda: sys_call({SYSCALLS["request_key"]}, b"user", b"grader-secret", None, 0))
for keyring, name in [(-3, "session"), (-4, "user"), (-5, "user session")]:
    attempt("plant in the " + name + " keyring",
            lambda: sys_call({SYSCALLS["add_key"]}, b"user", b"planted", b"from-run-1", 10, keyring))
"""
    _contained(_run_attempt(box, plant), 6)
    read_back = f"""
for keyring in [-4, -5]:
    attempt("find the planted key", lambda: sys_call({SYSCALLS["keyctl"]}, 10, keyring, b"user", b"planted", 0))
"""
    _contained(_run_attempt(box, read_back), 2)
    assert _keys_in(-3) == ["grader-secret"], "the grader's session keyring changed"
    assert _uids_in("/proc/key-users", 0, box.uids) == []


# ---- runs at once -------------------------------------------------------------------------------


def test_a_hostile_run_cannot_touch_a_concurrent_run(sandbox):
    victim = """
import os, time
with open("/tmp/answer", "w") as f:
    f.write("42")
time.sleep(1.5)
print(open("/tmp/answer").read(), os.listdir("/tmp"), os.listdir("/work"))
"""
    attacker = (
        PRELUDE
        + """
import glob, signal
time.sleep(0.3)  # the victim is running by now
others = [pid for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()]
print("contained sees no other process" if not others else "ESCAPED sees " + str(others), flush=True)
for pid in range(1, 200):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
def overwrite():
    found = glob.glob("/proc/*/root/tmp/answer") + glob.glob("/proc/*/cwd/../tmp/answer")
    if not found:
        raise OSError("no other run's files")
    for path in found:
        open(path, "w").write("0")
attempt("write another run's tmp", overwrite)
"""
    )
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: results.setdefault("victim", sandbox.run(victim))),
        threading.Thread(target=lambda: results.setdefault("attacker", sandbox.run(attacker))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["victim"].stdout == "42 ['answer'] ['main.py']\n", results["victim"]
    _contained(results["attacker"], 2)
    assert {results["victim"].status, results["attacker"].status} == {"ok"}


# ---- what the sandbox reports and refuses -------------------------------------------------------


def test_it_reports_its_protections_and_refuses_without_seccomp_unless_told(sandbox, monkeypatch, caplog):
    assert not sandbox.protections["seccomp"].startswith("missing") and "keyctl" in sandbox.protections["seccomp"]
    assert set(sandbox.protections) >= {"namespaces", "seccomp", "cgroup", "rlimits", "uids"}
    with caplog.at_level("INFO", logger="treadle.sandbox"):
        reported = LocalSandbox(LIMITS, pool_size=1)
    [record] = caplog.records  # once, at start
    assert all(f"{name}: {what}" in record.getMessage() for name, what in reported.protections.items())

    def no_libseccomp():
        raise ImportError("libseccomp not found")

    monkeypatch.setattr(sandbox_host, "seccomp_filter", no_libseccomp)
    with pytest.raises(RuntimeError, match=r"needs seccomp.*allow_missing=\('seccomp',\)"):
        LocalSandbox(LIMITS, pool_size=1)
    opted_out = LocalSandbox(LIMITS, pool_size=1, allow_missing=["seccomp"])
    assert opted_out.protections["seccomp"].startswith("missing")
    with pytest.raises(ValueError, match="allow_missing may name only 'seccomp'"):
        LocalSandbox(LIMITS, pool_size=1, allow_missing=["namespaces"])


def test_without_seccomp_the_cgroup_alone_bounds_a_memfd(monkeypatch):
    if not sandbox_host.find_cgroup_parents()[0]:
        pytest.skip("this host has no writable cgroup")
    monkeypatch.setattr(sandbox_host, "seccomp_filter", lambda: (_ for _ in ()).throw(ImportError("no libseccomp")))
    box = LocalSandbox(MEMORY_LIMITS.model_copy(update={"max_processes": 1}), pool_size=1, allow_missing=["seccomp"])
    result, grown_mb = _run_measured(box, HOGS["memfd"] + HOLD)
    # the kernel's OOM killer ends the run at memory.max (run_memory_mb: 128 + 2 x 4 + 2 MiB)
    assert result.status == "memory_limit" and grown_mb < 2 * MEMORY_MB, (result, grown_mb)


def test_a_pool_that_does_not_fit_in_memory_is_refused():
    with pytest.raises(
        ValueError, match=r"pool_size x run memory = 4 x 8226 MiB = 32904 MiB exceeds .* budget of 16000 MiB"
    ):
        LocalSandbox(Limits(memory_mb=512, max_processes=16), pool_size=4, memory_budget_mb=16000)
    assert Limits(memory_mb=512, max_processes=16).run_memory_mb == 512 * 16 + 2 * 16 + IPC_MB


def test_slot_uids_are_drawn_per_sandbox_not_from_the_pid(sandbox):
    other = LocalSandbox(LIMITS, pool_size=2)
    assert set(other.uids).isdisjoint(sandbox.uids)
    assert len(set(other.uids)) == 2 and all(uid >= 0x7100_0000 for uid in other.uids)
