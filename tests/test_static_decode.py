"""The static-shape decode path (`treadle/gpu_worker/sampling/hf/slot_batch.py`), on CPU.

A GPU replays its decode step as a captured CUDA graph; what makes that possible is that the step traces as
one graph and keeps tracing to the same graph while rows join and leave. That is checked here for every
family (the hybrid ones' recurrent states in slots too), in fp32 and bf16: `torch.compile(fullgraph=True)` (no
graph break) with the "eager" backend, staggered requests of two snapshots and the base model in one bucket,
exactly one graph; on MoE families one snapshot adapts the 3-D expert tensors and the other does not, so
expert-adapter rows, other adapters' rows and base rows share the step.
The traced step computes what the eager one does, and in fp32 the same tokens as the dynamic path with
logprobs to rounding. A model that does not take it is refused by name; rows the table cannot hold decode
beside on the dynamic path; a row's numbers do not depend on its batch (CPU batch invariance). The deterministic
mode (`--sampler_deterministic_rows`, for GPUs) runs every step in its one bucket.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.model_check import cross_entropy_datum
from treadle.gpu_worker.sampling.backend import SampleJob
from treadle.gpu_worker.sampling.hf.batch_decode import DecodeBatch
from treadle.gpu_worker.sampling.hf.decode_path import decode_batch
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from treadle.gpu_worker.sampling.hf.slot_batch import FIXED_RANK, SlotBatch, fixed_bucket
from treadle.gpu_worker.training.validation import prepare_sample
from treadle.testing.families import FAMILIES
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import AdamParams, LoraConfig, ModelInput, SamplingParams

# (snapshot or None, samples, max_tokens, prompt length): the first two start together, the last two join at the
# third step; rows of 12-20 tokens leave at different steps. Every row fits one bucket (8 rows, 64 positions).
REQUESTS = [("a", 2, 12, 6), (None, 1, 7, 9), ("b", 2, 20, 12), ("a", 1, 5, 15)]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("static")
    return {family: build_tiny_model(root / family, family, initializer_range=0.2) for family in FAMILIES}


def trained_engine(directory: str, dtype: str) -> Engine:
    """Two snapshots: "a" adapts every target (a MoE model's 3-D expert tensors included), "b" attention and lm_head."""
    engine = Engine(directory, dtype=dtype)
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        engine.create_session(name, LoraConfig(rank=8, alpha=16, seed=len(name), train_mlp=name == "a"))
        batch = [cross_entropy_datum(rng.integers(5, 500, 24).tolist()) for _ in range(2)]
        engine.forward_backward(name, batch, "cross_entropy")
        engine.optim_step(name, AdamParams(learning_rate=1e-2))  # B is no longer zero: the deltas count
        engine.snapshot_sampler(name, name)
    return engine


def jobs(engine: Engine, requests=REQUESTS) -> list[SampleJob]:
    made = []
    for seed, (snapshot, samples, max_tokens, length) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, seed=seed)
        prompt = ModelInput.from_ints([(7 * seed + 3 * j) % 400 + 5 for j in range(length)])
        request = prepare_sample(
            prompt, samples, params, 0, max_seq_len=engine.max_seq_len, vocab_size=engine.vocab_size
        )
        adapter = engine.samplers.adapter(snapshot) if snapshot else None
        made.append(SampleJob(adapter, request, samples, params, frozenset({engine._host.eos_token_id})))
    return made


def decode(
    engine: Engine, batch, requests=REQUESTS, join_at: int = 3, buckets: list | None = None
) -> list[list[tuple[list[int], list[float]]]]:
    """Run the requests through `batch` (the last two joining at step `join_at`); each row's tokens and logprobs.
    `buckets`: gets each step's (rows, capacity) of a `SlotBatch`."""
    made = jobs(engine, requests)
    with engine.device, torch.no_grad():
        batch.admit(made[:2])
        steps = 0
        while len(batch):
            if buckets is not None:
                buckets.append((batch._cache.rows, batch._cache.capacity))
            batch.step()
            steps += 1
            if steps == join_at:
                batch.admit(made[2:])
    return [[(s.tokens, s.logprobs) for s in job.sequences] for job in made]


def takes_static(engine: Engine) -> bool:
    return engine.profile.static_decode.startswith("yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_step_traces_as_one_graph_while_rows_join_and_leave(family, dtype, family_dirs):
    engine = trained_engine(family_dirs[family], dtype)
    try:
        assert takes_static(engine), engine.profile.static_decode
        eager = decode(engine, SlotBatch(engine._bank, engine._host))
        torch._dynamo.reset()
        counters.clear()
        traced_batch = SlotBatch(engine._bank, engine._host, compile="eager")
        traced = decode(engine, traced_batch)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert not traced_batch.rows and int(traced_batch._lengths.max()) == 0  # every row ended, its slot freed
        # Both snapshots decoded in the table's slots (none beside, on the dynamic path), expert weights included.
        assert set(traced_batch.table.names) == {engine.samplers.adapter("a"), engine.samplers.adapter("b")}
        expert_slots = traced_batch.table.experts.held
        assert list(expert_slots.values()) == ([engine.samplers.adapter("a")] if engine._host.targets.experts else [])
        assert all(len(rows) for rows in traced)
        assert traced == eager
        if dtype == "float32":  # the dynamic path draws the same tokens; logprobs agree to rounding
            dynamic = decode(engine, DecodeBatch(engine._bank, engine._host))
            for static_rows, dynamic_rows in zip(eager, dynamic):
                for (tokens, logprobs), (want_tokens, want_logprobs) in zip(static_rows, dynamic_rows):
                    assert tokens == want_tokens
                    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
    finally:
        engine.close()


def test_a_model_without_the_path_is_refused_by_name_and_auto_takes_the_dynamic_path(family_dirs):
    # Every family takes the path (the test above); a model whose decode step does not run on slots says why in its
    # profile, which the scheduler names when the static path is asked for.
    engine = Engine(family_dirs["llama"])
    try:
        why = "no: its decode step does not run on slots (AttributeError: ...)"
        with pytest.raises(ValueError, match=r"sampler_decode static: .*llama.*does not run on slots"):
            decode_batch(engine._bank, engine._host, "static", why)
        assert isinstance(decode_batch(engine._bank, engine._host, "auto", why), DecodeBatch)
        assert isinstance(decode_batch(engine._bank, engine._host, "static", engine.profile.static_decode), SlotBatch)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "falcon_h1", "nemotron_h"])
def test_a_row_computes_the_same_numbers_alone_and_in_any_bucket(family, family_dirs):
    # CPU batch invariance on the static path: the same seeded request alone (8-row bucket, 64 positions) and beside
    # 12 other rows and a long prompt (16 rows, 128 positions) gives bit-identical tokens and logprobs.
    engine = trained_engine(family_dirs[family], "float32")
    try:
        alone = decode(engine, SlotBatch(engine._bank, engine._host), [REQUESTS[2]] + [("a", 1, 1, 3)], join_at=99)
        crowd = [REQUESTS[2], ("a", 1, 1, 3), ("b", 6, 30, 40), (None, 6, 9, 80)]
        batched = decode(engine, SlotBatch(engine._bank, engine._host), crowd, join_at=1)
        assert batched[0] == alone[0]
    finally:
        engine.close()


def test_rows_beyond_the_adapter_slots_decode_beside_on_the_dynamic_path(family_dirs):
    engine = trained_engine(family_dirs["llama"], "float32")
    try:
        batch = SlotBatch(engine._bank, engine._host, slots=1)  # "a" takes the one slot; "b" cannot join the table
        both = decode(engine, batch, join_at=1)
        assert set(batch.table.names) == {engine.samplers.adapter("a")}
        dynamic = decode(engine, DecodeBatch(engine._bank, engine._host), join_at=1)
        assert [[t for t, _ in rows] for rows in both] == [[t for t, _ in rows] for rows in dynamic]
    finally:
        engine.close()


def test_a_later_round_in_the_same_bucket_replays_on_the_same_buffers(family_dirs):
    # A captured graph replays on its inputs' addresses: an emptied batch keeps its bucket's buffers, so the next
    # round in that bucket neither traces again nor (on a GPU) re-records the graph. Nemotron-H: KV and recurrent
    # states both; the second round's rows take slots whose states the first left behind.
    engine = trained_engine(family_dirs["nemotron_h"], "float32")
    try:
        torch._dynamo.reset()
        counters.clear()
        batch = SlotBatch(engine._bank, engine._host, compile="eager")
        first = decode(engine, batch)

        def addresses() -> list[int]:
            cache = batch._cache
            buffers = (*cache.keys.values(), *cache.conv.values(), *cache.recurrent.values())
            return [t.data_ptr() for t in (batch._tokens, batch._lengths, *buffers)]

        kept = addresses()
        assert batch._cache.keys and batch._cache.conv and batch._cache.recurrent
        second = decode(engine, batch)
        assert second == first and counters["stats"]["unique_graphs"] == 1
        assert addresses() == kept
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "llama4"])  # llama4: expert adapters at the fixed rank too
def test_the_deterministic_mode_runs_every_step_in_its_one_bucket(family, family_dirs):
    # --sampler_deterministic_rows: whatever joins or leaves, every step runs the fixed bucket's rows and positions (on
    # a GPU what keeps a row's kernels, and so its numbers, its own), traced as one graph; a seeded request gives the
    # same tokens and logprobs alone and beside 14 rows; LoRA rows take the per-slot product (`LoraTable.fixed_rank`),
    # equal to the default table's to rounding. Through the scheduler, jobs whose rows the bucket's free slots cannot
    # hold wait for them (`SlotBatch.room`) rather than decode beside on the dynamic path (equal only to rounding).
    engine = trained_engine(family_dirs[family], "float32")
    try:
        fixed = fixed_bucket(13, 16 * 128 + 100, engine.max_seq_len)
        assert fixed == (16, 128)
        torch._dynamo.reset()
        counters.clear()
        batch = SlotBatch(engine._bank, engine._host, compile="eager", fixed=fixed)
        buckets: list = []
        alone = decode(engine, batch, [REQUESTS[2], ("a", 1, 1, 3)], join_at=99, buckets=buckets)
        crowd = [REQUESTS[2], ("a", 1, 1, 3), ("b", 6, 30, 40), (None, 6, 9, 80)]
        batched = decode(engine, batch, crowd, join_at=1, buckets=buckets)
        assert len(buckets) == 20 + 30 - 1 and set(buckets) == {fixed}  # alone: (8, 64) without the mode
        assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}
        assert batched[0] == alone[0] and batched[0][0][0]
        # The tables never grow: a product's shapes stay the same (llama4: its expert adapters' too).
        assert (batch.table.rank, batch.table.experts.rank) == (FIXED_RANK, FIXED_RANK if family == "llama4" else 0)
        default = decode(engine, SlotBatch(engine._bank, engine._host), crowd, join_at=1)
        for rows, want in zip(batched, default):
            for (tokens, logprobs), (want_tokens, want_logprobs) in zip(rows, want):
                assert tokens == want_tokens
                np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)

        # 12 rows for 8 slots, 70-80 positions each: past one block of keys, where the dynamic path's sums differ.
        requests = [("a", 4, 30, 40), (None, 4, 30, 50), ("b", 4, 30, 45)]
        scheduler = SampleScheduler(
            engine._bank,
            engine._host,
            engine.device,
            max_batch_tokens=8 * 128,
            decode="static",
            static_decode=engine.profile.static_decode,
            deterministic_rows=8,
        )
        try:
            with engine.device:  # the scheduler's first round sees every job
                answers = [scheduler.sample(job) for job in jobs(engine, requests)]
            got = [[(s.tokens, s.logprobs) for s in answer.result(timeout=120).sequences] for answer in answers]
            assert isinstance(scheduler._batch, SlotBatch) and list(scheduler._batch._buckets) == [(8, 128)]
        finally:
            scheduler.close()
        assert got == decode(engine, SlotBatch(engine._bank, engine._host, fixed=(16, 128)), requests, join_at=1)
        # On a CPU every path is batch-invariant: the mode leaves `auto`'s dynamic path there.
        assert isinstance(decode_batch(engine._bank, engine._host, "auto", "yes", fixed=(8, 64)), DecodeBatch)
    finally:
        engine.close()
