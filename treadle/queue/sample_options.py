"""Bounds of a sample request's prompt- and sample-side logprob options (Tinker 0.38's
`topk_sample_logprobs`, `target_prompt_logprobs`, `prompt_alt_tokens_k`), checked where the request is built.

Each sampled or prompt position returns that many values, and a result waits in the broker's Redis until
it is read, so the widths are capped like OpenAI's logprobs (20); target ids get more room, since the
cookbook's decisions recipe scores one id per choice at one position.
"""

from __future__ import annotations

from typing import Sequence

from treadle.types import TensorData

MAX_TOPK_SAMPLE_LOGPROBS = 20
MAX_PROMPT_ALT_TOKENS = 20
MAX_TARGET_IDS = 64


def target_shape_error(dtype: str, shape: Sequence[int] | None, rows: int) -> str | None:
    """Why ids of `dtype` and `shape` cannot be the target ids of `rows` prompt positions, or None if they can.
    The gateway checks the SDK's tensor with it before allocating anything; `check_target_ids` checks ours."""
    if (
        dtype == "int64"
        and shape is not None
        and len(shape) == 2
        and shape[0] == rows
        and 1 <= shape[1] <= MAX_TARGET_IDS
    ):
        return None
    return (
        f"target_prompt_logprobs: {dtype} of shape {shape}; must be int64 "
        f"[len(prompt) - 1 = {rows}, K] with 1 <= K <= {MAX_TARGET_IDS}"
    )


def check_target_ids(target: TensorData | None, prompt_length: int) -> None:
    """One row of ids (or -1) per prompt position after the first, 1..MAX_TARGET_IDS columns, at least
    one id. The worker, which knows the vocabulary, checks the ids themselves."""
    if target is None:
        return
    if (problem := target_shape_error(target.dtype, target.shape, prompt_length - 1)) is not None:
        raise ValueError(problem)
    ids = target.to_numpy()
    if (ids < -1).any():
        raise ValueError(f"target_prompt_logprobs: id {int(ids.min())}; each cell is a token id or -1 (none)")
    if not (ids >= 0).any():
        raise ValueError("target_prompt_logprobs: every cell is -1; name at least one token id to score")
