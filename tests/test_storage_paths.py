"""Checkpoint paths and name rules (no server needed)."""

import subprocess
import sys

import pytest

from treadle.errors import InvalidCheckpointNameError
from treadle.storage import CheckpointPath, validate_name, validate_run_id

BAD_NAMES = {
    "dotdot-slash": "../x",
    "slash": "a/b",
    "empty": "",
    "300-chars": "x" * 300,
    "nul": "a\x00b",
    "newline": "a\nb",
    "escape": "step\x1b[31m",
    "dot": ".",
    "dotdot": "..",
    "space": "a b",
    "colon": "a:b",
}


@pytest.mark.parametrize("name", BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_bad_names_are_rejected_with_the_field_named(name):
    with pytest.raises(InvalidCheckpointNameError, match="^name"):
        validate_name(name)
    with pytest.raises(InvalidCheckpointNameError):
        CheckpointPath(run_id="run", kind="weights", name=name)


def test_name_length_limit_is_128():
    assert validate_name("a" * 128) == "a" * 128
    with pytest.raises(InvalidCheckpointNameError, match="129 characters long, the limit is 128"):
        validate_name("a" * 129)


def test_run_ids_may_hold_colons_like_tinker_model_ids():
    assert validate_run_id("3f2a:train:0") == "3f2a:train:0"
    with pytest.raises(InvalidCheckpointNameError, match="^run_id"):
        validate_run_id("a/b")


@pytest.mark.parametrize("scheme", ["treadle", "tinker"])
def test_parse_and_uri_round_trip(scheme):
    path = CheckpointPath.parse(f"{scheme}://sess-1:train:0/sampler_weights/step-000010")
    assert (path.run_id, path.kind, path.name) == ("sess-1:train:0", "sampler_weights", "step-000010")
    assert path.uri() == "treadle://sess-1:train:0/sampler_weights/step-000010"
    assert path.uri("tinker") == "tinker://sess-1:train:0/sampler_weights/step-000010"
    assert path.key_prefix == "runs/sess-1:train:0/sampler_weights/step-000010"
    assert CheckpointPath.parse(path.uri()) == path


@pytest.mark.parametrize(
    "bad",
    [
        "s3://run/weights/a",  # wrong scheme
        "run/weights/a",  # no scheme
        "treadle://run/weights",  # too few parts
        "treadle://run/weights/a/b",  # a '/' in the name
        "treadle://run/weights/../x",  # traversal
        "treadle://run/optimizer/a",  # unknown kind
        "treadle:///weights/a",  # empty run id
    ],
)
def test_malformed_paths_are_rejected(bad):
    with pytest.raises(InvalidCheckpointNameError):
        CheckpointPath.parse(bad)


def test_paths_are_immutable_and_hashable():
    path = CheckpointPath.parse("treadle://r/weights/a")
    with pytest.raises(Exception):
        path.name = "b"
    assert {path, CheckpointPath.parse("tinker://r/weights/a")} == {path}


def test_storage_does_not_import_torch():
    code = "import sys, treadle.storage; assert 'torch' not in sys.modules, 'treadle.storage imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
