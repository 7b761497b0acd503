"""Write docs/tinker-compatibility.md: which methods of the official `tinker` SDK and which tinker-cookbook
recipes run unchanged against treadle.

The SDK section: every public method called once, as tests/test_gateway_compat_report.py calls them, through a
gateway in front of a stack of its own (Redis and one worker on the tiny model, as the tests' shared stack);
the recipes section: the recipes tests/test_cookbook_matrix.py runs and those it does not. Each test fails
while its section of the committed page differs from what it computes.

    python scripts/report_compat.py        # about a minute on 2 cores
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's `tests` and `treadle`
os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")

from tests.fixtures.gateway import ALICE_KEY, gateway_settings  # noqa: E402
from tests.fixtures.stack import shared_stack  # noqa: E402
from tests.reports import COMPAT, compat_page  # noqa: E402
from tests.test_cookbook_matrix import render as render_recipes  # noqa: E402
from tests.test_gateway_compat_report import call_every_method, render as render_methods  # noqa: E402
from treadle.gateway.server import BackgroundGateway  # noqa: E402
from treadle.testing.tiny_model import build_tiny_model  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        model = build_tiny_model(Path(home) / "tiny", arch="llama", seed=0)
        with shared_stack(model, home) as stack, BackgroundGateway(gateway_settings(stack)) as gateway:
            os.environ.update(TINKER_BASE_URL=gateway.url, TINKER_API_KEY=ALICE_KEY)
            errors = call_every_method()
    COMPAT.write_text(compat_page(render_methods(errors), render_recipes()))
    print(f"wrote {COMPAT}")


if __name__ == "__main__":
    main()
