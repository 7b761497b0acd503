"""Shared prefixes computed once (`sampling/hf/prefix_cache.py`): a prompt that starts with tokens already run on
the same snapshot resumes from their kept KV, and a seeded request gives the same tokens and logprobs, bit for
bit, as without reuse. Through the SDK against two workers on the same weights, one with reuse and one without
(`--sampling_prefix_cache_tokens 0`), read from their Prometheus metrics; and in-process at the attention, the
forward and the scheduler."""

from __future__ import annotations

import os
import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.test_batch_sampling import WAIT, bank_of, job, submit_together
from tests.test_grouped_sampling import ATTENTION_VARIANTS, attention_case
from treadle import AdamParams, Datum, ModelInput, SamplingParams
from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.hf import cache_rows, prefix_cache, row_invariant
from treadle.gpu_worker.sampling.hf.batch_decode import forward_rows
from treadle.gpu_worker.sampling.hf.prefix_cache import PrefixCache
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from treadle.local_stack import LocalStack, free_port
from treadle.testing.tiny_model import build_tiny_model

ON, OFF = "tiny", "tiny-off"  # the same weights, served by a worker with reuse and by one without
RNG = np.random.default_rng(0)


def tokens(n: int) -> list[int]:
    return RNG.integers(5, 500, n).tolist()


# ------------------------------------------------------------ through the stack


@pytest.fixture(scope="module")
def reuse_stack(tiny_model_dir, tmp_path_factory):
    os.environ["OMP_NUM_THREADS"] = "1"  # bitwise comparable across the two worker processes
    stack = LocalStack([], home=str(tmp_path_factory.mktemp("prefix")), workers=0)
    stack.start()
    ports = {ON: free_port(), OFF: free_port()}
    try:
        stack.start_worker(["--model", f"{ON}={tiny_model_dir}", "--metrics_port", str(ports[ON])])
        stack.start_worker(
            ["--model", f"{OFF}={tiny_model_dir}", "--metrics_port", str(ports[OFF])]
            + ["--sampling_prefix_cache_tokens", "0"]
        )
        stack.wait_for_workers(2, 180)
        from treadle import ServiceClient

        yield ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url), ports
    finally:
        stack.stop()


def counts(port: int, model: str) -> tuple[float, float]:
    """(prompt tokens prefilled, prompt tokens served from kept KV) so far, from the worker's metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("base_model") == model
    }
    return (
        found.get("treadle_sampler_prefill_tokens_total", 0.0),
        found.get("treadle_sampler_prefix_reused_tokens_total", 0.0),
    )


def drawn(response) -> list[tuple[list[int], list[float]]]:
    return [(s.tokens, s.logprobs) for s in response.sequences]


def test_a_conversation_prefills_only_what_each_turn_adds(reuse_stack):
    service, ports = reuse_stack
    before = {model: counts(ports[model], model) for model in (ON, OFF)}
    turns, first = {}, tokens(40)
    for model in (ON, OFF):
        sampler = service.create_sampling_client(base_model=model)
        prompt, rng, turns[model] = first, np.random.default_rng(1), []
        for turn in range(4):
            params = SamplingParams(max_tokens=24, seed=turn)
            answer = sampler.sample(ModelInput.from_ints(prompt), 1, params).result(timeout=WAIT)
            turns[model].append(drawn(answer))
            # The next turn: this prompt, its answer and a new user message.
            prompt = prompt + answer.sequences[0].tokens + rng.integers(5, 500, 15).tolist()
    assert turns[ON] == turns[OFF]  # bit for bit: tokens and logprobs
    prefilled, reused = (after - first for after, first in zip(counts(ports[ON], ON), before[ON]))
    whole, none_reused = (after - first for after, first in zip(counts(ports[OFF], OFF), before[OFF]))
    assert none_reused == 0 and prefilled + reused == whole  # every prompt token counted once
    assert prefilled <= 0.35 * whole, (prefilled, whole)


def test_a_group_sent_one_by_one_or_at_once_prefills_its_prompt_once(reuse_stack):
    service, ports = reuse_stack
    training = service.create_lora_training_client(ON, rank=4, seed=0)
    datum = Datum(
        model_input=ModelInput.from_ints(list(range(20, 30))),
        loss_fn_inputs={"target_tokens": list(range(21, 31)), "weights": [1.0] * 10},
    )
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(AdamParams(learning_rate=5e-3)).result(timeout=WAIT)
    snapshot = training.save_weights_and_get_sampling_client()
    group = [SamplingParams(max_tokens=12, seed=seed) for seed in range(4)]

    prompt = tokens(50)
    start = counts(ports[ON], ON)
    one_by_one = [drawn(snapshot.sample(ModelInput.from_ints(prompt), 1, p).result(timeout=WAIT)) for p in group]
    after_one_by_one = counts(ports[ON], ON)
    assert after_one_by_one[0] - start[0] == len(prompt)
    assert after_one_by_one[1] - start[1] == 3 * len(prompt)
    # The same group again, at once and all from kept KV: what the first (prefilled) request drew, bit for bit.
    futures = [snapshot.sample(ModelInput.from_ints(prompt), 1, p) for p in group]
    assert [drawn(f.result(timeout=WAIT)) for f in futures] == one_by_one
    assert counts(ports[ON], ON)[0] == after_one_by_one[0]

    other = tokens(45)
    futures = [snapshot.sample(ModelInput.from_ints(other), 1, p) for p in group]
    [f.result(timeout=WAIT) for f in futures]
    assert counts(ports[ON], ON)[0] - after_one_by_one[0] == len(other)
    training.stop()


# ------------------------------------------------------------ in-process


@pytest.mark.parametrize("heads, kv_heads, dim, value_dim, variant", ATTENTION_VARIANTS)
@pytest.mark.parametrize("kept", [0, 9, 64, 70])
def test_prefill_attention_is_each_querys_decode_step_bitwise(heads, kv_heads, dim, value_dim, variant, kept):
    # Queries after `kept` keys (a suffix over kept KV; 0: a whole prompt), each equal to a decode step alone
    # over the keys up to its own: the arithmetic that makes a prefix's KV the same however it was computed.
    _, _, keys, values, _ = attention_case(heads, kv_heads, dim, value_dim, variant)
    variant = {"s_aux": torch.randn(heads)} if variant.get("s_aux") == "sink" else variant
    key, value = keys[-1][:, :, :130], values[-1][:, :, :130]  # 130 keys: past two blocks of 64
    query = torch.randn(1, heads, 130 - kept, dim, generator=torch.Generator().manual_seed(1))
    prefill = row_invariant._rows_attention(None, query, key, value, None, 0.125, row_runs=[(0, 1, 0)], **variant)[0]
    for q in range(query.shape[2]):
        own = kept + q
        alone = row_invariant._rows_attention(
            None,
            query[:, :, q : q + 1],
            key[:, :, : own + 1],
            value[:, :, : own + 1],
            None,
            0.125,
            row_starts=torch.zeros(1, dtype=torch.long),
            **variant,
        )[0]
        assert torch.equal(prefill[:, q], alone[:, 0]), f"query {q} after {kept} kept keys"


@pytest.fixture(scope="module")
def bank(tiny_model_dir):
    return bank_of(tiny_model_dir, [("one", 4)])


def test_kv_of_decode_steps_and_of_a_suffix_prefill_equal_a_whole_prefill_bitwise(bank):
    config, prompt = bank.host.model.config, tokens(90)

    def run(ids, past=None, start=0):
        n = ids.shape[1]
        return forward_rows(
            bank,
            ["one"],
            input_ids=ids,
            attention_mask=torch.ones((1, start + n), dtype=torch.long),
            position_ids=torch.arange(start, start + n).unsqueeze(0),
            use_cache=True,
            cache=past if past is not None else cache_rows.new_cache(config),
        )

    whole = run(torch.tensor([prompt]))
    split = run(torch.tensor([prompt[:70]]))
    suffix = run(torch.tensor([prompt[70:]]), split.cache, 70)
    stepped = run(torch.tensor([prompt[:20]]))
    for at in range(20, 90):
        stepped = run(torch.tensor([[prompt[at]]]), stepped.cache, at)
    for other in (suffix, stepped):
        assert torch.equal(other.logits[0, -1], whole.logits[0, -1])
        for mine, theirs in zip(other.cache.layers, whole.cache.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def conversation(scheduler, bank, adapter) -> list:
    """Four turns (each prompt the last one, its answer and a new message), then a group of four requests of
    one prompt sent one by one and a group of four at once."""
    rng, answers = np.random.default_rng(2), []
    prompt = rng.integers(5, 500, 40).tolist()
    for turn in range(4):
        response = scheduler.sample(job(bank, prompt, adapter, num_samples=1, max_tokens=20, seed=turn)).result(
            timeout=WAIT
        )
        answers.append(drawn(response))
        prompt = prompt + response.sequences[0].tokens + rng.integers(5, 500, 12).tolist()
    group = rng.integers(5, 500, 30).tolist()
    for seed in range(4):
        response = scheduler.sample(job(bank, group, adapter, num_samples=1, max_tokens=8, seed=seed))
        answers.append(drawn(response.result(timeout=WAIT)))
    together = [job(bank, group + [7], adapter, num_samples=2, max_tokens=8, seed=seed) for seed in range(4)]
    answers += [drawn(r) for r in submit_together(scheduler, together)]
    return answers


@pytest.mark.parametrize("adapter", ["one", None])
def test_the_scheduler_gives_the_same_draws_with_and_without_reuse(bank, adapter, monkeypatch):
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(
        prefix_cache.SETTINGS, "observe", lambda model, prefilled, reused: seen.append((prefilled, reused))
    )
    results = {}
    for budget in (0, 16384):
        scheduler = SampleScheduler(bank, bank.host, DeviceLock(), prefix_cache_tokens=budget)
        try:
            results[budget] = conversation(scheduler, bank, adapter)
            kept = scheduler._batch.prefixes
            if budget:
                assert kept is not None and len(kept)
                # The adapter leaving the bank takes its kept KV with it.
                scheduler.when_unused(adapter, lambda: None)
                assert len(kept) == 0
        finally:
            scheduler.close()
    assert results[0] == results[16384]
    off, on = seen[: len(seen) // 2], seen[len(seen) // 2 :]
    assert [sum(c) for c in off] == [sum(c) for c in on]  # every prompt token counted once, either way
    assert on[5:8] == [(0, 30)] * 3  # the group sent one by one: its prompt prefilled once, then kept whole
    assert on[-1] == (1, 4 * 31 - 1)  # the group at once: one row, resumed from the kept prompt
    assert sum(p for p, _ in on[:4]) <= 0.35 * sum(p for p, _ in off[:4])


def test_the_cache_keeps_the_longest_sequences_within_its_budget():
    kv = lambda n: [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]  # noqa: E731
    cache = PrefixCache(budget=100)
    a = np.arange(40)
    cache.keep("x", a, kv(40), {40: torch.ones(3)})
    assert cache.longest("x", a)[1] == 40  # whole, with the logits after it: no forward
    assert cache.longest("x", a[:30])[1] == 29  # a prefix: all but its last token
    assert cache.longest("y", a)[1] == 0  # another snapshot's
    cache.keep("x", np.arange(60), kv(60), {})  # extends a: replaces it, keeping its logits
    assert len(cache) == 1 and cache.used == 60 and cache.longest("x", a)[1] == 40
    cache.keep("y", np.arange(30), kv(30), {})
    assert cache.longest("x", a)[1] == 40  # x's is used again: y's is now the least recently used
    cache.keep("x", np.arange(100, 120), kv(20), {})  # 110 > 100 positions: y's goes
    assert cache.used == 80 and cache.longest("y", np.arange(30))[1] == 0 and cache.longest("x", a)[1] == 40
    cache.keep("x", np.arange(200, 400), kv(200), {})  # larger than the budget: not kept
    assert cache.longest("x", np.arange(200, 400))[1] == 0
    cache.drop("x")
    assert len(cache) == 0 and cache.used == 0


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_models_that_cannot_resume_keep_nothing(family, tmp_path):
    host = ModelHost(build_tiny_model(tmp_path / family, arch=family, seed=0))
    assert prefix_cache.unresumable(host) is not None
    assert PrefixCache.for_model(host, 16384) is None
