"""Shared pytest set-up. Fixtures live one area a file in tests/fixtures/ and are all registered here."""

import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    f"tests.fixtures.{p.stem}"
    for p in sorted((pathlib.Path(__file__).parent / "fixtures").glob("*.py"))
    if p.stem != "__init__"
]
