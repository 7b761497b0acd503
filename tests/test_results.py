"""Op results in a real Redis: the sequencer's one-write store reads back as Celery's own, waits wake on it."""

from __future__ import annotations

import threading
import time

import pytest

from treadle import ServiceClient
from treadle.errors import InvalidRequestError, NotFoundError
from treadle.gpu_worker.scheduling.linger import Linger
from treadle.gpu_worker.executor.op_record import FinishedOp, OpRecorder
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.gpu_worker.sessions.hosting import SessionStores
from treadle.local_stack import LocalStack
from treadle.metering import Meter, OpUsage, Usage
from treadle.queue.celery_app import make_app
from treadle.queue import names
from treadle.queue.journal import JournalEntry
from treadle.queue.results import ResultStore
from treadle.types import ModelInput, SamplingParams
from tests.test_sessions import sft_batch


def test_a_pipelined_store_reads_back_like_celerys_own(redis_client, redis_url):
    results = ResultStore(make_app(redis_url))
    assert results.in_redis(redis_url) and not results.in_redis(redis_url[:-1] + "1")
    value = {"loss": 1.5, "metrics": {"n": 3}}
    results.store_ok("s:1", value)
    error = InvalidRequestError("data[0].weights: length 3 != 4 tokens")
    results.store_error("s:2", error)
    with redis_client.pipeline() as pipe:
        results.queue_store(pipe, "s:3", value, None)
        results.queue_store(pipe, "s:4", None, error)
        pipe.execute()
    assert results.poll("s:1") == results.poll("s:3") == (True, value)
    for fid in ("s:2", "s:4"):
        with pytest.raises(InvalidRequestError, match="length 3 != 4 tokens"):
            results.poll(fid)
    assert redis_client.ttl(results.backend.get_key_for_task("s:3")) > 0  # results expire like Celery's


def test_a_watch_wakes_its_sleeper_when_the_result_is_stored(redis_client, redis_url):
    results = ResultStore(make_app(redis_url))
    writer = ResultStore(make_app(redis_url))

    def store_as_the_sequencer_does():
        with redis_client.pipeline() as pipe:
            writer.queue_store(pipe, "s:7", {"ok": True}, None)
            pipe.execute()

    with results.watch("s:7") as watch:
        assert watch.subscribed and results.poll("s:7") == (False, None)
        threading.Timer(0.3, store_as_the_sequencer_does).start()
        # Woken by the publication (what it returns), not by the 30 s running out (None).
        published = watch.sleep(30)
    assert published is not None and results.poll("s:7", published) == (True, {"ok": True})
    assert results.poll("s:7") == (True, {"ok": True})
    # The thread's subscription is reused, and a late message of the old channel does not wake the next.
    with results.watch("s:8") as watch:
        writer.store_ok("s:7", {"again": 1})
        assert watch.sleep(0.5) is None


@pytest.mark.parametrize("results_db", ["same", "other"])
def test_an_ops_usage_result_and_applied_seq_are_all_written(redis_client, redis_url, results_db):
    """Results in the broker's Redis take the one-transaction path; in another Redis, three writes."""
    result_url = redis_url if results_db == "same" else redis_url[:-1] + "1"
    app = make_app(redis_url, result_url)
    app.backend.client.flushdb()
    recorder = OpRecorder(
        app, SessionStores.on(redis_client, lease=None), UsageRecorder(redis_client), Linger(redis_client, "w", 0)
    )
    assert recorder.one_write == (results_db == "same")
    entry = JournalEntry(session_id="s1", seq=4, op="forward_backward", submitted_at=0.0, raw_request=b"")
    usage = OpUsage(
        session_id="s1", op_id="4", op="forward_backward", base_model="tiny", trained_tokens=12, compute_s=0.5
    )
    redis_client.hset(names.journal_key("s1"), "5", b"optim_step\n0.0\n{}")  # the op after it, journaled
    redis_client.set(names.lease_key("s1"), b"lease")
    for _ in range(2):  # a retry through a Redis outage repeats the whole write: still counted once
        following = recorder.write(FinishedOp(entry, 0.5, payload={"loss": 2.0}, usage=usage, step=3))
    assert following.entry is not None  # read in the same round trip
    assert (following.entry.seq, following.entry.op, following.lease) == (5, "optim_step", b"lease")
    assert ResultStore(app).poll("s1:4") == (True, {"loss": 2.0})
    assert redis_client.hget(names.session_key("s1"), "applied") == b"4"
    assert redis_client.hget(names.session_key("s1"), "step") == b"3"  # the engine's step, in the same write
    assert Meter(redis_client).session_usage("s1") == Usage(ops=1, trained_tokens=12, compute_s=0.5)


def test_a_worker_keeps_results_for_its_result_ttl_and_a_wait_after_that_fails_as_expired(tiny_model_dir, tmp_path):
    """`--result_ttl_s` bounds how long results stay in Redis. Once an op's result is gone, a wait on its future fails
    at once with NotFoundError (the session's record says the op ran); a sample's submission record expires with its
    result, so a wait on it fails too. Neither waits for a result that will never come."""
    stack = LocalStack([f"tiny={tiny_model_dir}"], home=str(tmp_path / "stack"), worker_args=["--result_ttl_s", "2"])
    with stack:
        sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
        tc = sc.create_lora_training_client("tiny", rank=4, seed=0)
        op = tc.forward_backward(sft_batch(0, n=2, length=16), "cross_entropy")
        assert op.result(timeout=120).loss_fn_outputs
        sample = tc.save_weights_and_get_sampling_client("ttl").sample(
            ModelInput.from_ints([5, 6, 7]), 1, SamplingParams(max_tokens=2, seed=0)
        )
        assert len(sample.result(timeout=120).sequences) == 1
        redis, backend = sc.ops.redis, sc.ops.results.backend
        keys = [backend.get_key_for_task(op.id), backend.get_key_for_task(sample.id), names.submitted_key(sample.id)]
        assert 0 < redis.ttl(keys[0]) <= 2 and 0 < redis.ttl(keys[1]) <= 2 and 0 < redis.ttl(keys[2]) <= 2
        for _ in range(300):  # Redis drops an expired key on access, or within a second or so
            if not redis.exists(*keys):
                break
            time.sleep(0.1)
        assert not redis.exists(*keys)
        with pytest.raises(NotFoundError, match=f"op 1 of session {tc.session_id} ran, but its result has expired"):
            sc.ops.wait(op.id, timeout=120)
        with pytest.raises(
            InvalidRequestError, match="no sample was submitted under this id .or its result has expired"
        ):
            sc.ops.wait(sample.id, timeout=120)
        assert tc.forward_backward(sft_batch(1, n=2, length=16), "cross_entropy").result(timeout=120)  # session fine
