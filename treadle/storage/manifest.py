"""The manifest: what a checkpoint is made of, written last so that its presence means "complete".

It records the sha256 and size of every file (verified on load), what the adapter was trained from
(base model, LoRA config), where training stood (step, applied seq), and when it expires.
"""

from __future__ import annotations

import hashlib
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, Field

from treadle.storage.paths import CheckpointKind, CheckpointPath

MANIFEST_FILE = "manifest.json"
HASH_CHUNK_BYTES = 1 << 20


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="ignore")

    sha256: str = Field(description="Hex sha256 of the file's bytes.")
    size: int = Field(description="File size in bytes.")


class Manifest(BaseModel):
    """A checkpoint's table of contents and metadata. Unknown fields are kept out, not refused (newer writers)."""

    model_config = ConfigDict(extra="ignore")

    format_version: int = Field(1, description="Manifest layout version.")
    run_id: str = Field(description="The run the checkpoint belongs to.")
    kind: CheckpointKind = Field(
        description="'weights' (training state), 'sampler_weights' or 'external_weights' (adapter only)."
    )
    name: str = Field(description="The checkpoint's name.")
    base_model: str = Field(description="Base model the adapter was trained on (HF id or path).")
    lora_config: dict | None = Field(None, description="LoRA config of the adapter (rank, alpha, targets...).")
    step: int | None = Field(None, description="Optimizer steps applied when the checkpoint was taken.")
    applied_seq: int | None = Field(None, description="Last op seq of the session applied to this state.")
    created_at: float = Field(description="Creation time, Unix seconds.")
    ttl_seconds: int | None = Field(None, description="Lifetime in seconds; None keeps it forever.")
    expires_at: float | None = Field(None, description="created_at + ttl_seconds, Unix seconds; None never expires.")
    user_metadata: dict = Field(default_factory=dict, description="Free-form metadata given by the user.")
    public: bool = Field(False, description="Published: readable (never writable) by every owner.")
    extra: dict = Field(default_factory=dict, description="Free-form metadata given by treadle (engine, RNG info...).")
    files: dict[str, FileEntry] = Field(default_factory=dict, description="Relative POSIX path -> hash and size.")

    @property
    def path(self) -> CheckpointPath:
        return CheckpointPath(run_id=self.run_id, kind=self.kind, name=self.name)

    @property
    def size_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


def hash_stream(stream: BinaryIO) -> FileEntry:
    """sha256 and size of a stream, read a chunk at a time (a large file is never held in memory)."""
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(HASH_CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return FileEntry(sha256=digest.hexdigest(), size=size)


def hash_file(path: str) -> FileEntry:
    with open(path, "rb") as stream:
        return hash_stream(stream)
