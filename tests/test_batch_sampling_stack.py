"""Batched sampling through the real stack (SDK -> Redis/Celery -> worker scheduler): three sessions'
snapshots and the base model sampled at once, and a snapshot that stays frozen while its session trains."""

import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams
from tests.fixtures.stack import TINY

PROMPT = [5, 6, 7, 8, 9]
WAIT = 120


def train_steps(training, steps: int) -> None:
    datum = Datum(
        model_input=ModelInput.from_ints(list(range(20, 30))),
        loss_fn_inputs={"target_tokens": list(range(21, 31)), "weights": [1.0] * 10},
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(AdamParams(learning_rate=5e-3)).result(timeout=WAIT)


@pytest.fixture(scope="module")
def trained(stack):
    from treadle import ServiceClient

    service = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    sessions = [service.create_lora_training_client(TINY, rank=4, seed=i) for i in range(3)]
    for i, training in enumerate(sessions):
        train_steps(training, 2 + i)  # three different adapters
    yield service, sessions
    for training in sessions:
        training.stop()


def forward_logprobs(training, tokens: list[int]) -> np.ndarray:
    """The session's own teacher-forced logprobs of tokens[1:] (a plain forward, no sampling)."""
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    return training.forward([datum], "cross_entropy").result(timeout=WAIT).loss_fn_outputs[0]["logprobs"].to_numpy()


def test_three_snapshots_and_the_base_model_in_one_batch(trained):
    service, sessions = trained
    samplers = [t.save_weights_and_get_sampling_client() for t in sessions]
    base = service.create_sampling_client(base_model=TINY)
    futures = [
        s.sample(ModelInput.from_ints(PROMPT), 3, SamplingParams(max_tokens=8, seed=i))
        for i, s in enumerate([*samplers, base])
    ]
    responses = [f.result(timeout=WAIT) for f in futures]
    for training, response in zip(sessions, responses):
        for seq in response.sequences:
            # The snapshot equals the session right now (no training since): its forward scores the tokens.
            expected = forward_logprobs(training, PROMPT + seq.tokens)[len(PROMPT) - 1 :]
            np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)
    for seq in responses[3].sequences:
        expected = base.compute_logprobs(ModelInput.from_ints(PROMPT + seq.tokens)).result(timeout=WAIT)[len(PROMPT) :]
        np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)


def test_snapshot_stays_frozen_while_its_session_trains_on(trained):
    _, sessions = trained
    training = sessions[0]
    frozen = training.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=10, seed=11)
    before = frozen.sample(ModelInput.from_ints(PROMPT), 2, params).result(timeout=WAIT)
    train_steps(training, 5)
    live = training.save_weights_and_get_sampling_client()
    # Both snapshots in flight together: the old one's draws are unchanged, the new one differs.
    old_future = frozen.sample(ModelInput.from_ints(PROMPT), 2, params)
    new_future = live.sample(ModelInput.from_ints(PROMPT), 2, params)
    after, new = old_future.result(timeout=WAIT), new_future.result(timeout=WAIT)
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    np.testing.assert_allclose([s.logprobs for s in after.sequences], [s.logprobs for s in before.sequences], atol=1e-4)
    assert [s.logprobs for s in new.sequences] != [s.logprobs for s in before.sequences]


def test_stop_strings_ids_and_max_tokens_per_row_in_one_batch(trained):
    service, _ = trained
    base = service.create_sampling_client(base_model=TINY)
    tokenizer = base.get_tokenizer()
    greedy = SamplingParams(max_tokens=12, temperature=0, stop=[])
    ref = base.sample(ModelInput.from_ints(PROMPT), 1, greedy).result(timeout=WAIT).sequences[0].tokens
    assert len(ref) == 12  # the reference runs to its length (no EOS), so every cut below is the stop's
    stop_id, stop_text = ref[4], tokenizer.decode(ref[6:8])
    futures = [
        base.sample(ModelInput.from_ints(PROMPT), 1, p)
        for p in (
            SamplingParams(max_tokens=12, temperature=0, stop=[stop_id]),
            SamplingParams(max_tokens=12, temperature=0, stop=stop_text),
            SamplingParams(max_tokens=3, temperature=0, stop=[]),
            greedy,
        )
    ]
    by_id, by_string, by_length, full = [f.result(timeout=WAIT).sequences[0] for f in futures]
    assert by_id.tokens == ref[: ref.index(stop_id) + 1] and by_id.stop_reason == "stop"
    first_text = next(k for k in range(1, 13) if stop_text in tokenizer.decode(ref[:k]))
    assert by_string.tokens == ref[:first_text] and by_string.stop_reason == "stop"
    assert by_length.tokens == ref[:3] and by_length.stop_reason == "length"
    assert full.tokens == ref and full.stop_reason == "length"


def test_same_seeds_give_the_same_tokens_whatever_shares_the_batch(trained):
    service, sessions = trained
    sampler = sessions[1].save_weights_and_get_sampling_client()
    base = service.create_sampling_client(base_model=TINY)
    params = SamplingParams(max_tokens=8, seed=5)
    alone = [sampler.sample(ModelInput.from_ints(PROMPT), 3, params).result(timeout=WAIT) for _ in range(2)]
    drawn = [[(s.tokens, s.logprobs) for s in r.sequences] for r in alone]
    assert drawn[0] == drawn[1]  # a lone seeded request: identical on every call

    # The same requests in the same order, twice, each time with other sessions' requests around them.
    def together():
        crowd = [
            base.sample(ModelInput.from_ints(list(range(30, 30 + n))), 2, SamplingParams(max_tokens=6, seed=n))
            for n in (3, 7)
        ]
        mine = sampler.sample(ModelInput.from_ints(PROMPT), 3, params)
        [f.result(timeout=WAIT) for f in crowd]
        return [(s.tokens, s.logprobs) for s in mine.result(timeout=WAIT).sequences]

    assert together() == together() == drawn[0]  # batch-invariant: bit for bit, not only the tokens


def test_compute_logprobs_batched_equals_unbatched(trained):
    service, sessions = trained
    sampler = sessions[2].save_weights_and_get_sampling_client()
    prompts = [PROMPT, list(range(40, 52)), [3, 4], list(range(60, 67))]
    alone = [sampler.compute_logprobs(ModelInput.from_ints(p)).result(timeout=WAIT) for p in prompts]
    futures = [sampler.compute_logprobs(ModelInput.from_ints(p)) for p in prompts]
    together = [f.result(timeout=WAIT) for f in futures]
    for a, b in zip(alone, together):
        assert a[0] is None and b[0] is None
        np.testing.assert_allclose(a[1:], b[1:], atol=1e-5)
