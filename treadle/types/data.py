"""What a training or sampling request carries: token sequences (ModelInput) and training examples (Datum)."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, Sequence, Union

import numpy as np
from pydantic import Field, field_serializer, field_validator

from treadle.types.base import MAX_IMAGE_BYTES, MAX_LOSS_INPUTS, MAX_TOKENS_PER_SEQUENCE, TokenId, _Request
from treadle.types.tensors import DType, TensorData


class EncodedTextChunk(_Request):
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_PER_SEQUENCE, description="Token ids of this chunk.")
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ImageChunk(_Request):
    """An image in the sequence, as encoded bytes; the served model's processor turns it into its image tokens.

    Like Tinker's, its length is `expected_tokens`: the positions it takes in the sequence, which a datum's
    loss inputs count. The worker computes the count from the image and refuses a chunk whose
    `expected_tokens` differs, naming both."""

    data: bytes = Field(max_length=MAX_IMAGE_BYTES, description="The encoded image (base64 in JSON).")
    format: Literal["png", "jpeg"] = Field(description="How `data` is encoded.")
    expected_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TOKENS_PER_SEQUENCE,
        description="The image's token count under the model's processor; needed for `length`.",
    )
    type: Literal["image"] = "image"

    @field_validator("data", mode="before")
    @classmethod
    def _from_base64(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except binascii.Error as exc:
                raise ValueError(f"data: not base64 ({exc})") from None
        return value

    @field_serializer("data")
    def _to_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError("ImageChunk: expected_tokens must be set to compute the length")
        return self.expected_tokens


ModelInputChunk = Annotated[Union[EncodedTextChunk, ImageChunk], Field(discriminator="type")]


class ModelInput(_Request):
    """A sequence, as a list of chunks: encoded text and images."""

    chunks: list[ModelInputChunk] = Field(
        default_factory=list, max_length=MAX_TOKENS_PER_SEQUENCE, description="Chunks in order."
    )

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """The token ids of a text-only input (an image has no ids until the model's processor runs)."""
        if not self.is_text:
            raise ValueError("ModelInput.to_ints: the input holds image chunks; only text chunks have token ids")
        return [t for c in self.chunks if isinstance(c, EncodedTextChunk) for t in c.tokens]

    @property
    def is_text(self) -> bool:
        """True when every chunk is encoded text."""
        return all(isinstance(c, EncodedTextChunk) for c in self.chunks)

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk | ImageChunk) -> "ModelInput":
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
