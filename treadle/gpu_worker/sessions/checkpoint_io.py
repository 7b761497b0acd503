"""Moving checkpoints between the store and an engine: a training state into a session, a sampler in."""

from __future__ import annotations

import tempfile

from treadle.errors import InvalidRequestError
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.manifest import Manifest
from treadle.storage.paths import CheckpointPath


def load_checkpoint(engine, store: CheckpointStore, session_id: str, path: str, with_optimizer: bool) -> Manifest:
    """Create (or replace) the session on `engine` from a save_state checkpoint; returns its manifest."""
    cpath = CheckpointPath.parse(path)
    if cpath.kind != "weights":
        raise InvalidRequestError(
            f"path: {path} is a sampler checkpoint; load_state needs a .../weights/<name> path (save_state's)"
        )
    with tempfile.TemporaryDirectory(prefix="treadle-load-") as tmp:
        manifest = store.load(cpath, tmp)
        engine.load_state(session_id, tmp, with_optimizer=with_optimizer)
    return manifest


def load_sampler(engine, store: CheckpointStore, sampler_id: str) -> None:
    """Load a sampler checkpoint (a PEFT adapter directory) into `engine` under `sampler_id`."""
    with tempfile.TemporaryDirectory(prefix="treadle-sampler-") as tmp:
        store.load(CheckpointPath.parse(sampler_id), tmp)
        engine.load_sampler(sampler_id, tmp)
