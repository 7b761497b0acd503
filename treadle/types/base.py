"""What every wire type shares: the request and response bases, and the limits on what a request may ask for."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    """Base of everything a client sends: unknown fields are an error, not silently dropped, and NaN
    or infinity in a number is an error here, naming the field (JSON would turn it into null)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Token ids and seeds: what torch and the tokenizers accept. torch takes seeds below 2**64; the
# margin leaves room for the per-row offsets a sampler adds to a request's seed.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
SEED_MAX = 2**63 - 1
MAX_TOKENS_PER_SEQUENCE = 2**20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Generous limits on counts, so no request can ask for unbounded work or memory: a tensor has at most
# 8 dimensions; a protobuf tensor (sparse ones are densified) at most 2**24 values; a datum at most 64
# loss inputs; a ModelInput at most one chunk per token.
MAX_TENSOR_DIMS = 8
MAX_TENSOR_VALUES = 2**24
MAX_LOSS_INPUTS = 64
# An image chunk's encoded bytes, and the pixels a worker decodes of one by default (`--max_image_pixels`).
MAX_IMAGE_BYTES = 2**24
DEFAULT_MAX_IMAGE_PIXELS = 2**24  # 4096 x 4096


class _Response(BaseModel):
    """Base of everything the server returns: newer servers may add fields."""

    model_config = ConfigDict(extra="ignore")
