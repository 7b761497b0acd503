"""Load a served model's tokenizer from the files its workers publish in Redis (no hub access)."""

from __future__ import annotations

import hashlib
import os

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

    directory = os.path.join(os.path.expanduser("~/.cache/treadle/tokenizers"), digest)
    os.makedirs(directory, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    _CACHE[digest] = AutoTokenizer.from_pretrained(directory)
    return _CACHE[digest]
