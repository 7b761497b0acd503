"""The few process operations a runner needs: die with the runner, kill a group, tell a reused pid."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec must not load libraries
_PR_SET_PDEATHSIG = 1


def die_with_runner() -> None:
    """In the child, before exec: one prctl, so the kernel kills the command when the runner dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def process_start_time(pid: int) -> str | None:
    """The start time of `pid` (clock ticks after boot, /proc/<pid>/stat field 22), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def has_exited(proc: subprocess.Popen) -> bool:
    """Whether the command exited, without reaping it: its pid (= its group id) stays reserved until the
    group is killed, so the kill can never hit a process that reused the number."""
    if proc.returncode is not None:
        return True
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
