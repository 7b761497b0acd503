"""A batch run's output, kept as numbered segments in a blob store (a local directory or S3).

The runner reads the command's stdout and stderr (one pipe) on a thread and writes what arrived since
the last flush as one object, `batch-runs/<name>/logs/<attempt>-<segment>.log`, every few seconds and
when the attempt ends. Objects are written whole, so a reader never sees a torn segment, and the keys
sort in output order across attempts, restarts and runners. A runner that dies loses at most the
output of one flush interval; everything flushed before is kept.

The readers at the end look into the run's own log directory (a recipe's metrics.jsonl and
checkpoints.jsonl), so that `treadle runs status` shows where the run stands.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable

from treadle.storage import BlobStore

PREFIX = "batch-runs"
TAIL_BYTES = 16_384
CHECKPOINTS_KEPT = 20


def log_prefix(name: str) -> str:
    return f"{PREFIX}/{name}/logs/"


def segment_key(name: str, attempt: int, segment: int) -> str:
    return f"{log_prefix(name)}{attempt:05d}-{segment:06d}.log"


def tail_lines(data: bytes, count: int) -> list[str]:
    """The last `count` lines of `data` (progress bars' carriage returns end lines too)."""
    return [line for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()][-count:]


class LogCapture:
    """One attempt's output: read from `pipe` on a thread, flushed to `store` as segments on demand."""

    def __init__(self, store: BlobStore, name: str, attempt: int, pipe, header: str = ""):
        self.store, self.name, self.attempt = store, name, attempt
        self._pipe = pipe
        self._lock = threading.Lock()
        self._pending = bytearray(header.encode())
        self._tail = bytearray()
        self._segment = 0
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self._pipe.read1(65_536), b""):
            with self._lock:
                self._pending += chunk
        self._pipe.close()

    def note(self, line: str) -> None:
        """Add a line of the runner's own to the attempt's output (why it stops the command, say)."""
        with self._lock:
            self._pending += line.encode()

    def flush(self) -> None:
        """Write the output that arrived since the last flush as the next segment (nothing if none)."""
        with self._lock:
            data, self._pending = bytes(self._pending), bytearray()
        if not data:
            return
        self.store.put_bytes(segment_key(self.name, self.attempt, self._segment), data)
        self._segment += 1
        self._tail = (self._tail + data)[-TAIL_BYTES:]

    def close(self, timeout: float = 10.0) -> None:
        """After the command exited: read to the end of the pipe (bounded: a grandchild may hold it) and flush."""
        self._reader.join(timeout)
        self.flush()

    def last_lines(self, count: int = 20) -> list[str]:
        return tail_lines(bytes(self._tail), count)


def read_segments(store: BlobStore, name: str, after: str = "") -> list[tuple[str, bytes]]:
    """Segments whose key sorts after `after`, in order, with their bytes."""
    return [(key, store.get_bytes(key)) for key in store.list(log_prefix(name)) if key > after]


def follow(
    store: BlobStore,
    name: str,
    is_live: Callable[[], bool],
    write: Callable[[bytes], None],
    poll_s: float = 0.5,
    timeout_s: float = 86_400.0,
) -> bool:
    """Write the run's log so far, then new segments as they appear, until the run has finished (and
    its last segments are written) or `timeout_s` passes. Returns True when the run finished."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        live = is_live()  # read before listing, so the segments listed next include the last ones
        for key, data in read_segments(store, name, last):
            write(data)
            last = key
        if not live:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


# -------------------------------------------------------------------- the run's own log_dir
def last_json_line(path: str, tail_bytes: int = 65_536) -> dict | None:
    """The last complete JSON line of a file (the writer may be in the middle of the next one)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    return None


def read_checkpoints(path: str) -> list[dict]:
    rows = []
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                rows.append({"step": row.get("step"), "state_path": row.get("state_path")})
    return rows[-CHECKPOINTS_KEPT:]
