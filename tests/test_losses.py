"""Each loss against a hand computation on fixed tensors: the value and d loss / d lp.

The expected values are written out per token with `math` (not with the formulas under test), and the
tensors are chosen so that every branch is exercised: ppo's clipped and unclipped regions for positive
and negative advantages, cispo's clip at both ends, dro's penalty with lp != q.
"""

import math

import pytest
import torch

from treadle.gpu_worker.training.losses import LOSSES, resolve_config

LP = [-0.5, -1.0, -2.0, -0.1, -3.0]
Q = [-1.0, -0.8, -1.0, -0.1, -1.5]  # ratios r = exp(lp - q): 1.6487, 0.8187, 0.3679, 1.0, 0.2231
ADV = [1.0, 2.0, -1.0, 0.5, -2.0]
WEIGHTS = [1.0, 0.0, 2.0, 0.5, 0.0]
# gspo: tokens 0-2 are one sequence, 3-4 another; the ratio averages the marked tokens of each.
SEQUENCE = [0, 0, 0, 1, 1]
RATIO_MASK = [0.0, 1.0, 1.0, 1.0, 0.0]


def _ratio(i: int) -> float:
    return math.exp(LP[i] - Q[i])


def _ppo_term(i: int, lo: float, hi: float) -> tuple[float, float]:
    """(loss term, d term / d lp) of one token, branch by branch."""
    r, a = _ratio(i), ADV[i]
    clipped = min(max(r, lo), hi)
    if r * a <= clipped * a:  # the unclipped objective is the minimum: gradient flows
        return -r * a, -r * a
    return -clipped * a, 0.0  # clipped: constant in lp


def _cispo_term(i: int, lo: float, hi: float) -> tuple[float, float]:
    w = min(max(_ratio(i), lo), hi)
    return -w * LP[i] * ADV[i], -w * ADV[i]


def _dro_term(i: int, beta: float) -> tuple[float, float]:
    d = LP[i] - Q[i]
    return -(LP[i] * ADV[i] - 0.5 * beta * d * d), -(ADV[i] - beta * d)


def _gspo_terms(lo: float, hi: float) -> list[tuple[float, float]]:
    """Sequence 0: s = exp(((-1.0+0.8) + (-2.0+1.0)) / 2) = exp(-0.6); sequence 1: s = exp(0) = 1."""
    s = [math.exp(((LP[1] - Q[1]) + (LP[2] - Q[2])) / 2), math.exp(LP[3] - Q[3])]
    terms = []
    for i in range(len(LP)):
        r, a = s[SEQUENCE[i]], ADV[i]
        clipped = min(max(r, lo), hi)
        # d s_t / d lp_t = s (the sequence part is a constant), so an unclipped token's gradient is -s*A
        terms.append((-r * a, -r * a) if r * a <= clipped * a else (-clipped * a, 0.0))
    return terms


def _expected(loss_fn: str, config: dict[str, float]) -> tuple[float, list[float]]:
    n = range(len(LP))
    if loss_fn == "cross_entropy":
        terms = [(-LP[i] * WEIGHTS[i], -WEIGHTS[i]) for i in n]
    elif loss_fn == "importance_sampling":
        terms = [(-_ratio(i) * ADV[i], -_ratio(i) * ADV[i]) for i in n]
    elif loss_fn == "ppo":
        terms = [_ppo_term(i, config["clip_low_threshold"], config["clip_high_threshold"]) for i in n]
    elif loss_fn == "cispo":
        terms = [_cispo_term(i, config["clip_low_threshold"], config["clip_high_threshold"]) for i in n]
    elif loss_fn == "gspo":
        terms = _gspo_terms(config["clip_low_threshold"], config["clip_high_threshold"])
    else:
        terms = [_dro_term(i, config["beta"]) for i in n]
    return sum(t[0] for t in terms), [t[1] for t in terms]


CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),  # defaults 0.8 / 1.2: token 0 (r=1.65, A>0), tokens 2 and 4 (r<0.8, A<0) are clipped
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    ("cispo", None),  # defaults 0.0 / 4.0
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),  # clips tokens 0, 1, 2, 4
    ("dro", {"beta": 0.3}),
    ("dro", None),
    ("gspo", None),  # defaults 0.9997 / 1.0004: sequence 0 (s=0.55) is clipped where A<0 (token 2); s=1 is inside
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
]


@pytest.mark.parametrize("loss_fn,loss_fn_config", CASES)
def test_loss_value_and_gradient_match_hand_computation(loss_fn, loss_fn_config):
    config = resolve_config(loss_fn, loss_fn_config)
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inputs = {
        "weights": torch.tensor(WEIGHTS, dtype=torch.float64),
        "logprobs": torch.tensor(Q, dtype=torch.float64),
        "advantages": torch.tensor(ADV, dtype=torch.float64),
        "sequence_ratio_mask": torch.tensor(RATIO_MASK, dtype=torch.float64),
        "sequence_index": torch.tensor(SEQUENCE),
    }
    loss = LOSSES[loss_fn].fn(lp, inputs, config)
    loss.backward()

    value, grad = _expected(loss_fn, config)
    assert loss.item() == pytest.approx(value, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx(grad, abs=1e-12)


def test_ppo_defaults_clip_some_tokens_and_not_others():
    """Guards the fixture itself: with the defaults, ppo has both zero and non-zero gradients."""
    _, grad = _expected("ppo", resolve_config("ppo", None))
    assert grad[0] == grad[2] == grad[4] == 0.0
    assert grad[1] != 0.0 and grad[3] != 0.0


def test_defaults_are_tinkers():
    assert resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("cispo", None) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_config("ppo", {"clip_high_threshold": 1.5})["clip_high_threshold"] == 1.5


def test_losses_are_sums_not_means():
    """Doubling every token doubles the loss: the reduction is a sum."""
    lp = torch.tensor(LP)
    inputs = {"weights": torch.tensor(WEIGHTS)}
    one = LOSSES["cross_entropy"].fn(lp, inputs, {})
    two = LOSSES["cross_entropy"].fn(lp.repeat(2), {"weights": inputs["weights"].repeat(2)}, {})
    assert two.item() == pytest.approx(2 * one.item())


def test_gspo_ratio_ignores_unmarked_tokens():
    """Changing q on an unmarked token changes nothing; on a marked one it moves the whole sequence's ratio."""
    config = resolve_config("gspo", {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0})

    def grad(q):
        lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
        inputs = {
            "logprobs": torch.tensor(q, dtype=torch.float64),
            "advantages": torch.tensor(ADV, dtype=torch.float64),
            "sequence_ratio_mask": torch.tensor(RATIO_MASK, dtype=torch.float64),
            "sequence_index": torch.tensor(SEQUENCE),
        }
        LOSSES["gspo"].fn(lp, inputs, config).backward()
        return lp.grad.tolist()

    base = grad(Q)
    assert grad([Q[0] + 1.0, *Q[1:]]) == pytest.approx(base)  # token 0 is unmarked
    moved = grad([Q[0], Q[1] + 1.0, *Q[2:]])  # token 1 is marked: every token of sequence 0 changes
    assert all(moved[i] != pytest.approx(base[i]) for i in (0, 1, 2))
    assert moved[3:] == pytest.approx(base[3:])


def test_unserved_losses_are_refused_with_the_alternatives():
    from treadle.errors import InvalidRequestError
    from treadle.queue.ops import ForwardBackwardRequest
    from treadle.types import Datum, ModelInput

    datum = Datum(
        model_input=ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]}
    )
    with pytest.raises(InvalidRequestError) as err:
        ForwardBackwardRequest.build(data=[datum], loss_fn="stable_reinforce")
    assert "stable_reinforce" in str(err.value) and "not published" in str(err.value)
    assert "importance_sampling" in str(err.value) and "gspo" in str(err.value)
