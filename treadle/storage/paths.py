"""Checkpoint paths (`treadle://<run_id>/<kind>/<name>`) and the rules for the names inside them.

Names become object keys and directory names, so the rules keep them to one safe path component:
no `/`, no `.` or `..`, no control characters, a bounded length. Tinker spells the same paths
`tinker://...`, and the official SDK sends them back unchanged, so both schemes parse.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from treadle.errors import InvalidCheckpointNameError

CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
KINDS: tuple[str, ...] = get_args(CheckpointKind)
SCHEMES = ("treadle", "tinker")
MAX_NAME_CHARS = 128

_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]+")
# Tinker model ids look like '<session>:train:0', and they name runs, so run ids may also hold ':'.
_RUN_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]+")


def _validate_component(value: object, field: str, allowed: re.Pattern, allowed_text: str) -> str:
    if not isinstance(value, str):
        raise InvalidCheckpointNameError(f"{field} must be a string, got {type(value).__name__} {value!r}")
    if not value:
        raise InvalidCheckpointNameError(f"{field} must not be empty (1 to {MAX_NAME_CHARS} characters)")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidCheckpointNameError(
            f"{field} is {len(value)} characters long, the limit is {MAX_NAME_CHARS}: {value[:40]!r}..."
        )
    if "/" in value:
        raise InvalidCheckpointNameError(f"{field} {value!r} must not contain '/'")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidCheckpointNameError(f"{field} {value!r} must not contain control characters")
    if value in (".", ".."):
        raise InvalidCheckpointNameError(f"{field} must not be {value!r}")
    if not allowed.fullmatch(value):
        raise InvalidCheckpointNameError(f"{field} {value!r} may contain only {allowed_text}")
    return value


def validate_name(name: str, field: str = "name") -> str:
    """A checkpoint name: 1..128 characters of [A-Za-z0-9._-], not '.' or '..'. Returns it unchanged."""
    return _validate_component(name, field, _NAME_CHARS, "letters, digits, '.', '_' and '-'")


def validate_run_id(run_id: str, field: str = "run_id") -> str:
    """A run id: like a name, and ':' is allowed too (Tinker model ids)."""
    return _validate_component(run_id, field, _RUN_ID_CHARS, "letters, digits, '.', '_', '-' and ':'")


class CheckpointPath(BaseModel):
    """Where a checkpoint lives: `treadle://<run_id>/<kind>/<name>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(description="The training run (session) the checkpoint belongs to.")
    kind: CheckpointKind = Field(
        description="'weights': full training state; 'sampler_weights': adapter only; "
        "'external_weights': an adapter exported for download (files maybe age-encrypted)."
    )
    name: str = Field(description="The checkpoint's name within the run and kind.")

    @field_validator("run_id", mode="before")
    @classmethod
    def _check_run_id(cls, value):
        return validate_run_id(value)

    @field_validator("kind", mode="before")
    @classmethod
    def _check_kind(cls, value):
        if value not in KINDS:
            raise InvalidCheckpointNameError(f"kind {value!r} must be one of {list(KINDS)}")
        return value

    @field_validator("name", mode="before")
    @classmethod
    def _check_name(cls, value):
        return validate_name(value)

    @classmethod
    def parse(cls, path: str) -> "CheckpointPath":
        """Parse `treadle://<run_id>/<kind>/<name>` (or the same with `tinker://`)."""
        if not isinstance(path, str):
            raise InvalidCheckpointNameError(f"path must be a string, got {type(path).__name__} {path!r}")
        scheme, sep, rest = path.partition("://")
        if not sep or scheme not in SCHEMES:
            raise InvalidCheckpointNameError(f"path {path!r} must start with one of {[s + '://' for s in SCHEMES]}")
        parts = rest.split("/")
        if len(parts) != 3:
            raise InvalidCheckpointNameError(
                f"path {path!r} must have the form {scheme}://<run_id>/<kind>/<name> (3 parts, got {len(parts)})"
            )
        return cls(run_id=parts[0], kind=parts[1], name=parts[2])

    def uri(self, scheme: str = "treadle") -> str:
        return f"{scheme}://{self.run_id}/{self.kind}/{self.name}"

    @property
    def key_prefix(self) -> str:
        """The store's directory for this checkpoint, without a trailing '/'."""
        return f"runs/{self.run_id}/{self.kind}/{self.name}"

    def __str__(self) -> str:
        return self.uri()
