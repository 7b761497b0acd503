"""Public wire types: what a training loop sends to treadle and gets back.

Names, fields and defaults follow Tinker's SDK (`tinker.types`) so that a Tinker loop ports by
changing its imports. Requests reject unknown fields; responses ignore them. This package imports
numpy but never torch: torch is touched only inside `TensorData.from_torch` / `to_torch`.

Tensors travel as raw little-endian bytes (`model_dump(context=WIRE)`), never as pickles.
"""

from __future__ import annotations

from treadle.types.base import (
    MAX_IMAGE_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_VALUES,
    MAX_TOKENS_PER_SEQUENCE,
    SEED_MAX,
    TokenId,
)
from treadle.types.configs import (
    ALIAS_TARGETS,
    ALIASABLE_LOSSES,
    LOSS_CONFIGS,
    LOSS_FN_TYPES,
    UNSERVED_LOSSES,
    AdamParams,
    CISPOConfig,
    DROConfig,
    GSPOConfig,
    FullConfig,
    LoraConfig,
    LossConfig,
    LossFnType,
    PPOConfig,
    SamplingParams,
)
from treadle.types.data import Datum, EncodedTextChunk, ImageChunk, ModelInput, ModelInputChunk
from treadle.types.responses import (
    Checkpoint,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    ModelData,
    OptimStepResponse,
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    ServerCapabilities,
    StopReason,
    SupportedModel,
    TrainingRun,
    WeightsInfo,
)
from treadle.types.tensors import WIRE, TensorData

__all__ = [
    "AdamParams",
    "Checkpoint",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "ImageChunk",
    "LoadWeightsResponse",
    "FullConfig",
    "LoraConfig",
    "LossFnType",
    "ModelData",
    "ModelInput",
    "ModelInputChunk",
    "OptimStepResponse",
    "PromptAltTokens",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsExternalResponse",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServerCapabilities",
    "StopReason",
    "SupportedModel",
    "TensorData",
    "TrainingRun",
    "WeightsInfo",
    "LOSS_CONFIGS",
    "LOSS_FN_TYPES",
    "CISPOConfig",
    "DROConfig",
    "GSPOConfig",
    "LossConfig",
    "PPOConfig",
    "UNSERVED_LOSSES",
    "ALIASABLE_LOSSES",
    "ALIAS_TARGETS",
    # The limits requests are held to, and the context that writes tensors as raw bytes (the queue, the gateway).
    "MAX_IMAGE_BYTES",
    "MAX_TENSOR_DIMS",
    "MAX_TENSOR_VALUES",
    "MAX_TOKENS_PER_SEQUENCE",
    "SEED_MAX",
    "TokenId",
    "WIRE",
]
