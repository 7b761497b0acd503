"""Toy-sized ops run on one torch thread (treadle.gpu_worker.scheduling.cpu_threads); real-sized ones on all of them."""

from __future__ import annotations

import threading

import torch

from treadle.gpu_worker.scheduling import cpu_threads
from treadle.gpu_worker.scheduling.cpu_threads import MIN_PARALLEL_WORK, CpuThreads
from treadle.gpu_worker.engine import Engine
from treadle.types import AdamParams, LoraConfig
from tests.test_sessions import sft_batch


def test_work_below_the_bound_runs_on_one_thread_and_the_count_comes_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = CpuThreads(torch.device("cpu"))
        assert threads.small(MIN_PARALLEL_WORK - 1) and not threads.small(MIN_PARALLEL_WORK)
        with threads.one():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        assert not CpuThreads(torch.device("cuda")).small(1)  # an accelerator's ops are left alone
        torch.set_num_threads(1)
        assert not CpuThreads(torch.device("cpu")).small(1)  # one thread configured: nothing to lower
    finally:
        torch.set_num_threads(before)


def test_the_engine_sizes_its_training_ops(tiny_model_dir, monkeypatch):
    """On the tiny model a forward_backward and an optim_step are toy-sized: they run on one thread of the caller
    (no hand-off to the compute thread), and the count is back to the configured two afterwards. Work above the
    bound runs on the compute thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "_large_ended", float("-inf"))  # no large op has run (another test's may have)
    try:
        engine = Engine(tiny_model_dir)
        engine.create_session("s", LoraConfig(rank=4, seed=0))
        seen = []
        engine._host.model.register_forward_pre_hook(
            lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads()))
        )
        engine.forward_backward("s", sft_batch(0), "cross_entropy")
        assert seen and set(seen) == {(threading.current_thread().name, 1)}
        assert torch.get_num_threads() == 2
        engine.optim_step("s", AdamParams(learning_rate=1e-3))
        assert torch.get_num_threads() == 2

        seen.clear()
        monkeypatch.setattr(cpu_threads, "MIN_PARALLEL_WORK", 0)
        engine.forward_backward("s", sft_batch(0), "cross_entropy")
        # (the compute thread's own count is the process's: in this test process it may be one)
        assert seen and {name for name, _ in seen} == {"treadle-compute"}
        engine.close()
    finally:
        torch.set_num_threads(before)


def test_a_toy_op_right_after_large_work_keeps_the_team_busy(tiny_model_dir, monkeypatch):
    """Between a heavy tenant's ops a toy-sized op runs on the compute thread, so the team does not fall asleep
    before the heavy tenant's next op; once the team has been idle longer than `TEAM_IN_USE_S`, toy ops run on
    their caller's thread again. Toy ops alone never mark the team in use. (The clock is set, not waited for.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "_large_ended", float("-inf"))
    monkeypatch.setattr(cpu_threads, "TEAM_IN_USE_S", 3600.0)  # "right after", however slow this machine is
    caller = threading.current_thread().name
    try:
        engine = Engine(tiny_model_dir)
        engine.create_session("s", LoraConfig(rank=4, seed=0))
        seen: list[str] = []
        engine._host.model.register_forward_pre_hook(lambda *_: seen.append(threading.current_thread().name))

        def threads_of_a_toy_step() -> set[str]:
            seen.clear()
            engine.forward_backward("s", sft_batch(0), "cross_entropy")
            engine.optim_step("s", AdamParams(learning_rate=1e-3))
            return set(seen)

        assert threads_of_a_toy_step() == {caller}
        assert threads_of_a_toy_step() == {caller}  # a loop of toy ops stays on its caller's thread

        bound = cpu_threads.MIN_PARALLEL_WORK
        monkeypatch.setattr(cpu_threads, "MIN_PARALLEL_WORK", 0)  # the next op counts as large
        engine.forward_backward("s", sft_batch(1), "cross_entropy")
        monkeypatch.setattr(cpu_threads, "MIN_PARALLEL_WORK", bound)
        assert threads_of_a_toy_step() == {"treadle-compute"}
        assert torch.get_num_threads() == 2

        cpu_threads._large_ended -= 2 * cpu_threads.TEAM_IN_USE_S  # the team idle since
        assert threads_of_a_toy_step() == {caller}
        engine.close()
    finally:
        torch.set_num_threads(before)
