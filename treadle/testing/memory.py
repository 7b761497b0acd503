"""The peak of CPU tensor memory over a computation, from torch's profiler: exact and deterministic.

torch allocates CPU tensors through its own allocator, which hands them to malloc (mmap for large ones), so
`tracemalloc` (Python's allocator) sees none of them, and the process's resident set also counts malloc's
arenas, the interpreter and whatever else runs. With `profile_memory` torch reports every tensor allocation and
free to the profiler, with its size: their running sum is the bytes of tensors alive, and its maximum the peak.
Tensors allocated before the profile started count as a baseline (their frees are not reported), so the figure is
what the computation adds. The profiler records the thread it was started on: the computation must run there.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_tensor_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """`fn()`'s result, and the most bytes of CPU tensors it held alive at once beyond those alive before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak
