"""DPO and KTO losses with their exact gradients on numpy arrays, and a custom-loss step that needs no torch.

A preference loss depends on each completion only through its sequence logprob: the sum of the
policy's per-token logprobs over the completion's tokens (`weights` = 1 there, 0 on the prompt).
So the gradient of the loss with respect to every completion token's logprob is the gradient with
respect to that sequence logprob, which these functions return in closed form.

`forward_backward_with_loss` is the torch-free twin of the SDKs' `forward_backward_custom`: a
`forward` for the current logprobs, the loss and its gradient here on the client, then a
cross_entropy `forward_backward` whose weights are -dLoss/dlogprob. cross_entropy's loss is
-(lp * weights).sum(), so its gradient with respect to lp is exactly dLoss/dlogprob. It uses only
`forward`, `forward_backward` and the datum's own class, so it works with treadle's SDK and with the
official `tinker` SDK alike (`forward_backward_custom` itself runs the loss on torch tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    """log(sigmoid(x)), without overflow for large |x|."""
    return -np.logaddexp(0.0, -x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


def sequence_logprobs(token_logprobs: Sequence[np.ndarray], weights: Sequence[np.ndarray]) -> np.ndarray:
    """One number per datum: the sum of its token logprobs where the weight is non-zero."""
    return np.array([float(np.sum(lp[w != 0])) for lp, w in zip(token_logprobs, weights)], dtype=np.float64)


@dataclass
class PreferenceLoss:
    """A batch loss (a mean over examples), dLoss/d(sequence logprob) per sequence, and metrics."""

    loss: float
    grad: np.ndarray
    metrics: dict[str, float]


def dpo_loss(
    chosen: np.ndarray,
    rejected: np.ndarray,
    ref_chosen: np.ndarray,
    ref_rejected: np.ndarray,
    beta: float,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """DPO (Rafailov et al. 2023) with conservative label smoothing (cDPO), averaged over pairs.

    Implicit rewards r = beta * (log pi - log pi_ref); margin h = r_chosen - r_rejected;
    loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h). `grad` is [dL/dchosen..., dL/drejected...].
    """
    chosen_reward, rejected_reward = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    n = len(margin)
    losses = -(1.0 - label_smoothing) * log_sigmoid(margin) - label_smoothing * log_sigmoid(-margin)
    dloss_dmargin = (-(1.0 - label_smoothing) * sigmoid(-margin) + label_smoothing * sigmoid(margin)) / n
    grad = np.concatenate([beta * dloss_dmargin, -beta * dloss_dmargin])
    # Mean log pi - log pi_ref over the batch's completions: the KL to the reference on the data's completions.
    logratio = np.concatenate([chosen - ref_chosen, rejected - ref_rejected])
    return PreferenceLoss(
        float(losses.mean()),
        grad,
        {
            "dpo/loss": float(losses.mean()),
            "dpo/accuracy": float((margin > 0).mean()),
            "dpo/margin": float(margin.mean()),
            "dpo/chosen_reward": float(chosen_reward.mean()),
            "dpo/rejected_reward": float(rejected_reward.mean()),
            "dpo/kl_ref": float(logratio.mean()),
        },
    )


def dpo_on_pairs(
    ref_chosen: np.ndarray, ref_rejected: np.ndarray, beta: float, label_smoothing: float = 0.0
) -> "SequenceLoss":
    """The DPO loss of a batch of sequences laid out [chosen..., rejected...], for `forward_backward_with_loss`."""
    n = len(ref_chosen)
    return lambda policy: dpo_loss(policy[:n], policy[n:], ref_chosen, ref_rejected, beta, label_smoothing)


def kto_reference_point(kl_policy: np.ndarray, kl_ref: np.ndarray) -> float:
    """KTO's z0: the batch estimate of KL(pi || pi_ref) from mismatched (prompt, completion) pairs, floored at 0.

    As in the KTO paper it is a constant of the loss: no gradient flows through it.
    """
    return max(0.0, kto_kl_estimate(kl_policy, kl_ref))


def kto_kl_estimate(kl_policy: np.ndarray, kl_ref: np.ndarray) -> float:
    """The mismatched pairs' mean log-ratio: z0 before the floor (logged, so a run shows where it stands)."""
    return float(np.mean(kl_policy - kl_ref))


def kto_loss(
    policy: np.ndarray,
    ref: np.ndarray,
    desirable: np.ndarray,
    z0: float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLoss:
    """KTO (Ethayarajh et al. 2024), averaged over examples.

    With r = log pi - log pi_ref: a desirable example costs w_D * (1 - sigmoid(beta (r - z0))), an
    undesirable one w_U * (1 - sigmoid(beta (z0 - r))). Raising a desirable completion's logprob, or
    lowering an undesirable one's, lowers the loss.
    """
    desirable = np.asarray(desirable, dtype=bool)
    sign = np.where(desirable, 1.0, -1.0)
    weight = np.where(desirable, desirable_weight, undesirable_weight)
    logratio = policy - ref
    h = beta * sign * (logratio - z0)
    losses = weight * (1.0 - sigmoid(h))
    n = len(losses)
    grad = -weight * beta * sign * sigmoid(h) * sigmoid(-h) / n
    rewards = beta * logratio
    metrics = {"kto/loss": float(losses.mean()), "kto/kl": z0}
    if desirable.any():
        metrics["kto/reward_desirable"] = float(rewards[desirable].mean())
    if (~desirable).any():
        metrics["kto/reward_undesirable"] = float(rewards[~desirable].mean())
    return PreferenceLoss(float(losses.mean()), grad, metrics)


SequenceLoss = Callable[[np.ndarray], PreferenceLoss]


def forward_backward_with_loss(
    training: Any, datums: Sequence[Any], loss_fn: SequenceLoss, n_trained: int | None = None
) -> tuple[Any, PreferenceLoss]:
    """Run a sequence-level loss on the client and accumulate its exact gradient on the worker.

    `datums` are cross_entropy datums whose `weights` mark the completion tokens. `loss_fn` gets the
    policy's sequence logprobs of all of them and returns a PreferenceLoss whose `grad` covers the
    first `n_trained` (default: all); the rest are only measured (KTO's mismatched pairs). Returns the
    backward's future, already submitted, so an `optim_step` submitted next is ordered after it.
    """
    forward = training.forward(list(datums), "cross_entropy").result()
    token_logprobs = [np.asarray(out["logprobs"].to_numpy(), dtype=np.float64) for out in forward.loss_fn_outputs]
    weights = [np.asarray(d.loss_fn_inputs["weights"].to_numpy(), dtype=np.float64) for d in datums]
    result = loss_fn(sequence_logprobs(token_logprobs, weights))
    trained = datums[: len(datums) if n_trained is None else n_trained]
    backward = [
        type(d)(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": (-g * (w != 0)).astype(np.float32),
            },
        )
        for d, w, g in zip(trained, weights, result.grad)
    ]
    return training.forward_backward(backward, "cross_entropy"), result


def kto_on_batch(
    ref: np.ndarray,
    desirable: np.ndarray,
    ref_mismatched: np.ndarray,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> SequenceLoss:
    """The KTO loss of a batch laid out [examples..., mismatched pairs...]; z0 comes from the mismatched ones."""
    n = len(ref)

    def loss(policy: np.ndarray) -> PreferenceLoss:
        out = kto_loss(
            policy[:n],
            ref,
            desirable,
            kto_reference_point(policy[n:], ref_mismatched),
            beta,
            desirable_weight,
            undesirable_weight,
        )
        out.metrics["kto/kl_estimate"] = kto_kl_estimate(policy[n:], ref_mismatched)
        return out

    return loss
