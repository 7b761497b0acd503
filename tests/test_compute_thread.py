"""On CPU, an engine's tensor computations run on the process's one compute thread, whoever asks for them (toy-sized
training ops on more than one configured thread excepted: tests/test_cpu_threads.py)."""

import threading

import pytest
import torch

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.scheduling.compute_thread import ComputeThread, compute_thread
from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.types import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams, TensorData

WAIT_S = 60


def datum(ids: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(ids[1:], "int64"),
            "weights": TensorData.from_list([1.0] * (len(ids) - 1), "float32"),
        },
    )


def test_run_computes_on_the_compute_thread_with_the_callers_grad_mode_and_errors():
    compute = ComputeThread()
    lock = DeviceLock(compute)

    def where():
        return threading.get_ident(), torch.is_grad_enabled()

    with lock:
        assert lock.run(where) == (compute.ident, True)
        with torch.no_grad():
            assert lock.run(where) == (compute.ident, False)
        with pytest.raises(ZeroDivisionError):
            lock.run(lambda: 1 / 0)
        assert lock.run(where)[0] == compute.ident  # still serving after an error


def test_a_call_on_the_compute_thread_may_take_its_callers_lock_again():
    lock = DeviceLock(ComputeThread())

    def nested():
        with lock:  # the holder's call: reentrant, not a wait for the holder (which waits for this call)
            return lock.run(lambda: "inner")

    with lock:
        assert lock.run(nested) == "inner"
    # and the lock is free afterwards, for another thread
    taken = threading.Event()
    other = threading.Thread(target=lambda: (lock.acquire(), taken.set(), lock.release()))
    other.start()
    assert taken.wait(WAIT_S)
    other.join(WAIT_S)


def test_run_refuses_a_thread_that_does_not_hold_the_lock():
    lock = DeviceLock(ComputeThread())
    with pytest.raises(RuntimeError, match="held by this thread"):
        lock.run(lambda: None)


def test_training_sampling_and_state_all_compute_on_one_thread(tiny_model_dir, tmp_path):
    """A forward hook on every module records the thread of every forward and the torch threads it had: the
    engine's load (its profile runs the model: `model_profile`), training ops from this thread, a checkpoint round
    trip, and the sampler's prefill and decode steps. Only the compute thread may compute on more than one thread:
    one forward of the load on this thread started a second OpenMP team, and every later sampler step was 1.5 to
    2.5x slower (benchmarks/sampling.py)."""
    threads: set[tuple[str, int]] = set()
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda *_: threads.add((threading.current_thread().name, torch.get_num_threads()))
    )
    # Two threads here and on the compute thread (each thread keeps its own count; an earlier test in this process
    # may have left one): on one thread there is no team to start.
    previous, compute = torch.get_num_threads(), compute_thread(torch.device("cpu"))
    assert compute is not None
    torch.set_num_threads(2)
    compute.run(torch.set_num_threads, 2)
    engine = None
    try:
        engine = Engine(tiny_model_dir)
        assert threads == {("treadle-compute", 2)}  # the load's forwards
        engine.create_session("s", LoraConfig(rank=4, seed=0))
        engine.forward_backward("s", [datum([1, 5, 9, 13, 17, 21])], "cross_entropy")
        engine.optim_step("s", AdamParams(learning_rate=1e-3))
        engine.save_state("s", str(tmp_path / "state"))
        engine.load_state("s", str(tmp_path / "state"), with_optimizer=True)
        engine.snapshot_sampler("s", "snap")
        engine.samplers.sample_async(
            "snap", ModelInput.from_ints([1, 5, 9]), 2, SamplingParams(max_tokens=4, seed=0)
        ).result(timeout=WAIT_S)
        assert engine.samplers.compute_logprobs("snap", ModelInput.from_ints([1, 5, 9, 13]))[0] is None
    finally:
        hook.remove()
        if engine is not None:
            engine.close()
        torch.set_num_threads(previous)
        compute.run(torch.set_num_threads, previous)
    assert {name for name, count in threads if count > 1} == {"treadle-compute"}
