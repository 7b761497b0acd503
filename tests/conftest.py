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

# The files that take longest, longest first (measured with `--durations`). `pytest -n 2 --dist loadfile` hands
# files to its processes in collection order, each taking the next when it is done: with the long files first, the
# short ones fill in at the end, and neither process runs a long file alone while the other idles.
LONGEST_FIRST = [
    "test_durability.py",
    "test_cookbook_matrix.py",
    "test_multi_device.py",
    "test_runs.py",
    "test_model_families.py",
    "test_static_decode.py",
    "test_durable_sampling.py",
    "test_sharded_groups.py",
    "test_recipes.py",
    "test_code_rl.py",
    "test_demo.py",
    "test_full_finetune.py",
    "test_operations_e2e.py",
    "test_vision_gateway.py",
    "test_recipe_resume.py",
    "test_sdk_backpressure.py",
    "test_wait_bounds.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays
