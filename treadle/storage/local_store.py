"""`file:///dir`: a blob store in a local directory (the default backend, and the one a laptop needs).

Each write goes to a temporary file under `<root>/.incoming/`, is fsynced, then renamed onto its key, so
a crash never leaves a half-written file under a real name and readers see old or new bytes, never a mix.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from treadle.errors import StorageError

INCOMING_DIR = ".incoming"


class LocalDirStore:
    def __init__(self, root: str):
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"

    # -- keys ----------------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == INCOMING_DIR:
            raise StorageError(f"key {key!r} is not a relative path of plain components inside {self.url}")
        return self.root.joinpath(*parts)

    def _incoming(self) -> Path:
        incoming = self.root / INCOMING_DIR
        incoming.mkdir(parents=True, exist_ok=True)
        return incoming / uuid.uuid4().hex

    # -- protocol ------------------------------------------------------------------------------------
    def check(self) -> None:
        try:
            probe = self._incoming()
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"local checkpoint directory {self.root} is not writable: {exc}") from exc

    def _publish(self, tmp: Path, key: str) -> None:
        """fsync the finished temporary file and rename it onto its key."""
        target = self._path(key)
        with open(tmp, "rb") as done:
            os.fsync(done.fileno())
        for _ in range(3):  # a concurrent delete may prune the empty parent between mkdir and rename
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, target)
                return
            except FileNotFoundError:
                continue
        raise StorageError(f"could not create the directory of key {key!r} in {self.url}")

    def put_file(self, local_path: str, key: str) -> None:
        tmp = self._incoming()
        try:
            shutil.copyfile(local_path, tmp)
            self._publish(tmp, key)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        tmp = self._incoming()
        try:
            tmp.write_bytes(data)
            self._publish(tmp, key)
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, local_path: str) -> None:
        source = self._path(key)
        target = Path(local_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
        try:
            shutil.copyfile(source, partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        # Walk the deepest directory the prefix names, then filter by the prefix as a plain string (S3 semantics).
        base = self.root.joinpath(*prefix.split("/")[:-1]) if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            if Path(dirpath) == self.root and INCOMING_DIR in dirnames:
                dirnames.remove(INCOMING_DIR)
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for filename in filenames:
                key = filename if rel == "." else f"{rel}/{filename}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_dirs(self, prefix: str) -> list[str]:
        base = self.root.joinpath(*prefix.strip("/").split("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        return sorted(
            p.name for p in base.iterdir() if p.is_dir() and not (base == self.root and p.name == INCOMING_DIR)
        )

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        self._prune_empty_parents(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    def _prune_empty_parents(self, directory: Path) -> None:
        """Remove directories left empty, so that deleted runs and checkpoints stop being listed (as on S3)."""
        while directory != self.root and directory.is_relative_to(self.root):
            try:
                directory.rmdir()
            except OSError:  # not empty (or already gone)
                return
            directory = directory.parent
