"""Tinker 0.38's `inflight` sampling clients through the gateway, with the official SDK.

Tinker's contract (tinker/types/sampling_client_kind.py): all inflight clients of a training model share
one mutable weights target, which each later inflight save updates, for existing clients too; a
`snapshot` client keeps the weights it was saved with. treadle serves that: between two inflight saves
an inflight client stays on the last one (the gateway cannot snapshot outside the client's seq order).
Compared exactly: compute_logprobs of a fixed sequence, and seeded samples.
"""

from __future__ import annotations

import tinker

SEQUENCE = [5, 17, 42, 99, 7, 64, 3, 28]


def _logprobs(sampler: tinker.SamplingClient) -> list[float]:
    return sampler.compute_logprobs(tinker.ModelInput.from_ints(SEQUENCE)).result()[1:]


def _sample(sampler: tinker.SamplingClient) -> tuple[list[int], list[float]]:
    params = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    seq = sampler.sample(tinker.ModelInput.from_ints(SEQUENCE[:4]), 1, params).result().sequences[0]
    return seq.tokens, seq.logprobs


def _train_step(tc: tinker.TrainingClient) -> None:
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(SEQUENCE[:-1]),
        loss_fn_inputs={"target_tokens": SEQUENCE[1:], "weights": [1.0] * (len(SEQUENCE) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()


def test_inflight_sampler_follows_the_models_inflight_saves_snapshot_does_not(tinker_env):
    tc = tinker.ServiceClient().create_lora_training_client("tiny", rank=4)
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before, sampled_before = _logprobs(inflight), _sample(inflight)
    assert _logprobs(snapshot) == before  # the same (untrained) weights so far

    _train_step(tc)
    assert _logprobs(inflight) == before  # no inflight save since: still the last one's weights
    newer = tc.save_weights_and_get_sampling_client(kind="inflight").result()

    after = _logprobs(inflight)
    assert after != before and after == _logprobs(newer)  # the earlier client moved onto the new save
    assert sum(after) > sum(before)  # ... which is the trained one: the trained sequence is likelier
    sampled_after = _sample(inflight)
    assert sampled_after == _sample(newer) and sampled_after[1] != sampled_before[1]
    assert _logprobs(snapshot) == before and _sample(snapshot) == sampled_before  # a snapshot never moves


def test_inflight_targets_are_per_training_model(tinker_env):
    """A second model's inflight save leaves the first model's inflight clients where they were."""
    service = tinker.ServiceClient()
    first, second = (service.create_lora_training_client("tiny", rank=4) for _ in range(2))
    inflight = first.save_weights_and_get_sampling_client(kind="inflight").result()
    before = _logprobs(inflight)
    _train_step(second)
    other = second.save_weights_and_get_sampling_client(kind="inflight").result()
    assert _logprobs(other) != before and _logprobs(inflight) == before
