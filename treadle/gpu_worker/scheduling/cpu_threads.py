"""Intra-op threads on CPU by the size of the work: a toy-sized op runs on one thread.

torch gives every op all the threads it is configured with, and an OpenMP worker thread that has just
run spins for about a millisecond waiting for more. An op on a tiny model gains nothing from a second
core (measured on the tests' tiny Llama, 2 cores: a 4x32 forward_backward + optim_step took 9.1 ms on one
thread and 8.9 on two, 512 tokens 19.2 and 19.5; only at 2048 tokens were two threads faster, 78.8 against
65.3 ms), while its spinning worker thread takes a core from the client and Redis that share the machine.
So an op whose work (tokens x base parameters; an optimizer step counts ten per trainable parameter) is
below `MIN_PARALLEL_WORK` runs on one thread; any larger op, and everything on a real model (one token
of SmolLM2-135M is already above it), on the threads torch was configured with. On CUDA nothing changes.
Callers hold the engine's device lock, so no other op runs while the count is lowered.

An op on one thread starts no OpenMP team, so it may run on the thread that asks for it: the engine computes
toy-sized work there instead of handing it to the compute thread (treadle.gpu_worker.scheduling.compute_thread),
whose hand-off and wake-up cost a few percent of a 4 ms op.

Except while larger work is under way: a toy op that comes within `TEAM_IN_USE_S` of a large op's end runs on
the compute thread's team, with all threads. Run on one thread of its caller, it leaves the team idle for its few
milliseconds, the team's threads fall asleep, and the next large op pays to wake them. That is the case of two
tenants on one worker, a light loop's steps between a heavy tenant's ops: measured in-process on the tiny model,
a 16 x 256 forward_backward of about 50 ms took 1-4 ms longer after one to three 4 x 32 steps run on one thread
than after them run on the team, which cost it nothing and the steps no more. Only large ops mark the team in
use, so a loop of toy ops alone stays on its caller's thread.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch

T = TypeVar("T")

# Between the tiny model's 512 tokens (5.9e7: one thread as fast) and 2048 (2.4e8: two threads 1.2x faster).
MIN_PARALLEL_WORK = 1e8
# A toy op this soon after a large op's end runs on the team (see above): a heavy tenant's next op is that close.
TEAM_IN_USE_S = 0.1
# When the last large op ended (monotonic seconds): process-wide, like the compute thread, since engines share cores.
_large_ended = float("-inf")


class CpuThreads:
    def __init__(self, device: torch.device):
        self.threads = torch.get_num_threads()
        self.enabled = device.type == "cpu" and self.threads > 1

    def small(self, work: float) -> bool:
        """True when `work` should run on one thread (`one`): toy-sized, and no large op has just run."""
        return self.enabled and work < MIN_PARALLEL_WORK and time.monotonic() - _large_ended > TEAM_IN_USE_S

    def compute(self, work: float, on_team: Callable[..., T], fn: Callable[..., T], /, *args, **kwargs) -> T:
        """`fn(*args, **kwargs)`: on one thread of this one when `work` is `small`, else through `on_team` (the
        device lock's `run`); large work marks the team in use."""
        global _large_ended
        if self.small(work):
            with self.one():
                return fn(*args, **kwargs)
        result = on_team(fn, *args, **kwargs)
        if self.enabled and work >= MIN_PARALLEL_WORK:
            _large_ended = time.monotonic()
        return result

    @contextmanager
    def one(self) -> Iterator[None]:
        """Torch computes on one thread of this thread within the block."""
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(self.threads)
