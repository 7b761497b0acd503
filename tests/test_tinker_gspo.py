"""gspo through the official SDK at the gateway, against a hand computation from the model's own logprobs;
stable_reinforce refused with its reason; treadle's `ServiceClient.future(id)` gives typed responses.

The hand computation is written per sequence with `math` (tests/test_losses.py pins the formula on fixed
tensors); here the point is that the SDK's `sequence_ratio_mask` reaches the loss, that each datum is its
own sequence, and that `loss_fn_config` sets the clip range.
"""

from __future__ import annotations

import math

import pytest
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY
from treadle import types as rt

TEXTS = ["the cat is red and the dog is blue", "one two three four five six"]


@pytest.fixture(scope="module")
def official(gateway):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_BASE_URL", gateway.url)
        mp.setenv("TINKER_API_KEY", ALICE_KEY)
        sc = tinker.ServiceClient()
        yield sc, sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        sc.close("success")


def _gspo_expected(lps, qs, advs, masks, lo, hi) -> float:
    total = 0.0
    for lp, q, adv, mask in zip(lps, qs, advs, masks):
        marked = [i for i, m in enumerate(mask) if m]
        s = math.exp(sum(lp[i] - q[i] for i in marked) / len(marked)) if marked else 1.0
        for a in adv:
            total += -min(s * a, min(max(s, lo), hi) * a)
    return total


def test_gspo_loss_equals_the_hand_computation(official):
    _, tc = official
    tok = tc.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    ce = [
        tt.Datum(
            model_input=tt.ModelInput.from_ints(x[:-1]),
            loss_fn_inputs={"target_tokens": x[1:], "weights": [1.0] * (len(x) - 1)},
        )
        for x in ids
    ]
    lps = [o["logprobs"].tolist() for o in tc.forward(ce, "cross_entropy").result().loss_fn_outputs]
    # Old logprobs off by a per-datum shift, so the two sequence ratios are exp(0.3) and exp(-0.5) on the marked
    # tokens; the first token of each is unmarked (a prompt) and carries a shift that must not count.
    shifts, advantages = [0.3, -0.5], [1.0, -2.0]
    qs, masks, advs = [], [], []
    for lp, shift, a in zip(lps, shifts, advantages):
        qs.append([lp[0] - 5.0] + [v - shift for v in lp[1:]])
        masks.append([0.0] + [1.0] * (len(lp) - 1))
        advs.append([a] * len(lp))
    data = [
        tt.Datum(
            model_input=tt.ModelInput.from_ints(x[:-1]),
            loss_fn_inputs={"target_tokens": x[1:], "logprobs": q, "advantages": adv, "sequence_ratio_mask": mask},
        )
        for x, q, adv, mask in zip(ids, qs, advs, masks)
    ]

    for lo, hi in ((0.8, 1.2), (0.5, 2.0)):
        out = tc.forward_backward(
            data, "gspo", loss_fn_config={"clip_low_threshold": lo, "clip_high_threshold": hi}
        ).result()
        assert out.metrics["loss:sum"] == pytest.approx(_gspo_expected(lps, qs, advs, masks, lo, hi), rel=1e-4)
    # Defaults (1 - 3e-4, 1 + 4e-4): both ratios are far outside, so every term is clipped.
    out = tc.forward_backward(data, "gspo").result()
    assert out.metrics["loss:sum"] == pytest.approx(_gspo_expected(lps, qs, advs, masks, 1 - 3e-4, 1 + 4e-4), rel=1e-4)


def test_stable_reinforce_is_refused_with_the_alternatives(official):
    _, tc = official
    ids = tc.get_tokenizer().encode(TEXTS[0])
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "logprobs": [-1.0] * (len(ids) - 1),
            "advantages": [1.0] * (len(ids) - 1),
        },
    )
    with pytest.raises(Exception) as err:
        tc.forward_backward([datum], "stable_reinforce").result()
    assert "not published" in str(err.value) and "gspo" in str(err.value) and "importance_sampling" in str(err.value)


def test_treadle_service_client_future_is_typed(service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    ids = list(range(3, 12))
    fb = tc.forward_backward(
        [
            rt.Datum(
                model_input=rt.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 8},
            )
        ],
        "cross_entropy",
    )
    opt = tc.optim_step(rt.AdamParams(learning_rate=1e-3))
    got_fb, got_opt = service_client.future(fb.id).result(timeout=60), service_client.future(opt.id).result(timeout=60)
    assert isinstance(got_fb, rt.ForwardBackwardOutput) and isinstance(got_opt, rt.OptimStepResponse)
    assert got_fb.metrics["loss:sum"] == fb.result().metrics["loss:sum"]
    tc.stop()
