"""What a code sandbox is to its callers: run one Python program on one stdin, get an `Execution` back.

`LocalSandbox` (`treadle/sandbox/local.py`) is the implementation on this machine; a client of an
HTTP sandbox service (e.g. SandboxFusion) can implement `Sandbox` instead.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

Status = Literal["ok", "runtime_error", "timeout", "memory_limit", "output_limit", "sandbox_error"]


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
