"""Checkpoint paths as a Tinker client sees them (`tinker://...`) and as treadle stores them (`treadle://...`).

Both name `<scheme>://<run_id>/<kind>/<name>`, and a run id is the Tinker model id
(`<session>:train:<n>`), so a path the gateway hands out is exactly the one hosted Tinker would,
and the mapping is exact both ways: only the scheme changes.
"""

from __future__ import annotations

from treadle.storage.paths import CheckpointPath


def parse_path(path: str) -> CheckpointPath:
    """A tinker:// or treadle:// checkpoint path; a malformed one raises a user error that names it."""
    return CheckpointPath.parse(path)


def to_tinker(path: str) -> str:
    return parse_path(path).uri("tinker")


def to_treadle(path: str) -> str:
    return parse_path(path).uri("treadle")
