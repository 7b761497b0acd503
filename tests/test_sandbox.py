"""The local sandbox against escape attempts: each run is contained, gets a clear verdict, and the host is unaffected."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest

from treadle.sandbox import Limits, LocalSandbox, run_all
from treadle.sandbox.host import find_cgroup_parents

LIMITS = Limits(cpu_seconds=1, wall_seconds=2.0, memory_mb=256, max_processes=8, max_output_bytes=64 * 1024, work_mb=4)


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox(LIMITS, pool_size=2)


def _processes_of(uids: list[int]) -> list[int]:
    """Host pids whose real uid is one of the sandbox's uids."""
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


@pytest.fixture(autouse=True)
def host_unaffected(sandbox):
    yield
    assert _processes_of(sandbox.uids) == [], "a sandboxed process outlived its run"


def test_a_correct_program_reads_stdin_and_passes(sandbox):
    result = sandbox.run("a, b = map(int, input().split())\nprint(a * b + 1)", "6 7\n")
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "43\n")


def test_a_crash_is_a_runtime_error_with_its_traceback(sandbox):
    result = sandbox.run("print('partial')\n1 / 0")
    assert result.status == "runtime_error" and result.exit_code == 1
    assert result.stdout == "partial\n" and "ZeroDivisionError" in result.stderr


def test_no_network_even_to_a_server_on_the_host_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = f"""
import socket
for target in [("127.0.0.1", {port}), ("8.8.8.8", 53)]:
    try:
        socket.create_connection(target, timeout=1).close()
        print("connected", target)
    except OSError as e:
        print("blocked", type(e).__name__)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("resolved")
except OSError:
    print("no dns")
"""
    result = sandbox.run(program)
    assert result.status == "ok", result
    assert "connected" not in result.stdout and result.stdout.count("blocked") == 2 and "no dns" in result.stdout
    with pytest.raises(socket.timeout):
        server.accept()  # nothing ever reached the host's socket
    server.close()


def test_a_fork_bomb_is_capped_and_killed(sandbox):
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = sandbox.run(program)
    assert result.status == "timeout"
    assert sandbox.run("print('fine')").stdout == "fine\n"  # the next run in the pool is unharmed


def test_a_memory_bomb_hits_the_memory_limit(sandbox):
    result = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert result.status == "memory_limit" and "MemoryError" in result.stderr


def test_an_infinite_loop_hits_the_cpu_limit(sandbox):
    result = sandbox.run("while True:\n    pass")
    assert result.status == "timeout" and result.exit_code is not None and result.exit_code != 0


def test_a_sleep_past_the_wall_limit_is_killed(sandbox):
    result = sandbox.run("import time\nprint('start', flush=True)\ntime.sleep(60)\nprint('end')")
    assert result.status == "timeout" and result.stdout == "start\n"


def test_writes_outside_its_directory_fail_and_leave_the_host_untouched(sandbox, tmp_path):
    host_file = tmp_path / "escaped.txt"
    program = f"""
import os
for path in [{str(host_file)!r}, "/usr/escaped.txt", "/escaped.txt", "../escaped.txt", "/proc/sys/kernel/hostname"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
with open("inside.txt", "w") as f:  # its own directory is writable
    f.write("ok")
print("inside", open("inside.txt").read())
"""
    result = sandbox.run(program)
    assert result.status == "ok", result
    assert "wrote" not in result.stdout and result.stdout.count("denied") == 5 and "inside ok" in result.stdout
    assert not host_file.exists() and not os.path.exists("/usr/escaped.txt") and not os.path.exists("/escaped.txt")


def test_the_parents_environment_and_files_are_invisible(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_TEST_SECRET", "s3cr3t-env")
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("s3cr3t-file")
    program = f"""
import glob, os
print(dict(os.environ))
for path in glob.glob("/proc/*/environ"):
    try:
        print(path, open(path).read())
    except OSError:
        pass
for path in [{str(secret_file)!r}, os.path.expanduser("~/.bashrc"), "/root/.bashrc", "/etc/passwd"]:
    try:
        print(path, open(path).read())
    except OSError as e:
        print("cannot read", path, type(e).__name__)
print("home", sorted(os.listdir("/root")) if os.path.isdir("/root") else None)
"""
    result = sandbox.run(program)
    assert result.status == "ok", result
    assert "s3cr3t" not in result.stdout and result.stdout.count("cannot read") == 4
    assert "TREADLE_TEST_SECRET" not in result.stdout
    assert sorted(os.listdir(os.path.expanduser("~"))) != [], "the host home has files the sandbox must not see"
    home_line = next(line for line in result.stdout.splitlines() if line.startswith("home"))
    assert home_line in ("home None", "home ['.pyenv']")  # at most the interpreter's own read-only prefix


def test_it_cannot_kill_its_parent_or_other_host_processes(sandbox):
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        program = f"""
import os, signal
for pid in [os.getppid(), {os.getpid()}, {bystander.pid}, 1, -1]:
    try:
        os.kill(pid, signal.SIGKILL)
        print("sent", pid)
    except OSError as e:
        print("refused", pid, type(e).__name__)
"""
        result = sandbox.run(program)
        assert result.status in ("ok", "timeout", "runtime_error")  # a clear verdict whatever it killed inside
        assert bystander.poll() is None, "a host process was killed"
    finally:
        bystander.kill()
        bystander.wait()
    # this test process is still here, and so is the sandbox
    assert sandbox.run("print(2 + 2)").stdout == "4\n"


def test_privileges_cannot_be_regained(sandbox):
    program = """
import os
for attempt in [lambda: os.setuid(0), lambda: os.chroot("/tmp"), lambda: os.mknod("/tmp/sda", 0o600 | 0o60000, os.makedev(8, 0))]:
    try:
        attempt()
        print("allowed")
    except OSError as e:
        print("refused", type(e).__name__)
print("uid", os.getuid(), os.geteuid())
"""
    result = sandbox.run(program)
    assert result.status == "ok", result
    uid, euid = result.stdout.split()[-2:]
    assert result.stdout.count("refused") == 3 and int(uid) in sandbox.uids and int(euid) in sandbox.uids


def test_a_huge_output_is_capped(sandbox):
    result = sandbox.run("while True:\n    print('x' * 10000)")
    assert result.status == "output_limit"
    assert len(result.stdout) == LIMITS.max_output_bytes


def test_a_huge_file_hits_the_file_size_limit(sandbox):
    result = sandbox.run("with open('big', 'wb') as f:\n    f.write(b'x' * (1 << 20))")
    assert result.status == "runtime_error" and "File too large" in result.stderr


def test_a_background_process_does_not_outlive_the_run(sandbox):
    program = """
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        import time
        time.sleep(30)
    os._exit(0)
print("parent done")
"""
    result = sandbox.run(program)
    assert result.status == "ok" and result.stdout == "parent done\n"
    # host_unaffected then asserts that no process of the sandbox's uids is left


def test_many_runs_in_parallel_are_bounded_by_the_pool(sandbox):
    jobs = [(f"import os\nprint(os.getuid(), {i} * {i})", "") for i in range(8)]
    results = run_all(sandbox, jobs, parallelism=8)
    assert [r.stdout.split()[1] for r in results] == [str(i * i) for i in range(8)]
    assert {int(r.stdout.split()[0]) for r in results} <= set(
        sandbox.uids
    )  # at most pool_size runs at once, one per uid


def test_concurrent_callers_share_the_pool_safely(sandbox):
    outputs: list[str] = []
    threads = [threading.Thread(target=lambda i=i: outputs.append(sandbox.run(f"print({i})").stdout)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outputs) == sorted(f"{i}\n" for i in range(6))


def test_cgroup_discovery_takes_a_delegated_v2_subtree_then_v1(tmp_path):
    """The discovery on a host's tables, written here (this host's cgroup v2 has no memory controller to try it on)."""
    v2 = tmp_path / "v2"
    service, leaf = v2 / "grader.service", v2 / "grader.service" / "main"
    leaf.mkdir(parents=True)
    (leaf / "cgroup.subtree_control").write_text(
        "\n"
    )  # the grader's own leaf: it may not have children with controllers
    (service / "cgroup.subtree_control").write_text("cpu memory pids\n")  # its delegated parent does
    v1 = {c: tmp_path / "v1" / c / "box" for c in ("memory", "pids")}
    for path in v1.values():
        path.mkdir(parents=True)
    mountinfo, own = tmp_path / "mountinfo", tmp_path / "cgroup"
    mountinfo.write_text(
        f"30 20 0:26 / {v2} rw - cgroup2 cgroup2 rw\n"
        f"31 20 0:27 / {tmp_path / 'v1' / 'memory'} rw - cgroup cgroup rw,memory\n"
        f"32 20 0:28 / {tmp_path / 'v1' / 'pids'} rw - cgroup cgroup rw,pids\n"
    )
    own.write_text("2:memory:/box\n1:pids:/box\n0::/grader.service/main\n")
    parents, found = find_cgroup_parents(str(mountinfo), str(own))
    assert parents == {"memory": str(service), "pids": str(service)} and found == f"cgroup v2 under {service}"
    (service / "cgroup.subtree_control").write_text("cpu pids\n")  # memory not delegated: v1's hierarchies instead
    parents, found = find_cgroup_parents(str(mountinfo), str(own))
    assert parents == {c: str(path) for c, path in v1.items()} and found.startswith("cgroup v1")
    own.write_text("0::/grader.service/main\n")  # neither
    assert find_cgroup_parents(str(mountinfo), str(own))[0] == {}
