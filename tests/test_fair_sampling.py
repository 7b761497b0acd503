"""Fair admission in the sampler (treadle.gpu_worker.sampling.hf.scheduler): at each step boundary the snapshot with
the fewest token positions admitted so far goes first, so a small request does not wait behind another
tenant's backlog of big ones. In-process, on the tiny model, with the batch helpers of test_batch_sampling."""

import time

from treadle.gpu_worker.scheduling.device_lock import DeviceLock
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


def test_a_snapshot_with_rows_in_the_batch_leaves_room_for_another_snapshots_first_request(bank):  # noqa: F811
    # Each big request projects 3 rows x (9 + 20) = 87 positions of the 190 the batch may hold. "one" has rows in
    # the batch after its first, so it fills at most 3/4 (142): its second waits. The small request of "two",
    # arriving while big0 runs, joins at the next step (4 rows x 28 = 112) and ends long before big0's 20 tokens.
    # Were "one" allowed the whole budget, big1 would have joined big0 (174), and the small one (7 x 28 = 196)
    # waited for both to end.
    scheduler = SampleScheduler(bank, bank.host, DeviceLock(), max_batch_tokens=190)
    finished, futures = [], {}

    def submit(name: str, request) -> None:
        futures[name] = scheduler.sample(request)
        futures[name].add_done_callback(lambda _, name=name: finished.append(name))

    try:
        with scheduler.device_lock:  # both bigs queued before the first admission round
            for i in range(2):
                submit(f"big{i}", job(bank, PROMPTS[1], "one", num_samples=3, max_tokens=20, seed=i, stop=[]))
        deadline = time.monotonic() + WAIT
        while not scheduler._batch:  # big0 is decoding
            assert time.monotonic() < deadline
            time.sleep(0.001)
        submit("small", job(bank, PROMPTS[2], "two", num_samples=1, max_tokens=3, seed=0, stop=[]))
        for future in list(futures.values()):
            future.result(timeout=WAIT)
    finally:
        scheduler.close()
    assert finished == ["small", "big0", "big1"], finished
