"""Shared pytest set-up. Fixtures live one area a file in tests/fixtures/ and are all registered here."""

import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test workers audit no sampled logprobs (treadle.gpu_worker.sampling.logprob_audit) unless a test asks for it.
os.environ.setdefault("TREADLE_WORKER_LOGPROB_AUDIT_FRACTION", "0")

pytest_plugins = [
    f"tests.fixtures.{p.stem}"
    for p in sorted((pathlib.Path(__file__).parent / "fixtures").glob("*.py"))
    if p.stem != "__init__"
]
