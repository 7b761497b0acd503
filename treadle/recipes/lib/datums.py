"""Datum builders: turn rendered tokens into the pre-shifted inputs that treadle's losses expect.

Every loss reads per-token arrays aligned with `target_tokens = tokens[1:]`, fed by
`model_input = tokens[:-1]`. Losses are summed over tokens, so whatever normalisation a recipe wants
goes into the weights or advantages here, not into the server.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from treadle.types import Datum, ModelInput


def supervised_datum(tokens: Sequence[int], mask: Sequence[float], normalize: bool = False) -> Datum:
    """A cross_entropy datum: weights are the loss mask shifted onto the targets.

    `normalize=True` divides the weights by the number of trained tokens, so each example counts
    once whatever its length (a per-example mean instead of a per-token sum).
    """
    if len(tokens) != len(mask):
        raise ValueError(f"tokens and mask must have the same length, got {len(tokens)} and {len(mask)}")
    if len(tokens) < 2:
        raise ValueError(f"a datum needs at least 2 tokens, got {len(tokens)}")
    weights = np.asarray(mask[1:], dtype=np.float32)
    if normalize and weights.sum() > 0:
        weights = weights / weights.sum()
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": weights},
    )


def rl_datum(
    prompt: Sequence[int], completion: Sequence[int], sampler_logprobs: Sequence[float], advantage: float
) -> Datum:
    """An importance_sampling / ppo / cispo datum for one sampled completion.

    Prompt positions get advantage 0 (no gradient) and logprob 0 (unused); every completion token
    gets the sequence's advantage and the logprob the sampler reported for it.
    """
    if len(completion) != len(sampler_logprobs):
        raise ValueError(f"completion has {len(completion)} tokens but {len(sampler_logprobs)} sampler logprobs")
    if not prompt or not completion:
        raise ValueError(f"an RL datum needs a prompt and a completion, got {len(prompt)} and {len(completion)} tokens")
    tokens = [*prompt, *completion]
    n_prompt_targets = len(prompt) - 1
    logprobs = np.concatenate([np.zeros(n_prompt_targets, np.float32), np.asarray(sampler_logprobs, np.float32)])
    advantages = np.concatenate(
        [np.zeros(n_prompt_targets, np.float32), np.full(len(completion), advantage, np.float32)]
    )
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": logprobs,
            "advantages": advantages,
        },
    )


def multi_turn_rl_datum(pieces: Sequence[tuple[Sequence[int], Sequence[float] | None]], advantage: float) -> Datum:
    """An RL datum of a multi-turn episode, from its pieces in order.

    A piece is `(tokens, sampler_logprobs)` for tokens the model sampled (they get the advantage and
    their logprobs) or `(tokens, None)` for context it did not write: the prompt, a tool's result,
    turn markers. Those get advantage 0, so only the model's own tokens carry loss weight.
    """
    tokens: list[int] = []
    logprobs: list[float] = []
    advantages: list[float] = []
    for i, (piece, sampled) in enumerate(pieces):
        if sampled is not None and len(sampled) != len(piece):
            raise ValueError(f"piece {i} has {len(piece)} tokens but {len(sampled)} sampler logprobs")
        tokens += piece
        logprobs += list(sampled) if sampled is not None else [0.0] * len(piece)
        advantages += [advantage if sampled is not None else 0.0] * len(piece)
    if len(tokens) < 2 or pieces[0][1] is not None:
        raise ValueError(
            f"a multi-turn datum starts with context the model did not write and has >= 2 tokens, got {len(tokens)}"
        )
    targets = {
        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
        "logprobs": np.asarray(logprobs[1:], np.float32),
        "advantages": np.asarray(advantages[1:], np.float32),
    }
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=targets)
