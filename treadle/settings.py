"""Where a treadle process finds Redis and the checkpoint store, and how the SDK submits.

Read from arguments first, then the environment (`TREADLE_BROKER_URL`, `TREADLE_RESULT_URL`,
`TREADLE_STORAGE_URL`, `TREADLE_CAPACITY_WAIT_S`, `TREADLE_NO_WORKER_GRACE_S`, `TREADLE_SAMPLE_TTL_S`). S3 endpoint and keys come from boto3's own environment
(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConnectionSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TREADLE_", extra="ignore")

    broker_url: str | None = Field(
        default=None, description="Redis URL of the Celery broker, e.g. redis://127.0.0.1:6379/0."
    )
    result_url: str | None = Field(default=None, description="Redis URL of the result backend; defaults to the broker.")
    storage_url: str | None = Field(default=None, description="Checkpoint store: file:///dir or s3://bucket/prefix.")

    @property
    def result_backend(self) -> str | None:
        return self.result_url or self.broker_url

    def is_configured(self) -> bool:
        return self.broker_url is not None


class SubmitSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TREADLE_", extra="ignore")

    capacity_wait_s: float = Field(
        default=600.0,
        ge=0,
        description="How long one SDK submit waits for room in a queue at its bound (a worker's max_queued_* flags) "
        "before it raises CapacityError; 0 raises at once.",
    )


class WaitSettings(BaseSettings):
    """The bounds of a wait with no timeout (`treadle.queue.wait_bounds`): the SDK's and the gateway's alike."""

    model_config = SettingsConfigDict(env_prefix="TREADLE_", extra="ignore")

    no_worker_grace_s: float = Field(
        default=120.0,
        ge=0,
        description="How long a pending request tolerates having no live worker for its model (a restart under a "
        "supervisor) before its wait fails with NoWorkerError.",
    )
    sample_ttl_s: float = Field(
        default=86400.0,
        gt=0,
        description="How long a sample or compute_logprobs request may go unanswered after its submit; past it, a "
        "wait on it fails with RequestExpiredError.",
    )
