"""The treadle SDK: a Tinker-shaped client that needs no torch."""

from treadle.sdk.futures import APIFuture
from treadle.sdk.rest_client import RestClient
from treadle.sdk.sampling_client import SamplingClient
from treadle.sdk.service_client import ServiceClient
from treadle.sdk.training_client import TrainingClient, TrainingSession

__all__ = ["APIFuture", "RestClient", "SamplingClient", "ServiceClient", "TrainingClient", "TrainingSession"]
