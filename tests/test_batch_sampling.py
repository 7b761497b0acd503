"""Batched sampling on the tiny model, at engine level: the decode loop and the scheduler that shares each
decode step among every pending request (mixed adapters, per-row parameters and RNG, shared prefill,
continuous batching, fair turns with training)."""

import threading

import numpy as np
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from treadle.errors import SampleCancelledError
from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.hf import batch_decode
from treadle.gpu_worker.sampling.backend import LogprobJob, SampleJob
from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.extras import SampleExtras
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from treadle.gpu_worker.sampling.hf.token_choice import processed_logprobs
from treadle.gpu_worker.training.validation import prepare_sample
from treadle.types import LoraConfig, ModelInput, SamplingParams

ADAPTERS = ["one", "two", "three"]
WAIT = 60  # seconds; every wait in these tests has this bound


@pytest.fixture(scope="module")
def bank(tiny_model_dir) -> AdapterBank:
    """Three adapters with random (non-zero) B matrices, so each one changes the model's outputs."""
    return bank_of(tiny_model_dir, [(name, 4) for name in ADAPTERS])


def bank_of(model_dir: str, adapters: list[tuple[str, int]]) -> AdapterBank:
    """A bank with the adapters (name, rank), each with random B matrices (seeded by its place in the list)."""
    bank = AdapterBank(ModelHost(model_dir))
    for seed, (name, rank) in enumerate(adapters):
        bank.add(name, bank.lora_config(LoraConfig(rank=rank, alpha=8)), seed=seed)
        generator = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for key, param in bank.parameters(name).items():
                if "lora_B" in key:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return bank


@pytest.fixture
def scheduler(bank):
    scheduler = SampleScheduler(bank, bank.host, DeviceLock())
    yield scheduler
    scheduler.close()


class StepCounter:
    """Counts decode-loop forwards (prefills and steps) and the rows and distinct adapters of each, at
    `batch_decode.forward_rows`, the one door every sampling forward goes through."""

    def __init__(self, bank: AdapterBank):
        self.calls: list[tuple[int, frozenset]] = []
        self._original = batch_decode.forward_rows

        def counted(bank, adapters, **inputs):
            names = {"__base__" if a is None else a for a in adapters}
            self.calls.append((len(adapters), frozenset(names) if len(names) > 1 else frozenset()))
            return self._original(bank, adapters, **inputs)

        batch_decode.forward_rows = counted

    def close(self):
        batch_decode.forward_rows = self._original


def job(bank, prompt, adapter=None, num_samples=2, **params) -> SampleJob:
    host = bank.host
    sampling = SamplingParams(**params)
    request = prepare_sample(
        ModelInput.from_ints(prompt), num_samples, sampling, 0, max_seq_len=host.max_seq_len, vocab_size=host.vocab_size
    )
    return SampleJob(adapter, request, num_samples, sampling, frozenset({host.eos_token_id, *request.stop_token_ids}))


def submit_together(scheduler, jobs) -> list:
    """Queue every job while holding the device, so all are admitted before the first decode step."""
    with scheduler.device_lock:
        futures = [scheduler.sample(j) for j in jobs]
    return [f.result(timeout=WAIT) for f in futures]


def forward_logprobs(bank, adapter, prompt, tokens) -> np.ndarray:
    ids = torch.tensor([*prompt, *tokens]).unsqueeze(0)
    with bank.using(adapter, trainable=False) as model, torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return lp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).numpy()


PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 101], [200, 201, 202, 203, 204, 205]]


def test_mixed_adapter_batch_logprobs_equal_forward(bank, scheduler):
    counter = StepCounter(bank)
    try:
        adapters = [*ADAPTERS, None]
        jobs = [
            job(bank, p, a, num_samples=3, max_tokens=10 + i, seed=i) for i, (p, a) in enumerate(zip(PROMPTS, adapters))
        ]
        responses = submit_together(scheduler, jobs)
    finally:
        counter.close()
    everyone = {*ADAPTERS, "__base__"}
    # Each request's prompt was prefilled once, one row per request (4, not 12), in one mixed forward;
    # then the decode steps ran all 12 rows, with the three adapters and the base model, together.
    assert counter.calls[0] == (4, everyone) and counter.calls[1] == (12, everyone)
    for j, response in zip(jobs, responses):
        assert len(response.sequences) == 3
        for seq in response.sequences:
            expected = forward_logprobs(bank, j.adapter, j.request.prompt.tolist(), seq.tokens)
            np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)
    # The adapters matter: the same tokens score differently under another adapter.
    seq = responses[0].sequences[0]
    other = forward_logprobs(bank, "two", PROMPTS[0], seq.tokens)
    assert np.abs(np.asarray(seq.logprobs) - other).max() > 1e-2


def test_mixed_steps_by_runs_equal_split_forwards_bitwise(bank, scheduler, monkeypatch):
    # The same mixed requests through mixed_lora (every adapter's delta in one grouped product) and through
    # one forward per adapter run on its slice of the cache, each PEFT's own single-adapter forward (the
    # path of expert adapters): the same tokens and logprobs to the bit.
    def run():
        jobs = [
            job(bank, p, a, num_samples=3, max_tokens=8, seed=i)
            for i, (p, a) in enumerate(zip(PROMPTS, [*ADAPTERS, None]))
        ]
        return [[(s.tokens, s.logprobs) for s in r.sequences] for r in submit_together(scheduler, jobs)]

    by_runs = run()
    monkeypatch.setattr(batch_decode, "stacks_for", lambda bank, names: None)
    assert run() == by_runs


def test_adapters_off(bank):
    ids = torch.tensor([PROMPTS[1]])
    with bank.using("one", trainable=True) as model, torch.no_grad():
        adapted = model(input_ids=ids).logits
        with bank.adapters_off():
            base = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
        still_trainable = all(p.requires_grad for p in bank.parameters("one").values())
    with bank.using(None, trainable=False) as model, torch.no_grad():
        via_using = model(input_ids=ids).logits
    with torch.no_grad(), bank.peft_model.disable_adapter():  # PEFT's own way
        peft_base = bank.peft_model(input_ids=ids).logits
    assert torch.equal(base, peft_base) and torch.equal(base, via_using)
    assert torch.equal(adapted, again) and not torch.equal(base, adapted) and still_trainable
    with bank.using(
        "one", trainable=False
    ):  # PEFT's disable_adapter left it trainable: frozen again for the other tests
        assert not any(p.requires_grad for p in bank.parameters("one").values())


def test_stop_strings_ids_and_max_tokens_per_row(bank, scheduler):
    prompt = PROMPTS[1]
    (greedy,) = submit_together(scheduler, [job(bank, prompt, "one", num_samples=1, max_tokens=12, temperature=0)])
    ref = greedy.sequences[0].tokens
    assert greedy.sequences[0].logprobs == [0.0] * len(ref)  # greedy is a point mass
    tokenizer = bank.host.tokenizer
    stop_id = ref[4]
    stop_text = tokenizer.decode(ref[6:8])
    jobs = [
        job(bank, prompt, "one", num_samples=1, max_tokens=12, temperature=0, stop=[stop_id]),
        job(bank, prompt, "one", num_samples=1, max_tokens=12, temperature=0, stop=stop_text),
        job(bank, prompt, "one", num_samples=1, max_tokens=3, temperature=0),
        job(bank, PROMPTS[0], "two", num_samples=2, max_tokens=7, seed=3),
    ]
    by_id, by_string, by_length, other = submit_together(scheduler, jobs)
    first_id = ref.index(stop_id) + 1
    assert by_id.sequences[0].tokens == ref[:first_id] and by_id.sequences[0].stop_reason == "stop"
    first_text = next(k for k in range(1, len(ref) + 1) if stop_text in tokenizer.decode(ref[:k]))
    assert by_string.sequences[0].tokens == ref[:first_text] and by_string.sequences[0].stop_reason == "stop"
    assert by_length.sequences[0].tokens == ref[:3] and by_length.sequences[0].stop_reason == "length"
    for seq in other.sequences:
        assert (len(seq.tokens) == 7 and seq.stop_reason == "length") or seq.tokens[-1] == bank.host.eos_token_id


def test_same_seeds_same_order_same_tokens(bank, scheduler):
    def run():
        jobs = [
            job(bank, PROMPTS[0], "one", num_samples=3, max_tokens=9, seed=1),
            job(bank, PROMPTS[1], None, num_samples=2, max_tokens=6, seed=2, temperature=0.7, top_k=20),
            job(bank, PROMPTS[2], "three", num_samples=4, max_tokens=8, seed=3, top_p=0.8),
        ]
        return [[(s.tokens, s.logprobs) for s in r.sequences] for r in submit_together(scheduler, jobs)]

    first, second = run(), run()
    assert first == second
    assert first[0][0] != first[0][1]  # the rows of one request are different draws


@pytest.mark.parametrize("threads", [1, 2])
def test_lone_seeded_request_is_reproducible_and_independent_of_the_batch(bank, scheduler, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # more threads split kernels differently: the result must not move
    try:
        lone = [
            scheduler.sample(job(bank, PROMPTS[3], "two", num_samples=2, max_tokens=10, seed=7)).result(timeout=WAIT)
            for _ in range(3)
        ]
        drawn = [[(s.tokens, s.logprobs) for s in r.sequences] for r in lone]
        assert drawn[0] == drawn[1] == drawn[2]
        # Its own RNG and batch-invariant forwards: sharing the prefill and the decode steps with other
        # requests (other adapters, other paddings) leaves its tokens and logprobs as they were, bit for bit.
        crowd = [
            job(bank, p, a, num_samples=3, max_tokens=12, seed=50 + i)
            for i, (p, a) in enumerate(zip(PROMPTS, ADAPTERS))
        ]
        _, _, _, batched = submit_together(
            scheduler, [*crowd, job(bank, PROMPTS[3], "two", num_samples=2, max_tokens=10, seed=7)]
        )
        assert [(s.tokens, s.logprobs) for s in batched.sequences] == drawn[0]
        # Joining a batch that is already decoding (its cache padded to the batch's width) changes nothing either.
        running = scheduler.sample(job(bank, PROMPTS[1], None, num_samples=5, max_tokens=40, seed=1, stop=[]))
        _wait_until_decoding(scheduler)
        joined = scheduler.sample(job(bank, PROMPTS[3], "two", num_samples=2, max_tokens=10, seed=7)).result(
            timeout=WAIT
        )
        assert not running.done()
        assert [(s.tokens, s.logprobs) for s in joined.sequences] == drawn[0]
        running.result(timeout=WAIT)
    finally:
        torch.set_num_threads(previous)


def _wait_until_decoding(scheduler) -> None:
    """Until the scheduler's batch has rows (bounded by WAIT)."""
    _wait_for(lambda: len(scheduler._batch) > 0)


def test_batched_compute_logprobs_equal_unbatched(bank, scheduler):
    cases = [
        (PROMPTS[0], "one", 0),
        (PROMPTS[1], None, 3),
        (PROMPTS[2], "three", 0),
        (PROMPTS[3], "two", 2),
        ([9], "one", 2),
    ]
    alone = [scheduler.compute_logprobs(LogprobJob(a, np.array(p), k)).result(timeout=WAIT) for p, a, k in cases]
    with scheduler.device_lock:
        futures = [scheduler.compute_logprobs(LogprobJob(a, np.array(p), k)) for p, a, k in cases]
    together = [f.result(timeout=WAIT) for f in futures]
    for (prompt, adapter, topk), (lp1, top1), (lp2, top2) in zip(cases, alone, together):
        assert lp1[0] is None and lp2[0] is None and len(lp1) == len(prompt)
        assert lp1 == lp2  # batch-invariant forwards: bit for bit, not only within 1e-5
        if len(prompt) > 1:
            np.testing.assert_allclose(lp2[1:], forward_logprobs(bank, adapter, prompt[:1], prompt[1:]), atol=1e-5)
        if topk:
            assert top1[0] is None and all(len(t) == topk for t in top2[1:])
            for a, b in zip(top1[1:], top2[1:]):
                assert [i for i, _ in a] == [i for i, _ in b]
                assert a == b
        else:
            assert top1 is None and top2 is None


def test_prompt_logprobs_with_a_sample_come_from_its_prefill(bank, scheduler):
    j = job(bank, PROMPTS[1], "three", num_samples=2, max_tokens=4, seed=0)
    j.include_prompt_logprobs, j.topk_prompt_logprobs = True, 2
    response = scheduler.sample(j).result(timeout=WAIT)
    expected, topk = scheduler.compute_logprobs(LogprobJob("three", np.array(PROMPTS[1]), 2)).result(timeout=WAIT)
    np.testing.assert_allclose(response.prompt_logprobs[1:], expected[1:], atol=1e-5)
    assert [[i for i, _ in t] for t in response.topk_prompt_logprobs[1:]] == [[i for i, _ in t] for t in topk[1:]]


def _full_logprobs(bank, adapter, tokens) -> torch.Tensor:
    """log_softmax of the adapter's forward: row t is the distribution over tokens[t + 1]."""
    with bank.using(adapter, trainable=False) as model, torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_prompt_and_sample_side_logprob_options_match_the_forward_alone_and_batched(bank, scheduler):
    prompt = PROMPTS[1]
    targets = np.full((len(prompt) - 1, 3), -1)
    targets[:, 0] = prompt[1:]  # each position's own next token: its prompt logprob
    targets[2, 1:] = [7, 300]

    def extras_job(**extras):
        j = job(bank, prompt, "two", num_samples=2, max_tokens=6, seed=3)
        j.extras = SampleExtras(**extras)
        return j

    asked = dict(topk_sample_logprobs=4, target_ids=targets, prompt_alt_tokens_k=3)
    alone = scheduler.sample(extras_job(**asked)).result(timeout=WAIT)
    full = _full_logprobs(bank, "two", prompt)[:-1]
    scored = alone.target_prompt_logprobs.to_numpy()
    assert scored.shape == targets.shape and scored.dtype == np.float32
    np.testing.assert_allclose(scored[:, 0], forward_logprobs(bank, "two", prompt[:1], prompt[1:]), atol=1e-5)
    np.testing.assert_allclose(scored[2, 1:], full[2, [7, 300]].numpy(), atol=1e-5)
    assert (scored[targets < 0] == 0.0).all()
    drawn, drawn_lp = alone.prompt_alt_tokens.tokens.to_numpy(), alone.prompt_alt_tokens.logprobs.to_numpy()
    assert drawn.shape == drawn_lp.shape == (len(prompt) - 1, 3) and drawn.dtype == np.int64
    np.testing.assert_allclose(drawn_lp, full.gather(1, torch.from_numpy(drawn)).numpy(), atol=1e-5)
    for seq in alone.sequences:  # T=1, no top-k/p: the distribution sampled from is the model's own
        after = _full_logprobs(bank, "two", [*prompt, *seq.tokens])[len(prompt) - 1 : -1]
        values, ids = after.topk(4, dim=-1)
        assert len(seq.topk_logprobs) == len(seq.tokens)
        assert [[t for t, _ in row] for row in seq.topk_logprobs] == ids.tolist()
        np.testing.assert_allclose([[v for _, v in row] for row in seq.topk_logprobs], values.numpy(), atol=1e-5)
    # Asking for them leaves the tokens sampled for the seed as they were.
    plain = scheduler.sample(extras_job()).result(timeout=WAIT)
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in alone.sequences]
    assert plain.target_prompt_logprobs is None and plain.prompt_alt_tokens is None
    assert all(s.topk_logprobs is None for s in plain.sequences)
    # Batched with other requests: the same numbers, bit for bit.
    crowd = [
        job(bank, p, a, num_samples=2, max_tokens=8, seed=20 + i) for i, (p, a) in enumerate(zip(PROMPTS, ADAPTERS))
    ]
    *_, batched = submit_together(scheduler, [*crowd, extras_job(**asked)])
    assert batched.model_dump() == alone.model_dump()
    # Greedy: every draw is the argmax, and the sampled distribution is a point mass (one top entry).
    greedy = job(bank, prompt, None, num_samples=1, max_tokens=3, temperature=0)
    greedy.extras = SampleExtras(topk_sample_logprobs=5, prompt_alt_tokens_k=2)
    got = scheduler.sample(greedy).result(timeout=WAIT)
    argmax = _full_logprobs(bank, None, prompt)[:-1].argmax(dim=-1)
    assert (got.prompt_alt_tokens.tokens.to_numpy() == argmax.unsqueeze(1).numpy()).all()
    assert got.sequences[0].topk_logprobs == [[(t, 0.0)] for t in got.sequences[0].tokens]


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.6), (0.5, 40, 0.9), (0.0, -1, 1.0)]
)
def test_processed_logprobs_match_hf_warpers_per_row(temperature, top_k, top_p):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    # Row 1 uses the parameters under test; rows 0 and 2 keep the defaults and must stay untouched.
    out = processed_logprobs(logits, [1.0, temperature, 1.0], [-1, top_k, -1], [1.0, top_p, 1.0])
    scores = logits[1:2].clone()
    warpers = (
        [TopKLogitsWarper(1)]
        if temperature == 0
        else [
            *([TemperatureLogitsWarper(temperature)] if temperature != 1 else []),
            *([TopKLogitsWarper(top_k)] if top_k > 0 else []),
            *([TopPLogitsWarper(top_p)] if top_p < 1 else []),
        ]
    )
    for warper in warpers:
        scores = warper(None, scores)
    torch.testing.assert_close(out[1], torch.log_softmax(scores, dim=-1)[0])
    torch.testing.assert_close(out[[0, 2]], torch.log_softmax(logits[[0, 2]], dim=-1))


def test_rows_join_at_step_boundaries_and_training_waits_one_step(bank, scheduler):
    counter = StepCounter(bank)
    try:
        # Greedy on this prompt never meets EOS within 300 tokens (checked below): it runs to its length.
        long = scheduler.sample(job(bank, PROMPTS[0], "one", num_samples=2, max_tokens=300, temperature=0))
        _wait_for(lambda: len(counter.calls) >= 3)
        short = scheduler.sample(job(bank, PROMPTS[1], "two", num_samples=1, max_tokens=3, seed=0))
        short.result(timeout=WAIT)
        assert not long.done()  # it joined the running batch instead of waiting for it to end
        # A "training op" asks for the device mid-batch: at most the step in progress runs before it.
        before = len(counter.calls)
        with scheduler.device_lock:
            during = len(counter.calls)
        assert during - before <= 1
        assert all(s.stop_reason == "length" for s in long.result(timeout=WAIT).sequences)
    finally:
        counter.close()


def test_token_budget_keeps_big_requests_apart(bank):
    scheduler = SampleScheduler(bank, bank.host, DeviceLock(), max_batch_tokens=100)
    counter = StepCounter(bank)
    try:
        # Each request projects 3 rows x (9 + 20) = 87 positions: two together would exceed 100.
        responses = submit_together(
            scheduler, [job(bank, PROMPTS[1], a, num_samples=3, max_tokens=20, seed=0, stop=[]) for a in ("one", "two")]
        )
    finally:
        counter.close()
        scheduler.close()
    assert all(len(names) <= 1 for _, names in counter.calls) and max(rows for rows, _ in counter.calls) == 3
    assert all(len(s.tokens) == 20 or s.stop_reason == "stop" for r in responses for s in r.sequences)


def _wait_for(condition, timeout: float = WAIT) -> None:
    done = threading.Event()
    for _ in range(int(timeout * 100)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached within the bound")


class CancelAfter:
    """A streamed request's `TokenStream` whose client goes away once `after` tokens have been drawn."""

    def __init__(self, after: int):
        self.after = after
        self.drawn: list[tuple[int, int]] = []
        self.ended: tuple[list[int], int] | None = None

    def drew(self, row, token, logprob, top):
        self.drawn.append((row, token))

    @property
    def cancelled(self) -> bool:
        return len(self.drawn) >= self.after

    def dropped(self, tokens, rows_left):
        self.ended = (tokens, rows_left)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_cancelled_stream_leaves_the_batch_and_the_others_go_on(bank, decode):
    scheduler = SampleScheduler(bank, bank.host, DeviceLock(), decode=decode)
    try:
        other = dict(adapter="two", num_samples=1, max_tokens=30, temperature=0)
        (alone,) = submit_together(scheduler, [job(bank, PROMPTS[1], **other)])
        assert len(alone.sequences[0].tokens) == 30  # (so it is still running when the stream is cancelled)
        streamed = job(bank, PROMPTS[0], "one", num_samples=2, max_tokens=200, seed=1)
        streamed.stream = stream = CancelAfter(6)  # the prefill draws 2 tokens, each step 2 more
        waiting = job(bank, PROMPTS[2], "three", num_samples=1, max_tokens=5)
        waiting.stream = gone = CancelAfter(0)  # its client left before its first round
        with scheduler.device_lock:
            futures = [scheduler.sample(j) for j in (streamed, job(bank, PROMPTS[1], **other), waiting)]
        with pytest.raises(SampleCancelledError, match="cancelled it after 3 tokens") as after:
            futures[0].result(timeout=WAIT)
        with pytest.raises(SampleCancelledError, match="before it started") as before:
            futures[2].result(timeout=WAIT)
        assert (after.value.sampled_tokens, before.value.sampled_tokens) == (6, None)  # what the owner is billed
        assert gone.drawn == [] and gone.ended is not None and gone.ended[0] == [0]
        assert stream.ended == ([3, 3], 1)  # each row's tokens when dropped; the other request's row goes on
        assert [row for row, _ in stream.drawn] == [0, 1] * 3  # every token reached the stream as it was drawn
        assert futures[1].result(timeout=WAIT).sequences == alone.sequences  # untouched by the rows leaving
        assert len(scheduler._batch) == 0
    finally:
        scheduler.close()
