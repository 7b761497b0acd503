"""Every training op with every built-in loss, through the real local stack on the tiny model.

For each loss: `forward` returns per-datum logprobs of the right length and the loss's metrics;
`forward_backward` + `optim_step` move the loss, and raise the logprobs of the trained tokens
(advantages are positive and the sampler logprobs equal the current ones, so every policy loss starts
at ratio 1 and its step pushes lp up; for cross_entropy that is the loss going down);
`forward_backward_custom` gives the same gradient as the built-in cross_entropy.
"""

from __future__ import annotations

import typing

import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput
from treadle.types import LossFnType

ADAM = AdamParams(learning_rate=2e-2)
LOSSES = typing.get_args(LossFnType)


def _batch(loss_fn: str, sampler_logprobs: list[np.ndarray] | None = None) -> list[Datum]:
    data = []
    for i, length in enumerate((9, 14)):
        tokens = [(7 * i + 3 * j) % 200 + 20 for j in range(length + 1)]
        inputs: dict = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = np.ones(length, dtype=np.float32)
        else:
            inputs["logprobs"] = (
                sampler_logprobs[i] if sampler_logprobs is not None else np.zeros(length, dtype=np.float32)
            )
            inputs["advantages"] = np.full(length, 0.5, dtype=np.float32)
        if loss_fn == "gspo":  # the tokens whose ratios make the sequence ratio: all of them here
            inputs["sequence_ratio_mask"] = np.ones(length, dtype=np.float32)
        data.append(Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_training_ops_with_each_loss(service_client, loss_fn):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=1)
    probe = tc.forward(_batch("cross_entropy"), "cross_entropy").result(timeout=60)
    current = [o["logprobs"].to_numpy() for o in probe.loss_fn_outputs]
    data = _batch(loss_fn, current)

    before = tc.forward(data, loss_fn).result(timeout=60)
    assert [o["logprobs"].to_numpy().shape for o in before.loss_fn_outputs] == [(9,), (14,)]
    assert set(before.metrics) == {"loss:sum", "step:max"} and before.metrics["step:max"] == 0
    np.testing.assert_allclose(before.loss_fn_outputs[1]["logprobs"].to_numpy(), current[1], atol=1e-6)

    fb = tc.forward_backward(data, loss_fn)
    step = tc.optim_step(ADAM)
    assert fb.result(timeout=60).metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    assert step.result(timeout=60).metrics["step:max"] == 1
    after = tc.forward(data, loss_fn).result(timeout=60)
    assert after.metrics["step:max"] == 1
    # gspo's default clip range is 1 - 3e-4 .. 1 + 4e-4: its loss moves by at most that, relatively.
    assert after.metrics["loss:sum"] != pytest.approx(
        before.metrics["loss:sum"], rel=1e-5 if loss_fn == "gspo" else 1e-3
    )
    lp_before = sum(o["logprobs"].to_numpy().sum() for o in before.loss_fn_outputs)
    lp_after = sum(o["logprobs"].to_numpy().sum() for o in after.loss_fn_outputs)
    assert lp_after > lp_before
    if loss_fn in ("cross_entropy", "importance_sampling", "ppo"):
        assert after.metrics["loss:sum"] < before.metrics["loss:sum"]
    tc.stop()


def test_forward_backward_custom_matches_the_built_in_loss(service_client):
    runs = []
    for custom in (False, True):
        tc = service_client.create_lora_training_client("tiny", rank=4, seed=2)
        data = _batch("cross_entropy")
        if custom:
            out = tc.forward_backward_custom(
                data, lambda d, lps: (-sum(lp.sum() for lp in lps), {"n": len(lps)})
            ).result(timeout=60)
            assert out.metrics["n:mean"] == 2
        else:
            out = tc.forward_backward(data, "cross_entropy").result(timeout=60)
        tc.optim_step(ADAM).result(timeout=60)
        runs.append((out.metrics["loss:sum"], tc.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]))
        tc.stop()
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
