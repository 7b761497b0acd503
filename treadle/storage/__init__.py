"""Checkpoint storage: `treadle://<run>/<kind>/<name>` paths, manifests, and blob stores (local dir, S3)."""

from treadle.storage.blob_store import BlobStore, open_blob_store
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.local_store import LocalDirStore
from treadle.storage.manifest import FileEntry, Manifest
from treadle.storage.paths import CheckpointKind, CheckpointPath, validate_name, validate_run_id
from treadle.storage.s3_store import S3Settings, S3Store

__all__ = [
    "BlobStore",
    "CheckpointKind",
    "CheckpointPath",
    "CheckpointStore",
    "FileEntry",
    "LocalDirStore",
    "Manifest",
    "S3Settings",
    "S3Store",
    "open_blob_store",
    "validate_name",
    "validate_run_id",
]
