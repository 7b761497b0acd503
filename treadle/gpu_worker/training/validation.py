"""Checks of every request against the served model, done before anything touches a tensor.

A rejected request leaves the session exactly as it was (no partial gradients), and the message
names the field, the value and the limit, e.g.
`data[2].loss_fn_inputs.weights: length 7 != model_input length 8`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from treadle.errors import InvalidRequestError
from treadle.gpu_worker.model.vision import Vision, VisualInput
from treadle.gpu_worker.training.losses import LOSSES, resolve_config
from treadle.queue.ops import parse_request
from treadle.types import Datum, LoraConfig, ModelInput, SamplingParams


@dataclass(frozen=True)
class PreparedDatum:
    """A validated datum as arrays: input tokens, and the loss inputs by key (target_tokens int64, rest float32),
    each `(N,)`, or `(N, K)` for cross_entropy's top-k target_tokens and weights."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]
    visual: VisualInput | None = None  # its images, when it has any

    @property
    def length(self) -> int:
        return len(self.tokens)

    def gated(self, gate: str) -> np.ndarray:
        """The positions where the loss's `gate` input is nonzero (any of a position's K columns)."""
        return (self.inputs[gate].reshape(self.length, -1) != 0).any(axis=1)


def check_loss(loss_fn: str, loss_fn_config: dict[str, float] | None) -> dict[str, float]:
    """The resolved loss config; rejects unknown losses, unknown config keys and non-finite values."""
    if loss_fn not in LOSSES:
        raise InvalidRequestError(f"loss_fn: unknown {loss_fn!r}; expected one of {', '.join(LOSSES)}")
    allowed = LOSSES[loss_fn].config_defaults
    for key, value in (loss_fn_config or {}).items():
        if key not in allowed:
            expected = ", ".join(allowed) or "no keys"
            raise InvalidRequestError(f"loss_fn_config.{key}: not a parameter of {loss_fn}; expected {expected}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(f"loss_fn_config.{key}: {value!r} is not a finite number")
    resolved = resolve_config(loss_fn, loss_fn_config)
    parse_request(LOSSES[loss_fn].config, resolved, "loss_fn_config")  # bounds and cross-field checks
    return resolved


def check_tokens(field: str, tokens: list[int] | np.ndarray, *, max_seq_len: int, vocab_size: int) -> np.ndarray:
    """Non-empty, within the context length, every id inside the vocabulary."""
    array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if array.size == 0:
        raise InvalidRequestError(f"{field}: empty; at least one token is required")
    if array.size > max_seq_len:
        raise InvalidRequestError(f"{field}: length {array.size} exceeds max sequence length {max_seq_len}")
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(
            f"{field}.tokens[{i}]: token id {int(array[i])} outside vocabulary (size {vocab_size})"
        )
    return array


def check_input(
    field: str, model_input: ModelInput, *, max_seq_len: int, vocab_size: int, vision: Vision | None
) -> tuple[np.ndarray, VisualInput | None]:
    """The input's token ids (checked as `check_tokens` does), and its images prepared by the model's processor
    when it has any; an image for a model without a vision tower is refused, naming the chunk."""
    if vision is not None:
        vision.check_text(field, model_input)
    if model_input.is_text:
        return check_tokens(field, model_input.to_ints(), max_seq_len=max_seq_len, vocab_size=vocab_size), None
    if vision is None:
        c = next(c for c, chunk in enumerate(model_input.chunks) if chunk.type == "image")
        raise InvalidRequestError(
            f"{field}.chunks[{c}]: an image chunk, but the served model takes text only (it has no vision tower)"
        )
    visual = vision.prepare(field, model_input)
    return check_tokens(field, visual.tokens, max_seq_len=max_seq_len, vocab_size=vocab_size), visual


def prepare_data(
    data: list[Datum], loss_fn: str, *, max_seq_len: int, vocab_size: int, vision: Vision | None = None
) -> list[PreparedDatum]:
    """Validate a forward/forward_backward batch for `loss_fn` (already checked) and convert it to arrays."""
    if not data:
        raise InvalidRequestError("data: empty; at least one datum is required")
    needed = ("target_tokens", *LOSSES[loss_fn].inputs)
    prepared = []
    for i, datum in enumerate(data):
        tokens, visual = check_input(
            f"data[{i}].model_input", datum.model_input, max_seq_len=max_seq_len, vocab_size=vocab_size, vision=vision
        )
        given = datum.loss_fn_inputs
        for key in given:
            if key not in needed:
                raise InvalidRequestError(
                    f"data[{i}].loss_fn_inputs.{key}: not an input of {loss_fn}; expected {', '.join(needed)}"
                )
        inputs = {}
        for key in needed:
            field = f"data[{i}].loss_fn_inputs.{key}"
            if key not in given:
                raise InvalidRequestError(f"{field}: missing; {loss_fn} needs {', '.join(needed)}")
            tensor = given[key]
            values = tensor.to_numpy()
            values = values.reshape(
                _input_shape(
                    field, [values.size] if tensor.shape is None else tensor.shape, key, loss_fn, length=tokens.size
                )
            )
            if not np.all(np.isfinite(values)):
                raise InvalidRequestError(f"{field}: contains NaN/inf")
            if key == "target_tokens":
                if not np.all(values == np.round(values)):
                    raise InvalidRequestError(f"{field}: token ids must be integers")
                values = values.astype(np.int64)
                bad = np.argwhere((values < 0) | (values >= vocab_size))
                if bad.size:
                    j = bad[0]
                    where = "".join(f"[{int(x)}]" for x in j)
                    raise InvalidRequestError(
                        f"{field}{where}: token id {int(values[tuple(j)])} outside vocabulary (size {vocab_size})"
                    )
            else:
                values = values.astype(np.float32)
            inputs[key] = values
        if LOSSES[loss_fn].columns and inputs["target_tokens"].shape != inputs["weights"].shape:
            raise InvalidRequestError(
                f"data[{i}].loss_fn_inputs.weights: shape {list(inputs['weights'].shape)} != target_tokens shape "
                f"{list(inputs['target_tokens'].shape)}; each target token needs its weight"
            )
        prepared.append(PreparedDatum(tokens=tokens, inputs=inputs, visual=visual))
    return prepared


def _input_shape(field: str, shape: list[int], key: str, loss_fn: str, *, length: int) -> tuple[int, ...]:
    """The shape a loss input is read in: `(N,)`, or `(N, K)` for the inputs of a loss that takes K target
    tokens a position (cross_entropy's top-k soft targets); N is the model_input's length."""
    columns = LOSSES[loss_fn].columns and key in ("target_tokens", "weights")
    if len(shape) == 2 and not columns:
        raise InvalidRequestError(
            f"{field}: shape {shape}; [N, K] inputs are taken by cross_entropy's target_tokens and weights only, "
            f"{loss_fn}'s {key} is 1-D (one value a token)"
        )
    if len(shape) not in (1, 2):
        raise InvalidRequestError(f"{field}: shape {shape}; expected [N]" + (" or [N, K]" if columns else ""))
    if shape[0] != length:
        raise InvalidRequestError(f"{field}: length {shape[0]} != model_input length {length}")
    if len(shape) == 2 and shape[1] < 1:
        raise InvalidRequestError(f"{field}: shape {shape}; K must be at least 1 (target tokens a position)")
    return tuple(shape)


@dataclass(frozen=True)
class PreparedSample:
    prompt: np.ndarray
    max_tokens: int
    stop_token_ids: list[int]
    stop_strings: list[str]
    visual: VisualInput | None = None  # the prompt's images, when it has any


def prepare_sample(
    prompt: ModelInput,
    num_samples: int,
    params: SamplingParams,
    topk_prompt_logprobs: int,
    *,
    max_seq_len: int,
    vocab_size: int,
    vision: Vision | None = None,
) -> PreparedSample:
    """Validate a sample request: the prompt plus max_tokens must fit the context; stop ids must exist."""
    tokens, visual = check_input("prompt", prompt, max_seq_len=max_seq_len, vocab_size=vocab_size, vision=vision)
    if tokens.size >= max_seq_len:
        raise InvalidRequestError(
            f"prompt: length {tokens.size} leaves no room to sample within max sequence length {max_seq_len}"
        )
    if num_samples < 1:
        raise InvalidRequestError(f"num_samples: {num_samples}; must be >= 1")
    if not 0 <= topk_prompt_logprobs <= vocab_size:
        raise InvalidRequestError(f"topk_prompt_logprobs: {topk_prompt_logprobs}; must be between 0 and {vocab_size}")
    room = max_seq_len - tokens.size
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens > room:
        raise InvalidRequestError(
            f"sampling_params.max_tokens: prompt length {tokens.size} + max_tokens {max_tokens} "
            f"exceeds max sequence length {max_seq_len}"
        )
    for j, token in enumerate(params.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"sampling_params.stop[{j}]: token id {token} outside vocabulary (size {vocab_size})"
            )
    if any(s == "" for s in params.stop_strings):
        raise InvalidRequestError("sampling_params.stop: empty stop string")
    return PreparedSample(tokens, max_tokens, list(params.stop_token_ids), params.stop_strings, visual)


def check_same_adapter(session: LoraConfig, checkpoint: LoraConfig, *, source: str) -> None:
    """load_state into a live session keeps its adapter's shape: a checkpoint of another shape is refused."""
    shape = ("rank", "alpha", "train_mlp", "train_attn", "train_unembed", "train_vision")
    ours, theirs = session.model_dump(include=set(shape)), checkpoint.model_dump(include=set(shape))
    if ours != theirs:
        diff = ", ".join(f"{k} {ours[k]} vs {theirs[k]}" for k in shape if ours[k] != theirs[k])
        raise InvalidRequestError(
            f"path: {source} holds a LoRA adapter of another shape than this session's "
            f"(session vs checkpoint: {diff}); create a training client from it instead"
        )
