"""Fair admission in the sampler (treadle.gpu_worker.sampling.hf.scheduler): at each step boundary the snapshot with
the fewest token positions admitted so far goes first, so a small request does not wait behind another
tenant's backlog of big ones. In-process, on the tiny model, with the batch helpers of test_batch_sampling."""

from treadle.gpu_worker.model.device_lock import DeviceLock
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from tests.test_batch_sampling import PROMPTS, WAIT, bank, job  # noqa: F401  (bank: the module's adapters)


def test_a_small_request_goes_in_at_the_first_round_with_room_not_after_a_backlog_of_big_ones(bank):  # noqa: F811
    # Each big request projects 3 rows x (9 + 20) = 87 positions of the 100 the batch may hold: one at a time,
    # and the small one (1 x (2 + 3)) cannot join a running big one either. In arrival order it would run last.
    scheduler = SampleScheduler(bank, bank.host, DeviceLock(), max_batch_tokens=100)
    finished, futures = [], {}
    try:
        with scheduler.device_lock:  # all queued before the first admission round
            for name, request in [
                *(
                    (f"big{i}", job(bank, PROMPTS[1], "one", num_samples=3, max_tokens=20, seed=i, stop=[]))
                    for i in range(4)
                ),
                ("small", job(bank, PROMPTS[2], "two", num_samples=1, max_tokens=3, seed=0, stop=[])),
            ]:
                futures[name] = scheduler.sample(request)
                futures[name].add_done_callback(lambda _, name=name: finished.append(name))
        responses = {name: future.result(timeout=WAIT) for name, future in futures.items()}
    finally:
        scheduler.close()
    bigs = [name for name in finished if name.startswith("big")]
    assert bigs == ["big0", "big1", "big2", "big3"]  # one snapshot's requests keep their order
    assert finished.index("small") <= 1, finished  # at most the big one admitted in the same first round before it
    assert len(responses["small"].sequences) == 1 and all(
        len(r.sequences) == 3 for n, r in responses.items() if n != "small"
    )
