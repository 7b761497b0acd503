"""Write docs/models.md: the profile of every model family treadle serves, from a tiny random-init model of each.

Each family's tiny model (`treadle.testing.families` and `treadle.testing.vision_families`, no downloads) is
loaded as a worker loads it, and its profile (attention kinds, LoRA targets and parameter counts, sampler path,
vLLM, images) goes into the tables that `render` in tests/test_model_families.py makes; that test fails while
the committed page differs from it.
Nothing on the page depends on the machine that wrote it.

    python scripts/report_models.py        # about 10 s
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's `tests` and `treadle`
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.reports import MODELS  # noqa: E402
from tests.test_model_families import FAMILY_NAMES, VISION_NAMES, render  # noqa: E402
from treadle.gpu_worker.engine import Engine  # noqa: E402
from treadle.testing.tiny_model import build_tiny_model  # noqa: E402


def profile(root: str, arch: str):
    engine = Engine(build_tiny_model(Path(root) / arch, arch=arch, initializer_range=0.2), dtype="float32")
    try:
        return engine.profile
    finally:
        engine.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        profiles = {family: profile(root, family) for family in FAMILY_NAMES}
        vision = {arch: profile(root, arch) for arch in VISION_NAMES}
    MODELS.write_text(render(profiles, vision))
    print(f"wrote {MODELS}")


if __name__ == "__main__":
    main()
