"""The one thread of a CPU worker process that runs tensor computations: training ops, sampler forwards, model loads.

A worker computes from several threads (the op thread, the sampler's decode loop, the caretaker's idle
unloads, the logprob audit), one at a time under the engine's `DeviceLock`. On CPU, torch runs each
parallel op on an OpenMP team of the calling thread, and GNU OpenMP keeps one team (a pool of threads) per
thread that ever ran one. Once the process holds more pool threads than cores, libgomp stops letting idle
pool threads spin between parallel regions and puts them to sleep at once (its "throttled" spin), so every
region of every later op pays a wake-up. Measured on 2 cores: a second thread that had run one matmul made
the main thread's small linears 1.49x slower (454 -> 676 us), HF `generate` of 32 rows 1.30x (18 -> 24 s),
and treadle's sampler as slow as that, since the op thread had run training ops.

So on CPU every computation on more than one thread goes to this thread (`run`), whichever thread holds the
lock, and the process has one team. A toy-sized training op computes on one thread of its caller instead: it
starts no team, and it would pay the hand-off (treadle.gpu_worker.scheduling.cpu_threads). On CUDA the OpenMP teams
do little (kernels run on the device), so nothing moves there.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time on its own thread, with the caller's grad mode; `acting_for` is the thread
    whose call is running (its locks count as held by this thread meanwhile:
    treadle.gpu_worker.scheduling.device_lock)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.acting_for: int | None = None
        self._thread = threading.Thread(target=self._loop, name="treadle-compute", daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def run(self, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the compute thread (inline when called from it); its result or its exception."""
        if threading.get_ident() == self._thread.ident:
            return fn(*args, **kwargs)
        done: Future = Future()
        self._jobs.put((threading.get_ident(), torch.is_grad_enabled(), fn, args, kwargs, done))
        # No timeout: like a call made inline, it returns when the computation does.
        return done.result()

    def _loop(self) -> None:
        while True:
            caller, grad, fn, args, kwargs, done = self._jobs.get()
            self.acting_for = caller
            try:
                with torch.set_grad_enabled(grad):
                    done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, who raises it
                done.set_exception(exc)
            finally:
                self.acting_for = None


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def compute_thread(device: torch.device) -> ComputeThread | None:
    """The process's compute thread for a model on `device` (one per process, shared by its engines: they share
    the CPU), or None on an accelerator."""
    global _shared
    if device.type != "cpu":
        return None
    with _shared_lock:
        if _shared is None:
            _shared = ComputeThread()
        return _shared
