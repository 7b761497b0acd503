"""The blob store protocol: the few object-store operations the checkpoint store needs.

Keys are '/'-separated relative paths. Every implementation (one file each: `local_store.py`,
`s3_store.py`) passes the same contract tests. A missing key raises `FileNotFoundError`; an
unreachable or refusing backend raises `StorageError`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from treadle.errors import InvalidRequestError
from treadle.storage.local_store import LocalDirStore
from treadle.storage.s3_store import S3Settings, S3Store


@runtime_checkable
class BlobStore(Protocol):
    url: str
    """Where the store lives (`file:///dir` or `s3://bucket/prefix`), for messages and logs."""

    def check(self) -> None:
        """Prove at start-up that the store is reachable and writable; raise StorageError within seconds if not."""

    def put_file(self, local_path: str, key: str) -> None:
        """Upload a local file; a reader never sees a partly written object under `key`."""

    def get_file(self, key: str, local_path: str) -> None:
        """Download `key` into `local_path` (parent directories are created)."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store a small object (JSON) in one request."""

    def get_bytes(self, key: str) -> bytes:
        """Read a small object whole."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted."""

    def list_dirs(self, prefix: str) -> list[str]:
        """The names of the 'directories' directly under `prefix` (which ends with '/'), sorted."""

    def delete(self, key: str) -> None:
        """Delete one key; a missing key is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with `prefix`; returns how many."""


def open_blob_store(url: str, s3: S3Settings | None = None) -> BlobStore:
    """A store for `file:///dir` or `s3://bucket/prefix`. Does no I/O: call `check()` at start-up."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "file" and rest:
        return LocalDirStore(rest)
    if sep and scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if bucket:
            return S3Store(bucket, prefix, s3)
    raise InvalidRequestError(f"checkpoint store url {url!r} must be file:///<directory> or s3://<bucket>[/<prefix>]")
