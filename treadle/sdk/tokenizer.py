"""Load a served model's tokenizer from the files its workers publish in Redis (no hub access)."""

from __future__ import annotations

import hashlib
import os
import tempfile

from treadle.errors import NoWorkerError

_CACHE: dict[str, object] = {}


def load_tokenizer(ops, base_model: str):
    files = ops.tokenizer_files(base_model)
    if not files:
        raise NoWorkerError(f"base_model: no worker has published a tokenizer for {base_model!r}")
    digest = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(files.items()))).hexdigest()[:16]
    if digest in _CACHE:
        return _CACHE[digest]
    from transformers import AutoTokenizer  # the client needs transformers only for this

    # A directory of this call's own, gone once loaded: one shared between client processes (a run and its
    # restarted attempt, two loops side by side) let a reader meet a file another process was rewriting, and a
    # truncated chat template renders every prompt empty.
    with tempfile.TemporaryDirectory(prefix="treadle-tokenizer-") as directory:
        for name, data in files.items():
            with open(os.path.join(directory, os.path.basename(name)), "wb") as f:
                f.write(data)
        _CACHE[digest] = AutoTokenizer.from_pretrained(directory)
    return _CACHE[digest]
