"""treadle: a self-hosted training-session service for LLM post-training.

from treadle import ServiceClient, Datum, ModelInput, TensorData, SamplingParams, AdamParams
"""

from treadle.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageChunk,
    LoraConfig,
    ModelInput,
    SampleResponse,
    SamplingParams,
    TensorData,
)

__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ImageChunk",
    "LoraConfig",
    "ModelInput",
    "SampleResponse",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
]


def __getattr__(name: str):
    # The SDK imports celery/redis; keep `import treadle.types` cheap for the worker's hot path.
    if name == "ServiceClient":
        from treadle.sdk import ServiceClient

        return ServiceClient
    raise AttributeError(name)
