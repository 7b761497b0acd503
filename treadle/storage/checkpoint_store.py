"""The checkpoint store: directories of files written by the engine, saved and loaded by path, verified.

Layout in the blob store:

    runs/<run_id>/run.json                       run metadata (base model, LoRA config, owner, ...)
    runs/<run_id>/<kind>/<name>/<files...>       the checkpoint's files, as the engine wrote them
    runs/<run_id>/<kind>/<name>/manifest.json    written last: a checkpoint without it does not exist

Saving uploads every file, then the manifest (sha256 and size of each file plus the metadata); loading
reads the manifest, downloads every file and verifies its hash. Files move several at a time, and each is
hashed while the others transfer. Nothing here imports torch: the files are opaque bytes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from treadle.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    InvalidRequestError,
)
from treadle.storage.blob_store import BlobStore, open_blob_store
from treadle.storage.manifest import MANIFEST_FILE, FileEntry, Manifest, hash_file
from treadle.storage.paths import KINDS, CheckpointPath, validate_run_id

RUN_INFO_FILE = "run.json"


def _as_path(path: CheckpointPath | str) -> CheckpointPath:
    return path if isinstance(path, CheckpointPath) else CheckpointPath.parse(path)


def _is_safe_relative(name: str) -> bool:
    """A manifest's file name must stay inside the checkpoint directory when loaded."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not name.startswith("/") and "\\" not in name and not {"..", "."} & set(parts)


class CheckpointStore:
    def __init__(self, blobs: BlobStore, parallel_files: int = 4):
        self.blobs = blobs
        self.parallel_files = parallel_files

    @classmethod
    def from_url(cls, url: str, check: bool = True) -> "CheckpointStore":
        """Open `file:///dir` or `s3://bucket/prefix`; by default `check()` it now, so that bad credentials or
        an unreachable endpoint fail at start-up (StorageError) rather than at the first checkpoint."""
        blobs = open_blob_store(url)
        if check:
            blobs.check()
        return cls(blobs)

    @property
    def url(self) -> str:
        return self.blobs.url

    @staticmethod
    def _manifest_key(path: CheckpointPath) -> str:
        return f"{path.key_prefix}/{MANIFEST_FILE}"

    # -- save ----------------------------------------------------------------------------------------
    def save(
        self,
        local_dir: str,
        path: CheckpointPath | str,
        *,
        base_model: str,
        lora_config: dict | None = None,
        step: int | None = None,
        applied_seq: int | None = None,
        ttl_seconds: int | None = None,
        user_metadata: dict | None = None,
        overwrite: bool = False,
        extra: dict | None = None,
    ) -> Manifest:
        """Upload every file of `local_dir` as checkpoint `path`, then its manifest."""
        path = _as_path(path)
        files = self._local_files(local_dir)
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise InvalidRequestError(f"ttl_seconds must be a positive number of seconds or None, got {ttl_seconds}")
        if self.exists(path):
            if not overwrite:
                raise CheckpointExistsError(
                    f"checkpoint {path} already exists in {self.url}; pass overwrite=True to replace it"
                )
            # Remove the manifest first: while the files are replaced, the checkpoint does not exist.
            self.blobs.delete(self._manifest_key(path))

        created_at = time.time()
        with ThreadPoolExecutor(self.parallel_files) as pool:
            hashes, uploads = {}, []
            for name in files:  # interleaved, so that hashing one file overlaps the transfer of another
                local = os.path.join(local_dir, name)
                hashes[name] = pool.submit(hash_file, local)
                uploads.append(pool.submit(self.blobs.put_file, local, f"{path.key_prefix}/{name}"))
            for upload in uploads:
                upload.result()
            entries: dict[str, FileEntry] = {name: future.result() for name, future in hashes.items()}

        manifest = Manifest(
            run_id=path.run_id,
            kind=path.kind,
            name=path.name,
            base_model=base_model,
            lora_config=lora_config,
            step=step,
            applied_seq=applied_seq,
            created_at=created_at,
            ttl_seconds=ttl_seconds,
            expires_at=None if ttl_seconds is None else created_at + ttl_seconds,
            user_metadata=user_metadata or {},
            extra=extra or {},
            files=entries,
        )
        self.blobs.put_bytes(self._manifest_key(path), manifest.model_dump_json(indent=2).encode())
        # Files of an older version of this checkpoint, or of a save that crashed, are not in the manifest.
        keep = {f"{path.key_prefix}/{name}" for name in files} | {self._manifest_key(path)}
        for key in self.blobs.list(path.key_prefix + "/"):
            if key not in keep:
                self.blobs.delete(key)
        return manifest

    @staticmethod
    def _local_files(local_dir: str) -> list[str]:
        """Relative POSIX paths of every file under local_dir, sorted."""
        root = Path(local_dir)
        if not root.is_dir():
            raise InvalidRequestError(f"local_dir {local_dir!r} is not a directory")
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        if not files:
            raise InvalidRequestError(f"local_dir {local_dir!r} holds no files: there is nothing to checkpoint")
        if MANIFEST_FILE in files:
            raise InvalidRequestError(
                f"local_dir {local_dir!r} holds a file named {MANIFEST_FILE!r}, a name the checkpoint store reserves"
            )
        return files

    # -- load ----------------------------------------------------------------------------------------
    def manifest(self, path: CheckpointPath | str) -> Manifest:
        path = _as_path(path)
        try:
            raw = self.blobs.get_bytes(self._manifest_key(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint {path} not found in {self.url}") from None
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as exc:
            raise IntegrityError(f"manifest of checkpoint {path} in {self.url} is unreadable: {exc}") from exc

    def load(self, path: CheckpointPath | str, local_dir: str) -> Manifest:
        """Download checkpoint `path` into `local_dir` and verify the sha256 and size of every file."""
        path = _as_path(path)
        manifest = self.manifest(path)
        for name in manifest.files:
            if not _is_safe_relative(name):
                raise IntegrityError(f"manifest of checkpoint {path} lists file {name!r}, outside its directory")
        os.makedirs(local_dir, exist_ok=True)
        with ThreadPoolExecutor(self.parallel_files) as pool:
            checks = [
                pool.submit(self._fetch_verified, path, name, entry, os.path.join(local_dir, name))
                for name, entry in manifest.files.items()
            ]
            for check in checks:
                check.result()
        return manifest

    def _fetch_verified(self, path: CheckpointPath, name: str, expected: FileEntry, local_path: str) -> None:
        try:
            self.blobs.get_file(f"{path.key_prefix}/{name}", local_path)
        except FileNotFoundError:
            raise IntegrityError(
                f"file {name!r} of checkpoint {path} is listed in its manifest but missing from {self.url}"
            ) from None
        actual = hash_file(local_path)
        if actual != expected:
            os.unlink(local_path)
            raise IntegrityError(
                f"file {name!r} of checkpoint {path} is corrupt: sha256 {actual.sha256} size {actual.size}, "
                f"manifest says sha256 {expected.sha256} size {expected.size}"
            )

    # -- catalogue -----------------------------------------------------------------------------------
    def exists(self, path: CheckpointPath | str) -> bool:
        return self.blobs.exists(self._manifest_key(_as_path(path)))

    def list_runs(self) -> list[str]:
        return self.blobs.list_dirs("runs/")

    def list_checkpoints(self, run_id: str) -> list[Manifest]:
        """Every complete checkpoint of a run, oldest first."""
        validate_run_id(run_id)
        manifests = []
        for kind in KINDS:
            for name in self.blobs.list_dirs(f"runs/{run_id}/{kind}/"):
                try:
                    manifests.append(self.manifest(CheckpointPath(run_id=run_id, kind=kind, name=name)))
                except CheckpointNotFoundError:
                    continue  # files without a manifest: a save in progress, or one that crashed
        return sorted(manifests, key=lambda m: m.created_at)

    def delete(self, path: CheckpointPath | str) -> None:
        path = _as_path(path)
        if not self.exists(path):
            raise CheckpointNotFoundError(f"checkpoint {path} not found in {self.url}")
        self.blobs.delete(self._manifest_key(path))  # first: from here on the checkpoint does not exist
        self.blobs.delete_prefix(path.key_prefix + "/")

    def gc(self, now: float | None = None) -> list[CheckpointPath]:
        """Delete every checkpoint whose TTL has run out; returns their paths."""
        now = time.time() if now is None else now
        removed = []
        for run_id in self.list_runs():
            for manifest in self.list_checkpoints(run_id):
                if manifest.is_expired(now):
                    try:
                        self.delete(manifest.path)
                    except CheckpointNotFoundError:
                        continue  # deleted meanwhile by someone else
                    removed.append(manifest.path)
        return removed

    # -- changes after the save ----------------------------------------------------------------------
    def file_key(self, path: CheckpointPath | str, name: str) -> str:
        """The blob key of one file of a checkpoint (for signed download URLs)."""
        return f"{_as_path(path).key_prefix}/{name}"

    def _rewrite_manifest(self, path: CheckpointPath | str, **changes) -> Manifest:
        path = _as_path(path)
        manifest = self.manifest(path).model_copy(update=changes)
        self.blobs.put_bytes(self._manifest_key(path), manifest.model_dump_json(indent=2).encode())
        return manifest

    def set_ttl(self, path: CheckpointPath | str, ttl_seconds: int | None, now: float | None = None) -> Manifest:
        """The checkpoint expires `ttl_seconds` from now (None: never)."""
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise InvalidRequestError(f"ttl_seconds must be a positive number of seconds or None, got {ttl_seconds}")
        now = time.time() if now is None else now
        return self._rewrite_manifest(
            path, ttl_seconds=ttl_seconds, expires_at=None if ttl_seconds is None else now + ttl_seconds
        )

    def set_public(self, path: CheckpointPath | str, public: bool) -> Manifest:
        return self._rewrite_manifest(path, public=public)

    def copy(
        self, source: CheckpointPath | str, dest: CheckpointPath | str, *, ttl_seconds: int | None = None
    ) -> Manifest:
        """A new checkpoint with the source's files (verified on the way) and metadata; never public."""
        with tempfile.TemporaryDirectory(prefix="treadle-copy-") as tmp:
            manifest = self.load(source, tmp)
            return self.save(
                tmp,
                dest,
                base_model=manifest.base_model,
                lora_config=manifest.lora_config,
                step=manifest.step,
                ttl_seconds=ttl_seconds,
                user_metadata=manifest.user_metadata,
                extra={**manifest.extra, "copied_from": _as_path(source).uri()},
            )

    # -- runs ----------------------------------------------------------------------------------------
    def put_run(self, run_id: str, info: dict) -> None:
        """Record a run's metadata (base model, LoRA config, created time, owner, user metadata)."""
        validate_run_id(run_id)
        self.blobs.put_bytes(f"runs/{run_id}/{RUN_INFO_FILE}", json.dumps(info, indent=2, sort_keys=True).encode())

    def get_run(self, run_id: str) -> dict | None:
        validate_run_id(run_id)
        try:
            return json.loads(self.blobs.get_bytes(f"runs/{run_id}/{RUN_INFO_FILE}"))
        except FileNotFoundError:
            return None
