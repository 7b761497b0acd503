"""The generated pages: docs/models.md and docs/tinker-compatibility.md.

A test module computes each page's content and checks that the committed page equals it; a script writes
it (`python scripts/report_models.py`, `python scripts/report_compat.py`) with the same functions, so a
test run never rewrites a tracked file. docs/tinker-compatibility.md holds two sections: the SDK's methods
(`tests/test_gateway_compat_report.py`) and, from COOKBOOK_SECTION on, the tinker-cookbook recipes
(`tests/test_cookbook_matrix.py`).
"""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODELS = DOCS / "models.md"
COMPAT = DOCS / "tinker-compatibility.md"
COOKBOOK_SECTION = "<!-- cookbook recipes: from tests/test_cookbook_matrix.py -->"


def compat_page(sdk: str, cookbook: str) -> str:
    """docs/tinker-compatibility.md from its two sections (`cookbook` starts with COOKBOOK_SECTION)."""
    return sdk.rstrip("\n") + "\n\n" + cookbook.rstrip("\n") + "\n"


def compat_sections(text: str) -> tuple[str, str]:
    """The SDK methods' section and the cookbook recipes' section (from its marker on) of the page's text."""
    sdk, marker, cookbook = text.partition(COOKBOOK_SECTION)
    return sdk.rstrip("\n"), (marker + cookbook).rstrip("\n")


def stale(page: Path, script: str) -> str:
    """The failure message of a committed page that differs from what its test computes."""
    return f"{page.relative_to(DOCS.parent)} is not what the tests compute: run `python {script}` and commit it"
