"""What a training or sampling request carries: token sequences (ModelInput) and training examples (Datum)."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
from pydantic import Field, field_validator

from treadle.types.base import MAX_LOSS_INPUTS, MAX_TOKENS_PER_SEQUENCE, TokenId, _Request
from treadle.types.tensors import DType, TensorData


class EncodedTextChunk(_Request):
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_PER_SEQUENCE, description="Token ids of this chunk.")
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ModelInput(_Request):
    """A token sequence, as a list of chunks (only encoded text is supported)."""

    chunks: list[EncodedTextChunk] = Field(
        default_factory=list, max_length=MAX_TOKENS_PER_SEQUENCE, description="Chunks in order."
    )

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> "ModelInput":
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> "ModelInput":
        return self.append(EncodedTextChunk(tokens=[int(token)]))


def _as_tensor_data(key: str, value: Any) -> Any:
    """Lets users pass lists, numpy arrays or torch tensors, as Tinker's `Datum` does."""
    if isinstance(value, (TensorData, dict)):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, (list, tuple)):
        dtype: DType = "int64" if key == "target_tokens" else "float32"
        return TensorData.from_list(list(value), dtype)
    return value


class Datum(_Request):
    """One training example: the (pre-shifted) input tokens and the loss's per-token inputs."""

    model_input: ModelInput = Field(description="Input tokens, i.e. tokens[:-1].")
    loss_fn_inputs: dict[str, TensorData] = Field(
        default_factory=dict,
        max_length=MAX_LOSS_INPUTS,
        description="Per-token loss inputs: target_tokens, weights, logprobs, advantages, ...",
    )

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _convert_inputs(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: _as_tensor_data(k, v) for k, v in value.items()}
        return value
