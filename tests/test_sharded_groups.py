"""Sharded device groups (`treadle worker --devices N --shard`): the base weights FSDP2-sharded over CPU ranks
(gloo), through the real local stack, train, sample and move checkpoints like one device.

Two groups, each serving the llama, qwen3_moe and gpt_oss tiny models at once: 2 ranks on one host, then
4 ranks on two simulated hosts (two `treadle worker` processes, `--nnodes 2 --node_rank 0|1`). Every
comparison is against one in-process engine per family (what a one-device worker runs). The group sums shard
losses and gradients in another order than one device, so they agree to float rounding (1e-5), not bitwise.
Micro-batches of 64 tokens and batches of uneven lengths (one of a single datum) give the ranks different
numbers of micro-batches, which a sharded group must run in lockstep (treadle.gpu_worker.parallel.lockstep).
The 2-rank group also holds a full fine-tuning session sharded over its ranks, and samples its snapshot.
"""

from __future__ import annotations

import os
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from tests.test_durability import adapter_of, assert_same_adapter, owner_process
from tests.test_multi_device import alive, followers, wait_until
from tests.test_multi_device import batch as multi_device_batch
from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.gpu_worker.executor.sample_requests import MAX_CACHED_SAMPLERS
from treadle.gpu_worker.model.fit import plan
from treadle.gpu_worker.model.full_weights import bytes_per_parameter
from treadle.local_stack import LocalStack
from treadle.sdk.training_client import TrainingClient
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.testing.tiny_model import build_tiny_model
from treadle.errors import InsufficientMemoryError
from treadle.types import FullConfig, LoraConfig

FAMILIES = ("llama", "qwen3_moe", "gpt_oss")
SEED = 11
ADAM = AdamParams(learning_rate=5e-3, grad_clip_norm=0.5)
TOL = 1e-5
STEPS = 10
SIZES = ((9, 13, 17, 21), (15,), (40, 30, 30, 6))
GROUP_ARGS = ["--shard", "--max_tokens_per_microbatch", "64"]


def batch(step: int) -> tuple[list[Datum], str]:
    """test_multi_device's batches (cross-entropy on even steps, importance sampling on odd ones) over
    `SIZES[step % 3]`."""
    return multi_device_batch(step, SIZES[step % 3])


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOL * max(1.0, abs(y)) for x, y in zip(a, b))


def assert_close_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=TOL), (k, (a[k] - b[k]).abs().max().item())


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    return {f: build_tiny_model(tmp_path_factory.mktemp(f"shard-{f}"), arch=f, seed=0) for f in FAMILIES}


@pytest.fixture(scope="module")
def stack(family_dirs, tmp_path_factory):
    os.environ["OMP_NUM_THREADS"] = "1"
    s = LocalStack(
        [f"{f}={d}" for f, d in family_dirs.items()],
        home=str(tmp_path_factory.mktemp("sharded")),
        workers=0,
        worker_args=["--lease_ttl_s", "2"],
    )
    s.start()
    s.models_dirs = list(family_dirs.values())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sc(stack):
    return ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)


class Reference:
    """One in-process engine per family: the one-device runs to compare with."""

    def __init__(self, family_dirs: dict[str, str]):
        from treadle.gpu_worker.engine import Engine

        torch.set_num_threads(1)
        self.engines = {f: Engine(d) for f, d in family_dirs.items()}

    def run(self, family: str, session: str, steps: range) -> list[float]:
        engine, losses = self.engines[family], []
        for step in steps:
            data, loss_fn = batch(step)
            losses.append(engine.forward_backward(session, data, loss_fn).metrics["loss:sum"])
            engine.optim_step(session, ADAM)
        return losses

    def adapter(self, family: str, session: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            self.engines[family].save_state(session, tmp)
            return load_file(os.path.join(tmp, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def ref(family_dirs):
    return Reference(family_dirs)


def train(tc, steps: range) -> list[float]:
    futures = []
    for step in steps:
        data, loss_fn = batch(step)
        futures.append(tc.forward_backward(data, loss_fn))
        tc.optim_step(ADAM)
    return [f.result(timeout=300).metrics["loss:sum"] for f in futures]


@dataclass
class Run:
    """A family's uninterrupted run on a group: its client, losses and the checkpoint saved after them."""

    tc: TrainingClient
    losses: list[float]
    final: str


def check_like_one_device(sc: ServiceClient, ref: Reference, tag: str) -> dict[str, Run]:
    """Every family: 10 steps of CE and IS, the final adapter, seeded samples and prompt logprobs, against one
    device. Returns each family's run."""
    runs = {}
    prompt = ModelInput.from_ints(list(range(5, 25)))
    params = SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    for family in FAMILIES:
        tc = sc.create_lora_training_client(family, rank=8, seed=SEED)
        losses = train(tc, range(STEPS))
        session = f"{tag}-{family}"
        ref.engines[family].create_session(session, LoraConfig(rank=8, seed=SEED))
        assert close(losses, ref.run(family, session, range(STEPS))), family
        final = tc.save_state(f"{tag}-final").result(timeout=60).path
        assert_close_adapter(adapter_of(sc, final), ref.adapter(family, session))
        sampler = tc.save_weights_and_get_sampling_client(f"{tag}-s")
        ref.engines[family].snapshot_sampler(session, f"{tag}-s")
        got = sampler.sample(prompt, 2, params).result(timeout=120).sequences
        want = ref.engines[family].samplers.sample(f"{tag}-s", prompt, 2, params).sequences
        assert [s.tokens for s in got] == [s.tokens for s in want], family
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, rel=0, abs=TOL), family
        assert sampler.compute_logprobs(prompt).result(timeout=60)[1:] == pytest.approx(
            ref.engines[family].samplers.compute_logprobs(f"{tag}-s", prompt)[1:], rel=0, abs=TOL
        )
        runs[family] = Run(tc, losses, final)
    return runs


_BYTES = re.compile(
    r"rank (\d+) (loaded (\S+)|(\S+) after the first step): base parameters on this rank (\d+) B of (\d+) B, "
    r"largest unit gathered at once (\d+) B"
)


def assert_memory_logged(stack: LocalStack, ranks: int) -> None:
    """Each rank logs its base-parameter bytes at load and after its first step: 1/N of the whole model's (dim 0
    of a weight splits into N shards, the first ones of ceil(dim 0 / N) rows), rank 0's exactly what the
    pre-flight (`treadle models check --shard`) computes from the config alone."""
    lines = []
    for name in os.listdir(os.path.join(stack.home, "logs")):
        with open(os.path.join(stack.home, "logs", name)) as f:
            lines += [m.groups() for m in map(_BYTES.search, f) if m]
    seen = {(path or after, int(rank), when.startswith("loaded")) for rank, when, path, after, *_ in lines}
    want = {(d, r, w) for d in stack.models_dirs for r in range(ranks) for w in (True, False)}
    assert want <= seen, want - seen
    for rank, _when, path, after, local, whole, largest in lines:
        assert abs(int(local) - int(whole) / ranks) <= 0.02 * int(whole) / ranks, (local, whole, ranks)
        assert 0 < int(largest) < int(whole)
        if rank == "0":
            fit = plan(path or after, devices=ranks, shard=True, memory_gb=1.0, dtype="float32")
            assert int(local) == fit.weights


def stop_workers(stack: LocalStack) -> None:
    for proc in list(stack.workers):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        stack.workers.remove(proc)


@dataclass
class FullNeed:
    """What one device's admission counts for a full session of the tiny llama (fp32): its state and one
    micro-batch's activations, and the group's `--full_session_memory`, where it fits only sharded."""

    state: int
    activations: int

    @property
    def limit(self) -> int:
        return self.activations + 7 * self.state // 8


@pytest.fixture(scope="module")
def two_ranks(stack, ref) -> FullNeed:
    """A group of two sharded ranks, with full sessions' memory limited (`FullNeed.limit`)."""
    from treadle.gpu_worker.model.host import activation_bytes_per_token

    host = ref.engines["llama"]._host
    need = FullNeed(
        state=ref.engines["llama"].full_memory.session_bytes(FullConfig()),
        activations=int(64 * activation_bytes_per_token(host.model.config, host.dtype)),
    )
    stack.start_worker(["--devices", "2", *GROUP_ARGS, "--full_session_memory", str(need.limit)])
    stack.wait_for_workers(1, 300)
    return need


def test_a_two_rank_sharded_group_trains_and_samples_like_one_device(stack, sc, ref, two_ranks):
    check_like_one_device(sc, ref, "two")
    assert_memory_logged(stack, 2)


def full_steps(tc: TrainingClient, engine, session: str, steps: range) -> None:
    """The steps on the group and on one device: the same losses and (clipped) grad norms."""
    for step in steps:
        data, loss_fn = batch(step)
        got = (tc.forward_backward(data, loss_fn), tc.optim_step(ADAM))
        loss = engine.forward_backward(session, data, loss_fn).metrics["loss:sum"]
        norm = engine.optim_step(session, ADAM).metrics["grad_norm:mean"]
        assert close([got[0].result(timeout=120).metrics["loss:sum"]], [loss]), step
        assert close([got[1].result(timeout=120).metrics["grad_norm:mean"]], [norm]), step


def full_state(sc: ServiceClient, path: str) -> tuple[list[str], dict, dict]:
    """A full session's checkpoint: its files, its weights and its optimizer state."""
    with tempfile.TemporaryDirectory() as tmp:
        sc.create_rest_client().download(path, tmp)
        weights, optimizer = (load_file(os.path.join(tmp, f"{n}.safetensors")) for n in ("model", "optimizer"))
        return sorted(os.listdir(tmp)), weights, optimizer


def test_a_full_session_on_a_sharded_group_holds_its_shards_trains_and_samples_like_one_device(
    stack, sc, ref, two_ranks
):
    """A full session on the two sharded ranks holds half its state on each: admitted under a limit that one
    device's session exceeds, a second one beside it refused with its bytes per rank against the bytes free. It
    trains like one device, saves the model directory one device saves, and resumes from it exactly on the group
    and on one device. LoRA sessions and the base model's samples after its ops are one device's. Its sampler
    snapshot samples with the session's weights (`check_full_snapshot`)."""
    engine = ref.engines["llama"]
    tc = sc.create_full_training_client("llama")
    held = sc.ops.session_info(tc.session_id).memory_bytes
    assert two_ranks.state + two_ranks.activations > two_ranks.limit
    # A rank's bytes a parameter count, beside the 16 B of state, the base shards an op keeps aside and the gradient
    # FSDP reduces into them: half the parameters' state on each rank.
    per_rank = held / bytes_per_parameter(torch.float32, sharded=True)
    whole = two_ranks.state / bytes_per_parameter(torch.float32, sharded=False)
    assert abs(per_rank - whole / 2) <= 0.02 * whole / 2, (per_rank, whole)
    with pytest.raises(InsufficientMemoryError) as refused:
        sc.create_full_training_client("llama")
    assert f"needs {held + two_ranks.activations} bytes per rank" in str(refused.value)
    assert f"{two_ranks.limit - held} bytes are free" in str(refused.value)

    engine.create_session("full", LoraConfig(rank=8, seed=SEED), full=FullConfig())
    full_steps(tc, engine, "full", range(4))
    data, loss_fn = batch(4)  # a forward alone: the same loss, no gradient kept
    got = tc.forward(data, loss_fn).result(timeout=120).metrics["loss:sum"]
    assert close([got], [engine.forward("full", data, loss_fn).metrics["loss:sum"]])
    path = tc.save_state("full-4").result(timeout=120).path
    files, weights, moments = full_state(sc, path)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("full", tmp)
        assert files == sorted(os.listdir(tmp))
        assert_close_adapter(weights, load_file(os.path.join(tmp, "model.safetensors")))
        assert_close_adapter(moments, load_file(os.path.join(tmp, "optimizer.safetensors")))
    # The base weights are the base's again: a LoRA session and the base model's samples are one device's.
    lora = sc.create_lora_training_client("llama", rank=8, seed=SEED)
    engine.create_session("after-full", LoraConfig(rank=8, seed=SEED))
    assert close(train(lora, range(2)), ref.run("llama", "after-full", range(2)))
    prompt, params = ModelInput.from_ints(list(range(5, 25))), SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    got = sc.create_sampling_client(base_model="llama").sample(prompt, 2, params).result(timeout=120).sequences
    assert [s.tokens for s in got] == [s.tokens for s in engine.samplers.sample(None, prompt, 2, params).sequences]

    # The group's checkpoint resumes exactly on the group and on one device.
    tc.stop()
    resumed = sc.create_training_client_from_state_with_optimizer(path)
    with tempfile.TemporaryDirectory() as tmp:
        sc.create_rest_client().download(path, tmp)
        engine.load_state("full-resumed", tmp, with_optimizer=True)
    full_steps(resumed, engine, "full-resumed", range(4, 6))
    _, weights, _ = full_state(sc, resumed.save_state("full-6").result(timeout=120).path)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("full-resumed", tmp)
        assert_close_adapter(weights, load_file(os.path.join(tmp, "model.safetensors")))
    check_full_snapshot(stack, sc, resumed, engine, "full-resumed", two_ranks.limit)


def check_full_snapshot(
    stack: LocalStack, sc: ServiceClient, tc: TrainingClient, engine, session: str, limit: int
) -> None:
    """A full session's sampler snapshot on the sharded group: each rank swaps its shards of it into the base
    weights' for every forward rank 0 samples with it. Its seeded samples' logprobs are the session's forward of the
    same tokens (which the base model's are not), the base model's samples (asked beside them, and after) are one
    device's, its stored directory holds the session's weights, and one device's snapshot of the same session
    loaded from storage samples on the group as on one device. Admission counts each snapshot's bytes per rank, and
    the sampler cache's drop of a full snapshot frees them."""
    prompt, params = ModelInput.from_ints(list(range(5, 25))), SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    base = sc.create_sampling_client(base_model="llama")
    want_base = [s.tokens for s in engine.samplers.sample(None, prompt, 2, params).sequences]
    sampler = tc.save_weights_and_get_sampling_client("full-s")
    futures = sampler.sample(prompt, 2, params), base.sample(prompt, 2, params)  # in one batch if they meet
    got, beside = (f.result(timeout=120).sequences for f in futures)
    for seq in got:
        tokens = prompt.to_ints() + seq.tokens
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        trained = tc.forward([datum], "cross_entropy").result(timeout=120).loss_fn_outputs[0]["logprobs"].to_numpy()
        trained = trained[len(prompt.to_ints()) - 1 :].tolist()
        assert seq.logprobs == pytest.approx(trained, rel=0, abs=TOL)
        untrained = base.compute_logprobs(ModelInput.from_ints(tokens)).result(timeout=60)[len(prompt.to_ints()) :]
        assert max(abs(a - b) for a, b in zip(untrained, trained)) > 100 * TOL  # the check above has teeth
    assert [s.tokens for s in beside] == want_base
    assert [s.tokens for s in base.sample(prompt, 2, params).result(timeout=120).sequences] == want_base

    engine.snapshot_sampler(session, "one-device")
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_sampler_weights("one-device", tmp)
        with tempfile.TemporaryDirectory() as stored:
            sc.create_rest_client().download(sampler.model_path, stored)
            assert_close_adapter(*(load_file(os.path.join(d, "model.safetensors")) for d in (stored, tmp)))
        path = "treadle://from-one/sampler_weights/full"
        extra = {"full_config": FullConfig().model_dump()}
        CheckpointStore.from_url(stack.storage_url).save(tmp, path, base_model="llama", extra=extra)
    loaded = sc.create_sampling_client(model_path=path).sample(prompt, 2, params).result(timeout=120).sequences
    want = engine.samplers.sample("one-device", prompt, 2, params).sequences
    assert [s.tokens for s in loaded] == [s.tokens for s in want]
    for g, w in zip(loaded, want):
        assert g.logprobs == pytest.approx(w.logprobs, rel=0, abs=TOL)

    # Snapshots fit until the limit (two are held: "full-s" and the loaded one), the next is refused.
    held = sc.ops.session_info(tc.session_id).memory_bytes
    snapshot = held * 4 // bytes_per_parameter(torch.float32, sharded=True)  # fp32 weights of a rank's shards
    free = limit - held - 2 * snapshot
    for i in range(free // snapshot):
        tc.save_weights_for_sampler(f"fits-{i}").result(timeout=60)
    with pytest.raises(InsufficientMemoryError) as refused:
        tc.save_weights_for_sampler("over").result(timeout=60)
    assert f"needs {snapshot} bytes per rank" in str(refused.value)
    assert f"{free % snapshot} bytes are free" in str(refused.value)
    # The cache drops the oldest samplers as LoRA snapshots come: once "full-s" goes, a full snapshot fits again,
    # and samples what "full-s" sampled.
    lora = sc.create_lora_training_client("llama", rank=4, seed=SEED)
    for i in range(MAX_CACHED_SAMPLERS):
        lora.save_weights_for_sampler(f"evict-{i}").result(timeout=60)
        try:
            again = tc.save_weights_and_get_sampling_client("after-drop")
            break
        except InsufficientMemoryError:
            continue
    else:
        raise AssertionError("no full snapshot fits after the sampler cache dropped every older one")
    assert [s.tokens for s in again.sample(prompt, 2, params).result(timeout=120).sequences] == [s.tokens for s in got]


def start_two_hosts(stack: LocalStack, sc: ServiceClient, port: str, host0_tmp: str) -> None:
    """One group of four sharded ranks: two `treadle worker` processes (hosts 0 and 1, two ranks each) meeting at
    `port`. Host 1 consumes nothing, and sees none of host 0's temporary files (where rank 0 downloads checkpoints):
    host 0's are in `host0_tmp`, and host 1 runs in a mount namespace of its own with an empty tmpfs over it."""
    across = ["--devices", "2", "--nnodes", "2", "--master_port", port, *GROUP_ARGS]
    command = stack.worker_command
    try:
        private = 'mount -t tmpfs host1 "$0" && exec "$@"'
        stack.worker_command = ["unshare", "-rm", "sh", "-c", private, host0_tmp, *command]
        stack.start_worker([*across, "--node_rank", "1"])
        stack.worker_command = ["env", f"TMPDIR={host0_tmp}", *command]
        stack.start_worker([*across, "--node_rank", "0"])
    finally:
        stack.worker_command = command
    stack.wait_for_workers(1, 300)
    assert len(sc.ops.workers.live_workers()) == 1


@pytest.fixture(scope="module")
def master_port() -> str:
    """A free port whose next one (host 1's calls to rank 0) is free too, both below the kernel's ephemeral range
    (32768 and up), as the default 29500 is: the next one of a port from that range (treadle.net.free_port) may be
    taken as the local end of any connection, the ranks' own to the rendezvous included."""
    for port in range(20000 + os.getpid() % 9000, 32000, 2):
        try:
            with socket.create_server(("", port)), socket.create_server(("", port + 1)):
                return str(port)
        except OSError:
            continue
    raise AssertionError("no two free ports next to each other below 32000")


@pytest.fixture(scope="module")
def host0_tmp(tmp_path_factory) -> str:
    """Host 0's temporary directory, which host 1 cannot see (`start_two_hosts`)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("two hosts without a shared filesystem need `unshare -rm` (user and mount namespaces)")
    return str(tmp_path_factory.mktemp("host0-tmp"))


@pytest.fixture(scope="module")
def four_ranks(stack, sc, ref, master_port, host0_tmp) -> dict[str, Run]:
    """The two-host group, checked like one device: each family's uninterrupted run on it."""
    stop_workers(stack)  # the two-rank group
    for log in os.listdir(os.path.join(stack.home, "logs")):  # only this group's lines count in assert_memory_logged
        os.truncate(os.path.join(stack.home, "logs", log), 0)
    start_two_hosts(stack, sc, master_port, host0_tmp)
    return check_like_one_device(sc, ref, "four")


def test_a_group_on_two_hosts_trains_like_one_device_and_moves_checkpoints(stack, sc, ref, four_ranks):
    """Two hosts of two ranks each form one group of four and train like one device. A checkpoint saved on it
    continues on one device as it does on the group, and one saved on one device continues on the group as it
    does on one device: a LoRA session's, and a full session's, whose sampler snapshot samples on the group as on one
    device too. Host 1 cannot read the files rank 0 downloads: its ranks get what they load from rank 0."""
    assert_memory_logged(stack, 4)
    tc = four_ranks["llama"].tc

    # Four sharded ranks -> one device: both continue the same 5 steps.
    engine = ref.engines["llama"]
    with tempfile.TemporaryDirectory() as tmp:
        sc.create_rest_client().download(tc.save_state("four-mid").result(timeout=60).path, tmp)
        engine.load_state("from-four", tmp, with_optimizer=True)
    assert close(train(tc, range(STEPS, STEPS + 5)), ref.run("llama", "from-four", range(STEPS, STEPS + 5)))
    assert_close_adapter(
        adapter_of(sc, tc.save_state("four-end").result(timeout=60).path), ref.adapter("llama", "from-four")
    )

    # One device -> four sharded ranks.
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("four-llama", tmp)
        path = "treadle://from-one/weights/one"
        CheckpointStore.from_url(stack.storage_url).save(
            tmp, path, base_model="llama", lora_config=LoraConfig(rank=8, seed=SEED).model_dump(), step=STEPS
        )
    resumed = sc.create_training_client_from_state_with_optimizer(path)
    assert close(train(resumed, range(STEPS, STEPS + 5)), ref.run("llama", "four-llama", range(STEPS, STEPS + 5)))
    assert_close_adapter(
        adapter_of(sc, resumed.save_state("one-end").result(timeout=60).path), ref.adapter("llama", "four-llama")
    )

    # A full session, one device -> four sharded ranks: each keeps its shards of the weights and moments rank 0 read.
    engine.create_session("full-one", LoraConfig(rank=8, seed=SEED), full=FullConfig())
    engine.forward_backward("full-one", *batch(0))
    engine.optim_step("full-one", ADAM)
    extra = {"full_config": FullConfig().model_dump()}
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("full-one", tmp)
        path = "treadle://from-one/weights/full"
        CheckpointStore.from_url(stack.storage_url).save(tmp, path, base_model="llama", step=1, extra=extra)
    full_steps(sc.create_training_client_from_state_with_optimizer(path), engine, "full-one", range(1, 3))
    engine.snapshot_sampler("full-one", "full-one")
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_sampler_weights("full-one", tmp)
        path = "treadle://from-one/sampler_weights/full-one"
        CheckpointStore.from_url(stack.storage_url).save(tmp, path, base_model="llama", extra=extra)
    prompt, params = ModelInput.from_ints(list(range(5, 25))), SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    loaded = sc.create_sampling_client(model_path=path).sample(prompt, 2, params).result(timeout=120).sequences
    want = engine.samplers.sample("full-one", prompt, 2, params).sequences
    assert [s.tokens for s in loaded] == [s.tokens for s in want]
    for g, w in zip(loaded, want):
        assert g.logprobs == pytest.approx(w.logprobs, rel=0, abs=TOL)


def ranks_of(proc: subprocess.Popen) -> dict[int, int]:
    """The ranks a `treadle worker` process spawned (`device_group.spawn_rank`): rank -> pid."""
    found = {}
    for pid in followers(proc.pid):
        with open(f"/proc/{pid}/cmdline") as f:
            found[json.loads(f.read().split("\0")[3])["rank"]] = pid  # python -m MODULE SPEC
    return found


def kill_rank_two(stack: LocalStack, sc: ServiceClient, session_id: str) -> float:
    """SIGKILL rank 2 of the two-host group that owns the session; returns how long both hosts' processes and all
    four ranks took to go. Rank 0's process and host 1's exit 1."""
    host0 = owner_process(stack, sc, session_id)
    (host1,) = [p for p in stack.workers if p is not host0]
    ranks = {0: host0.pid, **ranks_of(host0), **ranks_of(host1)}
    assert sorted(ranks) == [0, 1, 2, 3]
    os.kill(ranks[2], signal.SIGKILL)
    gone_s = wait_until(
        lambda: host0.poll() is not None and host1.poll() is not None and not any(map(alive, ranks.values())),
        "the group outlived its dead rank 2",
    )
    assert (host0.returncode, host1.returncode) == (1, 1)
    stack.workers.remove(host0)
    stack.workers.remove(host1)
    return gone_s


def test_a_dead_rank_on_the_other_host_ends_the_group_and_the_loop_sees_nothing(
    stack, sc, four_ranks, master_port, host0_tmp
):
    """SIGKILL of rank 2 (host 1's first rank) mid-run: host 0's rank 0 sees its connection close and ends its host's
    ranks, host 1's process ends its other rank, and both exit 1. Restarted as a supervisor would (the same command
    lines), the group adopts the session from its journal once its lease expires, and the loop sees no error: its
    losses and final adapter are bitwise those of the uninterrupted run on the same group shape (the same ops on the
    same shards, summed in the same order)."""
    twin = four_ranks["llama"]
    tc = sc.create_lora_training_client("llama", rank=8, seed=SEED)
    kill_at = 4
    pairs = []
    for step in range(STEPS):
        data, loss_fn = batch(step)
        pairs.append((tc.forward_backward(data, loss_fn), tc.optim_step(ADAM)))
        if step == kill_at:
            pairs[step - 1][1].result(timeout=120)  # the run is going on the group: kill one of its ranks
            print(f"the group was gone {kill_rank_two(stack, sc, tc.session_id):.2f} s after the kill")
            start_two_hosts(stack, sc, master_port, host0_tmp)  # as a supervisor would, with the same command lines
    assert [opt.result(timeout=300).metrics["step:max"] for _, opt in pairs] == list(range(1, STEPS + 1))
    assert [fb.result(timeout=300).metrics["loss:sum"] for fb, _ in pairs] == twin.losses
    assert_same_adapter(adapter_of(sc, tc.save_state("killed-end").result(timeout=60).path), adapter_of(sc, twin.final))
    assert sc.ops.session_info(tc.session_id).epoch == 2  # created on the group, adopted by its restart


def test_the_other_host_exits_0_when_rank_0_stops_and_1_when_it_dies(stack, sc, master_port, host0_tmp):
    """Host 1's `treadle worker` ends with its group. Stopped in order (SIGTERM), rank 0 ends the group and host 1
    exits 0; killed, it leaves host 1 exiting 1, so a supervisor that restarts failed processes restarts both."""
    for how, status in ((signal.SIGTERM, 0), (signal.SIGKILL, 1)):
        if len(stack.workers) != 2:
            stop_workers(stack)
            start_two_hosts(stack, sc, master_port, host0_tmp)
        (host0,) = [p for p in stack.workers if p.args[p.args.index("--node_rank") + 1] == "0"]
        (host1,) = [p for p in stack.workers if p is not host0]
        host0.send_signal(how)
        host0.wait(timeout=120)
        assert host1.wait(timeout=120) == status, f"host 1 after rank 0's {how.name}"
        stack.workers.remove(host0)
        stack.workers.remove(host1)


def failing_group(stack: LocalStack, sc: ServiceClient) -> tuple[subprocess.Popen, str]:
    """The stack's one worker: a 2-rank sharded group whose rank 0 fails when the test asks (`tests.slow_worker
    --fail-when-asked`); the worker and its log's path."""
    stop_workers(stack)
    # A worker killed by the test before leaves its registration until its heartbeat lapses: the wait below is for
    # this worker's.
    wait_until(lambda: not sc.ops.workers.live_workers(), "a killed worker's registration outlived its heartbeat", 120)
    command, stack.worker_command = (
        stack.worker_command,
        [sys.executable, "-m", "tests.slow_worker", "--fail-when-asked"],
    )
    log_path = os.path.join(stack.home, "logs", f"worker-{len(stack.workers)}.log")  # as LocalStack names it
    try:
        worker = stack.start_worker(["--devices", "2", *GROUP_ARGS])
    finally:
        stack.worker_command = command
    stack.wait_for_workers(1, 300)
    return worker, log_path


def test_a_checkpoint_write_that_fails_on_a_sharded_group_fails_its_op_and_the_group_trains_on(stack, sc, ref):
    """A full session's save_state and save_weights_for_sampler on a sharded group gather on every rank, then rank 0
    writes: a write that fails (a full disk) fails that op with the reason, and the group, its ranks and the
    session go on like one device."""
    worker, _ = failing_group(stack, sc)
    ranks = ranks_of(worker)
    engine = ref.engines["llama"]
    tc = sc.create_full_training_client("llama")
    engine.create_session("full-disk", LoraConfig(rank=8, seed=SEED), full=FullConfig())
    full_steps(tc, engine, "full-disk", range(1))
    sc.ops.redis.set("tests:fail:write", 1)
    try:
        for save in (lambda: tc.save_state("no-space"), lambda: tc.save_weights_for_sampler("no-space")):
            with pytest.raises(Exception, match="No space left on device") as failed:
                save().result(timeout=120)
            assert "OSError" in str(failed.value)
    finally:
        sc.ops.redis.delete("tests:fail:write")
    assert worker.poll() is None and len(ranks) == 1 and all(alive(pid) for pid in ranks.values())
    full_steps(tc, engine, "full-disk", range(1, 3))
    _, weights, moments = full_state(sc, tc.save_state("full-disk").result(timeout=120).path)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("full-disk", tmp)
        assert_close_adapter(weights, load_file(os.path.join(tmp, "model.safetensors")))
        assert_close_adapter(moments, load_file(os.path.join(tmp, "optimizer.safetensors")))


def test_a_forward_of_rank_0_alone_that_fails_part_way_takes_the_group_down_at_once(stack, sc):
    """A sample's forward on rank 0 raises in a decoder layer while the followers run its idle pass: they wait in a
    collective rank 0 will not enter, so the group goes down then (status 1, the reason logged), not after the
    followers' collective timeout (CALL_TIMEOUT_S, 600 s), and the request waits for the next worker."""
    worker, log_path = failing_group(stack, sc)
    sc.ops.redis.set("tests:fail:layer", 1)
    try:
        sc.create_sampling_client(base_model="llama").sample(
            ModelInput.from_ints([5, 6, 7]), 1, SamplingParams(max_tokens=2)
        )
        assert worker.wait(timeout=120) == 1  # well inside CALL_TIMEOUT_S
    finally:
        sc.ops.redis.delete("tests:fail:layer")
    stack.workers.remove(worker)
    with open(log_path) as f:
        log = f.read()
    assert "raised part-way" in log, log[-3000:]


def test_the_preflight_says_from_the_config_alone_whether_a_model_fits(family_dirs, capsys):
    """`treadle models check MODEL --devices N --shard --memory_gb G` builds the model on the meta device: no
    weight is read (the directory's weights file is gone here), and it answers with sessions and tokens."""
    from treadle.models_cli import ModelsCheckConfig, fit_one

    config_only = tempfile.mkdtemp()
    with (
        open(os.path.join(family_dirs["gpt_oss"], "config.json")) as f,
        open(os.path.join(config_only, "config.json"), "w") as out,
    ):
        out.write(f.read())
    assert fit_one(config_only, ModelsCheckConfig(memory_gb=4.2, devices=4, shard=True, dtype="float32"))
    shown = capsys.readouterr().out
    assert "fits          yes (4 devices, sharded of 4.2 GB)" in shown and "--max_tokens_per_microbatch 4096" in shown
    one = plan(config_only, devices=1, shard=False, memory_gb=4.2, dtype="float32")
    four = plan(config_only, devices=4, shard=True, memory_gb=4.2, dtype="float32")
    assert four.weights < one.weights / 3 and four.gathered > 0 and one.session == four.session
    assert not fit_one(config_only, ModelsCheckConfig(memory_gb=4.0, devices=4, shard=True))  # the 4 GB of overhead
