"""Acceptance: the cookbook's `recipes/rl_loop.py`, run with its own CLI and `loss_fn=gspo`, trains 2 steps
through the gateway, with only TINKER_BASE_URL and TINKER_API_KEY pointing it at treadle.

rl_loop is fixed to GSM8K from the Hub and to a model the cookbook knows (for its renderer). Offline, as
here, both come from the Hugging Face cache, as for any offline user: the test seeds that cache with a
local JSONL of GSM8K-shaped rows (as `openai/gsm8k`, config `main`) and with a tiny model under the name
`Qwen/Qwen3-8B-Base` (whose renderer, role_colon, needs no special tokens), and a worker serves that
name from the cache. The tiny model is first fine-tuned to answer `\\boxed{1}` or `\\boxed{2}` about
equally often, so that rewards (answer 1) differ within a group and rl_loop has advantages to train on.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.gateway import ALICE_KEY

MODEL = "Qwen/Qwen3-8B-Base"
REVISION = "0123456789abcdef0123456789abcdef01234567"
QUESTIONS = ["What is 1 times 1?", "What is 2 minus 1?", "What is 3 minus 2?", "What is 0 plus 1?"]
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
# rl_loop's one-shot example, which opens every prompt it builds.
PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b "
        "7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def _answer_one_or_two(tiny_model_dir: str, out: Path) -> None:
    """Fine-tune the tiny model on rl_loop's prompts: half the targets `\\boxed{1}`, half `\\boxed{2}`."""
    import torch
    from tinker_cookbook import renderers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    renderer = renderers.get_renderer("role_colon", tokenizer)
    examples = []
    for question in QUESTIONS:
        prompt = renderer.build_generation_prompt([*PREFIX, {"role": "user", "content": question + SUFFIX}]).to_ints()
        for digit in (1, 2):
            examples.append((prompt, tokenizer.encode(f" \\boxed{{{digit}}}\n\nUser:")))
    # One right-padded batch: causal attention never looks right, so the padding changes no target's logits.
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    for i, (prompt, target) in enumerate(examples):
        ids[i, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        labels[i, len(prompt) : len(prompt) + len(target)] = torch.tensor(target)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):  # measured: the digit ends near 50/50, every other target token above 0.75
        optimizer.zero_grad()
        logits = model(ids[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)).backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _seed_hf_cache(home: Path, model_dir: Path) -> None:
    """The HF cache an offline user would have: the model snapshot under MODEL, and GSM8K (here: our rows)."""
    repo = home / "hub" / f"models--{MODEL.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)

    rows = home / "gsm8k.jsonl"
    rows.write_text("".join(json.dumps({"question": q, "answer": f"{q} It is one.\n#### 1"}) + "\n" for q in QUESTIONS))
    # `datasets` prepares the JSONL into its Arrow cache layout; offline, load_dataset("openai/gsm8k", "main")
    # reads the cache directory of that name.
    import datasets

    datasets.load_dataset("json", data_files={"train": str(rows)}, cache_dir=str(home / "json-cache"))
    source = Path(glob.glob(str(home / "json-cache" / "json" / "*" / "*" / "*"))[0])
    target = home / "datasets" / "openai___gsm8k" / "main" / source.parent.name / source.name
    target.mkdir(parents=True)
    for path in source.iterdir():
        shutil.copy(path, target / path.name.replace("json-", "gsm8k-"))
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name="main", dataset_name="gsm8k", builder_name="gsm8k")
    (target / "dataset_info.json").write_text(json.dumps(info))


@pytest.fixture(scope="module")
def served(stack, gateway, tiny_model_dir, tmp_path_factory):
    """The HF cache, and a second worker serving MODEL from it (the shared stack's Redis and storage)."""
    home = tmp_path_factory.mktemp("hf-home")
    model_dir = tmp_path_factory.mktemp("boxed-model")
    _answer_one_or_two(tiny_model_dir, model_dir)
    _seed_hf_cache(home, model_dir)
    env = {**stack.env(), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = open(home / "worker.log", "wb")
    worker = subprocess.Popen(
        [*stack.worker_command, "--model", MODEL, "--lease_ttl_s", "3"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    from treadle.queue.ops_client import OpsClient

    ops = OpsClient(stack.broker_url)
    deadline = time.monotonic() + 180
    while not any(m.name == MODEL for m in ops.served_models()):
        assert worker.poll() is None and time.monotonic() < deadline, (home / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    yield home
    worker.terminate()
    worker.wait(timeout=60)
    log.close()


def test_rl_loop_cli_trains_two_gspo_steps(served, gateway, tmp_path):
    log_path = tmp_path / "rl"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HF_HOME": str(served),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TINKER_BASE_URL": gateway.url,
        "TINKER_API_KEY": ALICE_KEY,
    }
    args = [
        f"model_name={MODEL}",
        "loss_fn=gspo",
        "batch_size=2",
        "group_size=8",
        "max_tokens=12",
        "max_steps=2",
        "lora_rank=4",
        "save_every=0",
        "learning_rate=1e-3",
        f"log_path={log_path}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.rl_loop", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    rewards = [m["reward/total"] for m in metrics]
    assert all(0.0 < r < 1.0 for r in rewards), rewards  # both answers were sampled, so groups had advantages
    trained = [m for m in metrics if "step:max" in m]  # optim_step's metrics: a gspo step ran on that batch
    assert trained, metrics
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["name"] == "final" and saved[-1]["state_path"].startswith("tinker://")
