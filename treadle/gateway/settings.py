"""Settings of the HTTP gateway: where it listens, which Redis/store it uses, and who may call it.

Read from keyword arguments first, then the environment (`TREADLE_GATEWAY_*`, plus the shared
`TREADLE_BROKER_URL` / `TREADLE_RESULT_URL` / `TREADLE_STORAGE_URL`). API keys come from
`TREADLE_GATEWAY_API_KEYS` (JSON `{"tml-...": "owner"}`) and/or a keys file (TOML or JSON) named
by `TREADLE_GATEWAY_API_KEYS_FILE`:

    # keys.toml
    [keys]
    "tml-alice-3f9c" = "alice"
    "tml-bob-77aa" = "bob"

Keys must start with `tml-` because the official Tinker SDK refuses any other key client-side.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from treadle.types import ALIAS_TARGETS, ALIASABLE_LOSSES

KEY_PREFIX = "tml-"
# The user_metadata key under which a run created through a gateway with loss aliases records them.
LOSS_ALIAS_METADATA_KEY = "treadle_loss_alias"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TREADLE_GATEWAY_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port to listen on (0 picks a free one).")
    broker_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("broker_url", "TREADLE_BROKER_URL"),
        description="Redis URL of the Celery broker (the same one the workers use).",
    )
    result_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("result_url", "TREADLE_RESULT_URL"),
        description="Redis URL of the result backend; defaults to the broker.",
    )
    storage_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("storage_url", "TREADLE_STORAGE_URL"),
        description="Checkpoint store (file:///dir or s3://bucket/prefix) for the checkpoint and run listings.",
    )
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> owner name. Keys start with `tml-`.")
    api_keys_file: Path | None = Field(
        default=None, description="TOML or JSON file with a `keys` table of API key -> owner."
    )
    long_poll_seconds: float = Field(
        default=25.0,
        gt=0,
        le=40,
        description="How long retrieve_future holds a pending request before answering try_again (the SDK times out at 45 s).",
    )
    fwdbwd_max_chunk_len: int = Field(
        default=1024,
        ge=1,
        description="Most datums per forward_backward request the SDK sends (it splits larger batches).",
    )
    create_timeout_seconds: float = Field(
        default=600.0, gt=0, description="Longest wait for a worker to create a session."
    )
    sample_timeout_seconds: float = Field(
        default=600.0, gt=0, description="Longest wait for an OpenAI-compatible completion."
    )
    openai_image_fetch: bool = Field(
        default=False,
        description="Fetch http(s) image URLs of OpenAI chat messages (off: only data: URLs; on, a client makes the "
        "gateway fetch the URLs it names, so only from --openai_image_hosts).",
    )
    openai_image_hosts: list[str] = Field(
        default_factory=list, description="Hosts whose http(s) image URLs the gateway fetches (--openai_image_fetch)."
    )
    openai_image_max_bytes: int = Field(
        default=8 << 20, ge=1, description="Largest image the gateway fetches from an http(s) URL."
    )
    openai_image_timeout_s: float = Field(
        default=10.0, gt=0, description="Longest fetch of one http(s) image URL, connecting and each read."
    )
    max_body_bytes: int = Field(
        default=64 << 20,
        ge=1024,
        description="Largest request body accepted, as sent (compressed or not); larger is a 413.",
    )
    max_decompressed_bytes: int = Field(
        default=256 << 20, ge=1024, description="Largest size a zstd request body may decompress to; larger is a 413."
    )
    max_seq_ahead: int = Field(
        default=4096,
        ge=1,
        description="How far a training op's seq_id may run ahead of the model's last applied op; further is a 400.",
    )
    state_ttl_seconds: int = Field(
        default=7 * 24 * 3600,
        ge=60,
        description="How long the gateway keeps its own records (requests, samplers) in Redis.",
    )

    loss_alias: list[str] = Field(
        default_factory=list,
        description="Serve a Tinker loss name treadle refuses as a served loss, e.g. `stable_reinforce=cispo`, so that "
        "cookbook defaults run unchanged (off by default; logged at start; recorded in every new run's user_metadata "
        f"as `{LOSS_ALIAS_METADATA_KEY}`). Names: {', '.join(ALIASABLE_LOSSES)}; targets: {', '.join(ALIAS_TARGETS)}.",
    )

    @property
    def loss_aliases(self) -> dict[str, str]:
        """`loss_alias` as a mapping, unserved name -> served loss (checked by `_check_loss_alias`)."""
        return dict(entry.split("=", 1) for entry in self.loss_alias)

    @model_validator(mode="after")
    def _check_loss_alias(self) -> "GatewaySettings":
        seen = set()
        for entry in self.loss_alias:
            name, _, target = entry.partition("=")
            if name not in ALIASABLE_LOSSES or target not in ALIAS_TARGETS:
                raise ValueError(
                    f"loss_alias: {entry!r} is not NAME=TARGET with NAME one of {', '.join(ALIASABLE_LOSSES)} and TARGET "
                    f"one of {', '.join(ALIAS_TARGETS)} (the served losses that take a stable_reinforce datum's inputs)"
                )
            if name in seen:
                raise ValueError(f"loss_alias: {name} is mapped twice; give it one target")
            seen.add(name)
        return self

    @model_validator(mode="after")
    def _load_keys(self) -> "GatewaySettings":
        if self.api_keys_file is not None:
            self.api_keys = {**read_keys_file(self.api_keys_file), **self.api_keys}
        bad = [k for k in self.api_keys if not k.startswith(KEY_PREFIX)]
        if bad:
            shown = ", ".join(f"{k[:8]}..." for k in bad)
            raise ValueError(
                f"api_keys: every key must start with {KEY_PREFIX!r} (the Tinker SDK rejects others); got {shown}"
            )
        return self


def read_keys_file(path: Path) -> dict[str, str]:
    """The `keys` table of a TOML or JSON file (a bare top-level mapping is accepted too)."""
    text = Path(path).read_text()
    data = json.loads(text) if Path(path).suffix == ".json" else tomllib.loads(text)
    keys = data.get("keys", data)
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ValueError(f'api_keys_file: {path} must hold a table `keys` of "tml-..." = "owner" strings')
    return keys
