"""Issue 4's acceptance through the SDK and real worker processes, with checkpoints in a real S3 server.

One run is trained on a first worker process, which saves its state and a sampler snapshot to S3 and is
then stopped; a second worker process (same model) serves every later test, so anything it restores
really came back from the store. Bitwise comparisons hold on CPU with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams
from treadle.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    InvalidCheckpointNameError,
    StorageError,
)
from treadle.local_stack import free_port
from treadle.storage.manifest import hash_file
from treadle.storage.paths import CheckpointPath
from treadle.types import SampleResponse

ADAM = AdamParams(learning_rate=5e-3)
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3
PROMPT = ModelInput.from_ints([7, 19, 31, 43, 55, 67])
SEEDED = SamplingParams(max_tokens=8, seed=1234, temperature=1.0)
BAD_NAMES = ["../x", "a/b", "", "x" * 300, "bad\x00name", "new\nline", "..", "sp ace"]


def sft_batch(offset: int, n: int = 2, length: int = 16) -> list[Datum]:
    out = []
    for i in range(n):
        toks = [(offset * 7 + i * 13 + j * 3) % 250 + 5 for j in range(length + 1)]
        out.append(
            Datum(
                model_input=ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [0.0] * 3 + [1.0] * (length - 3)},
            )
        )
    return out


PROBE = sft_batch(99, n=1)


def train(tc, steps: range) -> list[float]:
    """Pipelined SFT steps (batch i at step i); the loss of each step, read at the end."""
    futures = []
    for i in steps:
        futures.append(tc.forward_backward(sft_batch(i), "cross_entropy"))
        tc.optim_step(ADAM)
    return [f.result(timeout=120).metrics["loss:sum"] for f in futures]


def probe_logprobs(tc) -> list[float]:
    return tc.forward(PROBE, "cross_entropy").result(timeout=60).loss_fn_outputs[0]["logprobs"].tolist()


def worker_pid(sc, session_id: str) -> int:
    record = sc.ops.session_info(session_id)
    return {w.hostname: w.pid for w in sc.ops.workers.live_workers()}[record.worker]


def replace_worker(stack, sc) -> int:
    """Stop the stack's worker process and start a fresh one serving the same models; returns its pid."""
    old = stack.workers.pop()
    old.terminate()
    old.wait(timeout=120)
    new = stack.start_worker()
    deadline = time.monotonic() + 180
    while new.pid not in [w.pid for w in sc.ops.workers.live_workers()]:
        assert new.poll() is None, f"the new worker exited with code {new.returncode}; see {stack.home}/logs/"
        assert time.monotonic() < deadline, "the new worker did not announce itself"
        time.sleep(0.2)
    return new.pid


@dataclass
class History:
    """What a run did on a worker process that no longer exists."""

    run_id: str
    state_path: str
    sampler_path: str
    old_worker_pid: int
    new_worker_pid: int
    losses_after_save: list[float]
    final_probe: list[float]
    sample_at_save: SampleResponse
    sample_after_training: SampleResponse


@pytest.fixture(scope="module")
def sc(s3_service_client):
    return s3_service_client


@pytest.fixture(scope="module")
def history(s3_stack, sc) -> History:
    """Train, save state and a sampler at step 3, train on; then replace the worker process."""
    tc = sc.create_lora_training_client("tiny", rank=8, seed=5)
    old_pid = worker_pid(sc, tc.session_id)
    train(tc, range(STEPS_BEFORE_SAVE))
    state_path = tc.save_state("mid").result(timeout=120).path
    sampler_path = tc.save_weights_for_sampler("at-save").result(timeout=120).path
    sampler = tc.create_sampling_client(sampler_path)
    sample_at_save = sampler.sample(PROMPT, 2, SEEDED).result(timeout=60)
    losses_after = train(tc, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE))
    final_probe = probe_logprobs(tc)
    sample_after = sampler.sample(PROMPT, 2, SEEDED).result(timeout=60)
    tc.stop()
    new_pid = replace_worker(s3_stack, sc)
    return History(
        tc.run_id, state_path, sampler_path, old_pid, new_pid, losses_after, final_probe, sample_at_save, sample_after
    )


# ------------------------------------------------------------------ resume-from-state


def test_resume_with_optimizer_on_a_new_worker_is_bit_identical(sc, history):
    assert history.state_path == f"treadle://{history.run_id}/weights/mid"
    # The original session was stopped: the new worker restores from the store, it does not adopt it.
    assert sc.ops.session_info(history.run_id).status == "stopped"
    tc = sc.create_training_client_from_state_with_optimizer(history.state_path)
    assert tc.session_id != history.run_id
    assert worker_pid(sc, tc.session_id) == history.new_worker_pid != history.old_worker_pid
    losses = train(tc, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE))
    assert losses == history.losses_after_save
    assert probe_logprobs(tc) == history.final_probe
    tc.stop()


def test_three_way_uninterrupted_equals_with_optimizer_differs_from_weights_only(sc, history):
    steps = range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    weights_only = sc.create_training_client_from_state(history.state_path)
    # The same spellings on an existing session: load_state replaces its adapter (and optimizer).
    loaded = sc.create_lora_training_client("tiny", rank=8, seed=77)
    loaded.load_state_with_optimizer(history.state_path)
    loaded_weights_only = sc.create_lora_training_client("tiny", rank=8, seed=78)
    loaded_weights_only.load_state(history.state_path)

    fresh_adam = train(weights_only, steps)
    assert train(loaded, steps) == history.losses_after_save
    assert train(loaded_weights_only, steps) == fresh_adam
    # Same weights at the save, so the first loss agrees; fresh Adam moments take a different step.
    assert fresh_adam[0] == history.losses_after_save[0]
    assert all(a != b for a, b in zip(fresh_adam[1:], history.losses_after_save[1:]))
    assert probe_logprobs(weights_only) != history.final_probe
    for tc in (weights_only, loaded, loaded_weights_only):
        tc.stop()


# ------------------------------------------------------------------ sampler snapshots


def test_sampler_snapshot_loaded_by_path_samples_what_it_sampled_at_save(sc, history):
    assert history.sample_after_training == history.sample_at_save  # frozen while training went on
    by_path = sc.create_sampling_client(model_path=history.sampler_path)
    assert by_path.get_base_model() == "tiny"
    assert by_path.sample(PROMPT, 2, SEEDED).result(timeout=120) == history.sample_at_save
    # The snapshot is not the base model: the same seed gives other logprobs there.
    base = sc.create_sampling_client(base_model="tiny").sample(PROMPT, 2, SEEDED).result(timeout=60)
    assert [s.logprobs for s in base.sequences] != [s.logprobs for s in history.sample_at_save.sequences]


# ------------------------------------------------------------------ export


def _logits(model, tokens: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _peft_model(base_dir: str, adapter_dir: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def test_exported_adapter_and_merged_model_give_the_workers_logits(sc, history, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    rest = sc.create_rest_client()
    adapter_dir = rest.export(history.state_path, str(tmp_path / "adapter"))
    merged_dir = rest.export(history.state_path, str(tmp_path / "merged"), merged=True)
    # vLLM's LoRA layout: exactly the adapter weights and their config.
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads(Path(adapter_dir, "adapter_config.json").read_text())["r"] == 8

    tokens = PROMPT.to_ints()
    adapter_logits = _logits(_peft_model(tiny_model_dir, adapter_dir), tokens)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, tokens), adapter_logits, atol=1e-4, rtol=0)
    assert Path(merged_dir, "tokenizer_config.json").exists()

    # The worker's own logprobs of the same weights (the sampler saved at the same step) agree.
    worker = sc.create_sampling_client(model_path=history.sampler_path).compute_logprobs(PROMPT).result(timeout=60)
    exported = torch.log_softmax(adapter_logits, -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert worker[0] is None
    torch.testing.assert_close(torch.tensor(worker[1:]), exported, atol=1e-4, rtol=0)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(), tokens)
    assert (base_logits - adapter_logits).abs().max() > 1e-3  # the adapter is really in the export


def test_save_weights_for_sampler_with_merge_weights(sc, tiny_model_dir, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    tc = sc.create_lora_training_client("tiny", rank=4, seed=9)
    train(tc, range(2))
    path = tc.save_weights_for_sampler("merged-snapshot", merge_weights=True).result(timeout=120).path
    assert path == f"treadle://{tc.run_id}/sampler_weights/merged-snapshot"
    downloaded = sc.create_rest_client().download(path, str(tmp_path / "ckpt"))
    tokens = PROMPT.to_ints()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(downloaded, "merged")).eval()
    adapter_logits = _logits(_peft_model(tiny_model_dir, downloaded), tokens)
    torch.testing.assert_close(_logits(merged, tokens), adapter_logits, atol=1e-4, rtol=0)

    # Exporting it merged takes the stored merged model: no base model is needed on the client's side.
    def no_merging_here(*args):
        raise AssertionError("export(merged=True) merged again instead of using the stored merged model")

    monkeypatch.setattr("treadle.storage.merged_export.export_merged", no_merging_here)
    rest = sc.create_rest_client()
    exported = rest.export(path, str(tmp_path / "export-merged"), merged=True)
    assert (Path(exported) / "tokenizer_config.json").exists()
    exported_model = AutoModelForCausalLM.from_pretrained(exported).eval()
    torch.testing.assert_close(_logits(exported_model, tokens), adapter_logits, atol=1e-4, rtol=0)
    assert sorted(os.listdir(rest.export(path, str(tmp_path / "export-adapter")))) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tc.stop()


# ------------------------------------------------------------------ integrity, names, overwrite


def _flip_byte(s3_server, storage_url: str, path: str, file_name: str) -> None:
    """Change one byte in the middle of a stored object, as bit rot or a bad copy would."""
    bucket, _, prefix = storage_url.removeprefix("s3://").partition("/")
    key = f"{prefix}/{CheckpointPath.parse(path).key_prefix}/{file_name}"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_flipped_byte_fails_load_state_and_from_state_naming_the_file(sc, s3_stack, s3_server, tmp_path):
    tc = sc.create_lora_training_client("tiny", rank=4, seed=21)
    train(tc, range(1))
    path = tc.save_state("to-corrupt").result(timeout=120).path
    before = probe_logprobs(tc)
    _flip_byte(s3_server, s3_stack.storage_url, path, "adapter_model.safetensors")

    with pytest.raises(IntegrityError, match=r"'adapter_model\.safetensors' of checkpoint .*to-corrupt is corrupt"):
        tc.load_state_with_optimizer(path).result(timeout=60)
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors"):
        sc.create_training_client_from_state_with_optimizer(path)
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors"):
        sc.create_rest_client().download(path, str(tmp_path / "dl"))
    assert probe_logprobs(tc) == before  # the failed load left the session as it was
    # The failed from_state leaves no half-made session behind for a caretaker to adopt.
    assert [r.session_id for r in sc.ops.sessions.all() if r.status == "active" and r.checkpoint == path] == []
    tc.stop()


def test_bad_names_and_paths_are_rejected_and_the_session_survives(sc):
    tc = sc.create_lora_training_client("tiny", rank=4, seed=3)
    before = probe_logprobs(tc)
    for name in BAD_NAMES:
        with pytest.raises(InvalidCheckpointNameError, match="name"):
            tc.save_state(name).result(timeout=60)
        with pytest.raises(InvalidCheckpointNameError, match="name"):
            tc.save_weights_for_sampler(name).result(timeout=60)
    for path in [
        "treadle://../weights/x",
        f"treadle://{tc.run_id}/weights/..",
        f"treadle://{tc.run_id}/other/x",
        f"s3://{tc.run_id}/weights/x",
        f"treadle://{tc.run_id}/weights/a/b",
    ]:
        with pytest.raises(InvalidCheckpointNameError):
            tc.load_state(path).result(timeout=60)
        with pytest.raises(InvalidCheckpointNameError):
            sc.create_training_client_from_state(path)
        with pytest.raises(InvalidCheckpointNameError):
            sc.create_sampling_client(model_path=path)
    with pytest.raises(CheckpointNotFoundError):
        tc.load_state(f"treadle://{tc.run_id}/weights/never-saved").result(timeout=60)
    assert probe_logprobs(tc) == before
    assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1
    tc.stop()


def test_overwrite_false_is_honoured_through_save_state(sc):
    tc = sc.create_lora_training_client("tiny", rank=4, seed=4)
    rest = sc.create_rest_client()
    path = tc.save_state("dup").result(timeout=60).path
    train(tc, range(1))
    with pytest.raises(CheckpointExistsError, match="dup"):
        tc.save_state("dup").result(timeout=60)
    assert rest.manifest(path).step == 0
    assert tc.save_state("dup", overwrite=True).result(timeout=60).path == path
    assert rest.manifest(path).step == 1
    tc.stop()


# ------------------------------------------------------------------ the CLI against S3


def test_checkpoints_cli_against_s3(sc, s3_stack, s3_env, history, tmp_path):
    env = {**os.environ, **s3_env, "TREADLE_STORAGE_URL": s3_stack.storage_url}

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "treadle.cli", "checkpoints", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    tc = sc.create_lora_training_client("tiny", rank=4, seed=6)
    short = tc.save_state("short-lived", ttl_seconds=1).result(timeout=60).path
    live = tc.save_state("long-lived", ttl_seconds=3600).result(timeout=60).path
    tc.stop()

    listed = cli("list")  # every run
    assert all(p in listed for p in (history.state_path, history.sampler_path, short, live))
    info = json.loads(cli("info", history.state_path))
    assert (info["base_model"], info["kind"], info["name"], info["step"]) == (
        "tiny",
        "weights",
        "mid",
        STEPS_BEFORE_SAVE,
    )

    downloaded = Path(cli("download", history.state_path, "--out", str(tmp_path / "dl")).strip())
    for name, entry in info["files"].items():
        assert hash_file(str(downloaded / name)).sha256 == entry["sha256"]
    adapter = Path(cli("export", history.state_path, "--out", str(tmp_path / "adapter")).strip())
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    rest = sc.create_rest_client()
    while rest.manifest(short).expires_at >= time.time():
        time.sleep(0.1)
    removed = cli("gc").split()
    assert short in removed and live not in removed
    assert [c.treadle_path for c in rest.list_checkpoints(tc.run_id)] == [live]

    assert cli("delete", live).strip() == f"deleted {live}"
    assert rest.list_checkpoints(tc.run_id) == []
    with pytest.raises(CheckpointNotFoundError):
        rest.manifest(live)


# ------------------------------------------------------------------ a misconfigured store


def test_worker_with_a_bad_s3_configuration_fails_at_start_up(sc, s3_stack, tiny_model_dir):
    """Wrong keys, or an endpoint nobody listens on: the worker exits with a StorageError that says so."""
    unreachable = f"http://127.0.0.1:{free_port()}"
    cases = {
        "wrong secret": ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, r"SignatureDoesNotMatch.*AWS_SECRET_ACCESS_KEY"),
        "unreachable endpoint": (
            {"AWS_ENDPOINT_URL": unreachable},
            rf"at {re.escape(unreachable)} failed: Could not connect",
        ),
    }
    command = [
        sys.executable,
        "-m",
        "treadle.cli",
        "worker",
        "--model",
        f"tiny={tiny_model_dir}",
        "--broker_url",
        s3_stack.broker_url,
        "--storage_url",
        s3_stack.storage_url,
    ]
    procs = {
        case: subprocess.Popen(
            command, env={**s3_stack.env(), **override}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for case, (override, _) in cases.items()
    }  # both at once: each spends most of its time importing torch
    for case, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode != 0, case
        last_line = stderr.strip().splitlines()[-1]
        assert last_line.startswith("treadle.errors.StorageError: S3 check"), (case, stderr[-2000:])
        assert re.search(cases[case][1], last_line), (case, last_line)
    assert [w.pid for w in sc.ops.workers.live_workers()] == [s3_stack.workers[-1].pid]  # neither announced itself


def test_client_with_wrong_credentials_fails_clearly(sc, s3_stack, monkeypatch):
    from treadle import ServiceClient

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match="SignatureDoesNotMatch.*AWS_SECRET_ACCESS_KEY"):
        ServiceClient(broker_url=s3_stack.broker_url, storage_url=s3_stack.storage_url).create_rest_client()
