"""Durable control requests: a worker that dies while it samples, scores prompts or creates a session costs the
loop nothing (treadle.queue.control_requests, treadle.gpu_worker.executor.control_ops).

One stack for the module: Redis and workers on the tiny model, each able to sleep in a prefill, a decode step, a
compute_logprobs batch or a session creation while a test asks (`tests.slow_worker --when-asked`), so a kill lands
where it should. The worker running the requests is SIGKILLed, and every future is answered with what an
uninterrupted run gives, through the SDK, the gateway's OpenAI endpoint and the official tinker SDK alike: a
seeded request's rows do not depend on their batch on CPU, so a re-run from the prompt draws the same tokens with
the same logprobs. The workers also kill themselves on a request holding the token a test names: such a request
is answered with CrashingRequestError once it has killed two of them; workers paused past their claims (SIGSTOP)
did not die, and count for nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.gateway import ALICE_KEY, gateway_settings
from tests.test_durability import adapter_of, assert_same_adapter
from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.gateway.server import BackgroundGateway
from treadle.errors import CrashingRequestError
from treadle.local_stack import LocalStack
from treadle.queue import names

SEED = 5
ADAM = AdamParams(learning_rate=5e-3)
PROMPTS = [ModelInput.from_ints([(i * 13 + j * 7) % 240 + 5 for j in range(6 + i)]) for i in range(6)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    os.environ["OMP_NUM_THREADS"] = "1"
    s = LocalStack(
        [f"tiny={tiny_model_dir}"],
        home=str(tmp_path_factory.mktemp("durable-sampling")),
        workers=2,
        worker_args=["--lease_ttl_s", "2", "--checkpoint_every", "5"],
        worker_command=[sys.executable, "-m", "tests.slow_worker", "--when-asked"],
    )
    s.start(wait_for_workers=180)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sc(stack) -> ServiceClient:
    return ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)


@pytest.fixture(scope="module")
def sampler(sc, snapshot):
    return sc.create_sampling_client(model_path=snapshot)


@pytest.fixture(scope="module")
def reference(sampler) -> list[dict]:
    """The answers of `six_requests`, uninterrupted."""
    return answers(six_requests(sampler))


@pytest.fixture(scope="module")
def snapshot(sc) -> str:
    """A sampler snapshot of a trained adapter, which a worker that did not make it loads from the store."""
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    tc.forward_backward(batch(0), "cross_entropy")
    tc.optim_step(ADAM).result(timeout=120)
    return tc.save_weights_for_sampler("snap").result(timeout=120).path


def batch(step: int) -> list[Datum]:
    toks = [(step * 11 + j * 5) % 240 + 5 for j in range(17)]
    return [
        Datum(
            model_input=ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16},
        )
    ]


def slow(sc: ServiceClient, **seconds: float) -> None:
    """Ask the workers to sleep this long at each of these points (see tests.slow_worker); 0 stops asking."""
    for point, s in seconds.items():
        if s:
            sc.ops.redis.set(f"tests:slow:{point}", s)
        else:
            sc.ops.redis.delete(f"tests:slow:{point}")


def claimed(sc: ServiceClient, future_ids: list[str], timeout: float = 60) -> Counter:
    """Once every request is claimed (or answered already): how many each worker holds (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        holders = {fid: sc.ops.control.claimer(fid) for fid in future_ids}
        if all(h or not sc.ops.control.is_held(fid) for fid, h in holders.items()):
            return Counter(h for h in holders.values() if h)
        assert time.monotonic() < deadline, f"requests not claimed: {holders}"
        time.sleep(0.05)


def consuming(sc: ServiceClient, count: int, timeout: float = 180) -> None:
    """Once `count` workers consume their queues (they answer a ping): a worker announces itself a little before."""
    deadline = time.monotonic() + timeout
    while len(sc.ops.app.control.ping(timeout=1.0)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers consuming"


def held(sc: ServiceClient, count: int, timeout: float = 60) -> list[str]:
    """The future ids of the control requests held for the tiny model, once there are `count` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while len(pending := sc.ops.redis.zrange(names.control_pending_key("tiny"), 0, -1)) < count:
        assert time.monotonic() < deadline, f"{len(pending)} requests held, not {count}"
        time.sleep(0.05)
    return [fid.decode() for fid in pending]


def worker_process(stack: LocalStack, sc: ServiceClient, hostname: str):
    """The process of the worker announced under `hostname`."""
    [pid] = [w.pid for w in sc.ops.workers.live_workers() if w.hostname == hostname]
    [proc] = [p for p in stack.workers if p.pid == pid]
    return proc


def claimer_other_than(sc: ServiceClient, future_id: str, other: str | None, timeout: float = 60) -> str:
    """The worker whose claim on the request is live, once it is not `other` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while (holder := sc.ops.control.claimer(future_id)) in (None, other):
        assert sc.ops.control.is_held(future_id), "the request was answered before the test paused its worker"
        assert time.monotonic() < deadline, f"request {future_id} not claimed by a worker other than {other}"
        time.sleep(0.02)
    return holder


def kill_worker(stack: LocalStack, sc: ServiceClient, hostname: str) -> None:
    """SIGKILL the worker process announced under `hostname`."""
    proc = worker_process(stack, sc, hostname)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stack.workers.remove(proc)


def kill_busiest(stack: LocalStack, sc: ServiceClient, future_ids: list[str]) -> None:
    """SIGKILL the worker that holds the most of these requests (once each was claimed)."""
    holders = claimed(sc, future_ids)
    assert holders, "every request was answered before the kill"
    kill_worker(stack, sc, holders.most_common(1)[0][0])


def six_requests(sampler):
    """6 seeded sample requests of 4 samples x 96 tokens."""
    return [
        sampler.sample(p, num_samples=4, sampling_params=SamplingParams(max_tokens=96, seed=100 + i, temperature=1.0))
        for i, p in enumerate(PROMPTS)
    ]


def answers(futures) -> list[dict]:
    return [f.result(timeout=300).model_dump() for f in futures]


def test_sample_requests_survive_the_worker_decoding_them(stack, sc, sampler, reference):
    """Two workers; the one decoding most of 6 seeded requests is killed mid-batch: the other runs its requests
    again and every answer is that of the uninterrupted run."""
    consuming(sc, 2)
    slow(sc, step=0.03)  # ~3 s of decoding: the kill lands inside it
    futures = six_requests(sampler)
    claimed(sc, [f.id for f in futures])
    time.sleep(0.5)
    kill_busiest(stack, sc, [f.id for f in futures])  # mid-batch
    slow(sc, step=0)
    assert answers(futures) == reference


def test_prefill_scoring_creation_and_the_gateway_survive_the_only_worker(stack, sc, sampler, reference):
    """The only worker is killed with 6 sample requests in their prefill, a compute_logprobs batch, a session
    creation, an OpenAI chat completion and an official tinker SDK sample in flight; a worker started afterwards
    (a supervisor's restart) answers every one of them as an uninterrupted run does, and the session trains."""
    import openai
    import tinker
    from tinker import types as tt

    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=3, temperature=1.0)
    tinker_params = tt.SamplingParams(max_tokens=8, seed=4, temperature=1.0)
    with BackgroundGateway(gateway_settings(stack)) as gateway, ThreadPoolExecutor(2) as pool:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALICE_KEY)
        official = tinker.ServiceClient(base_url=gateway.url, api_key=ALICE_KEY).create_sampling_client(
            base_model="tiny"
        )
        slow(sc, prefill=3, logprobs=3, create=3)
        futures = six_requests(sampler)
        scored = [sampler.compute_logprobs(p) for p in PROMPTS[:3]]
        creating = pool.submit(sc.create_lora_training_client, "tiny", rank=8, seed=SEED)
        chatting = pool.submit(client.chat.completions.create, **chat)
        sampling = official.sample(tt.ModelInput.from_ints(PROMPTS[0].to_ints()), 2, tinker_params)
        requests = held(sc, 6 + 3 + 3)
        claimed(sc, requests)
        time.sleep(0.5)
        kill_busiest(stack, sc, requests)  # the only worker
        slow(sc, prefill=0, logprobs=0, create=0)
        stack.start_worker()
        assert answers(futures) == reference
        assert [f.result(timeout=300) for f in scored] == [
            sampler.compute_logprobs(p).result(timeout=60) for p in PROMPTS[:3]
        ]
        assert chatting.result(timeout=300).choices == client.chat.completions.create(**chat).choices
        first = sampling.result(timeout=300).sequences
        again = official.sample(tt.ModelInput.from_ints(PROMPTS[0].to_ints()), 2, tinker_params).result().sequences
        assert [(s.tokens, s.logprobs) for s in first] == [(s.tokens, s.logprobs) for s in again]
        tc = creating.result(timeout=300)
    assert tc.forward_backward(batch(1), "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0


def test_claims_that_lapse_while_their_workers_live_count_no_death(stack, sc, sampler):
    """A sample's worker is paused past its claim's lease (SIGSTOP: a long GC pause, a starved machine) and the
    other worker takes the request over; the first resumes, the second is paused in turn, and the first takes it
    back. Two claims lapsed, as many as --max_request_crashes allows, but no worker died: the sample is answered
    with what an uninterrupted run gives, not with CrashingRequestError."""
    while len(stack.workers) < 2:
        stack.start_worker()
    consuming(sc, 2)
    params = SamplingParams(max_tokens=48, seed=11, temperature=1.0)
    expected = sampler.sample(PROMPTS[1], 2, params).result(timeout=120)
    paused = []
    slow(sc, step=0.05)  # a few seconds of decoding: each worker is paused before it answers
    try:
        future = sampler.sample(PROMPTS[1], 2, params)
        first = claimer_other_than(sc, future.id, None)
        paused.append(worker_process(stack, sc, first))
        paused[0].send_signal(signal.SIGSTOP)
        second = claimer_other_than(sc, future.id, first)  # after the first claim lapsed
        paused.append(worker_process(stack, sc, second))
        paused[1].send_signal(signal.SIGSTOP)
        paused[0].send_signal(signal.SIGCONT)  # it finds its claim lost, says it is alive, and runs the request again
        answer = future.result(timeout=120)
    finally:
        for proc in paused:
            proc.send_signal(signal.SIGCONT)
        slow(sc, step=0)
    assert answer == expected
    assert all(p.poll() is None for p in stack.workers)


# ---------------------------------------------------------------- a GRPO loop in math_rl's shape

GROUPS, GROUP_SIZE, TOKENS, STEPS = 2, 4, 6, 20


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def grpo_datums(prompt: ModelInput, sequences) -> list[Datum]:
    """One group's datums for importance sampling: advantages are rewards centred on the group's mean."""
    rewards = [reward(s.tokens) for s in sequences]
    mean = sum(rewards) / len(rewards)
    p = prompt.to_ints()
    out = []
    for s, r in zip(sequences, rewards):
        full = p + s.tokens
        pad = [0.0] * (len(p) - 1)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": full[1:],
                    "logprobs": pad + list(s.logprobs),
                    "advantages": pad + [r - mean] * len(s.tokens),
                },
            )
        )
    return out


def grpo_params(step: int, group: int) -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, seed=1000 * step + group, temperature=1.0)


def grpo_reference(model_dir: str) -> dict:
    """The final adapter of the uninterrupted loop, in-process."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    torch.set_num_threads(1)
    engine = Engine(model_dir)
    engine.create_session("ref", LoraConfig(rank=8, seed=SEED))
    for step in range(STEPS):
        engine.snapshot_sampler("ref", f"ref-{step}")
        datums = []
        for g in range(GROUPS):
            response = engine.samplers.sample(f"ref-{step}", PROMPTS[g], GROUP_SIZE, grpo_params(step, g))
            datums += grpo_datums(PROMPTS[g], response.sequences)
        engine.forward_backward("ref", datums, "importance_sampling")
        engine.optim_step("ref", ADAM)
        engine.drop_sampler(f"ref-{step}")
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state("ref", tmp)
        return load_file(os.path.join(tmp, "adapter_model.safetensors"))


def test_grpo_loop_with_three_kills_while_sampling_equals_the_uninterrupted_run(stack, sc, tiny_model_dir):
    """A worker killed 3 times while the loop samples (the one decoding its groups; it may own the session too):
    the loop sees no error, and its final adapter is bitwise the uninterrupted run's."""
    if len(stack.workers) < 2:
        stack.start_worker()  # ready by the first kill, which needs another worker to re-run what it held
    tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    kill_at = {4, 11, 17}
    for step in range(STEPS):
        sampler = tc.save_weights_and_get_sampling_client(f"grpo-{step}")
        if step in kill_at:
            consuming(sc, 2)
            slow(sc, step=0.3)  # a window of a couple of seconds in the decode
        futures = [sampler.sample(PROMPTS[g], GROUP_SIZE, grpo_params(step, g)) for g in range(GROUPS)]
        if step in kill_at:
            kill_busiest(stack, sc, [f.id for f in futures])
            slow(sc, step=0)
            if step != max(kill_at):
                stack.start_worker()  # a supervisor's restart; the other worker re-runs the groups meanwhile
        datums = []
        for g, f in enumerate(futures):
            datums += grpo_datums(PROMPTS[g], f.result(timeout=300).sequences)
        tc.forward_backward(datums, "importance_sampling")
        tc.optim_step(ADAM)
    final = adapter_of(sc, tc.save_state("final").result(timeout=300).path)
    assert_same_adapter(final, grpo_reference(tiny_model_dir))


# ---------------------------------------------------------------- a request that kills every worker that runs it

POISON = 300  # a token id no other request of the module holds: a worker that runs it SIGKILLs itself


def let_it_kill(stack: LocalStack, deaths: int = 2) -> None:
    """Wait until `deaths` workers died (SIGKILLed by the poisoned request), starting a worker whenever none is
    left, as a supervisor would; then one live worker is there to answer the request (bounded wait)."""
    dead, deadline = 0, time.monotonic() + 300
    while dead < deaths:
        for proc in [p for p in stack.workers if p.poll() is not None]:
            assert proc.returncode == -signal.SIGKILL
            stack.workers.remove(proc)
            dead += 1
        if not stack.workers:
            stack.start_worker()
        assert time.monotonic() < deadline, f"{dead} workers died, not {deaths}"
        time.sleep(0.2)
    if not stack.workers:
        stack.start_worker()


def poison_batch() -> list[Datum]:
    return [
        Datum(
            model_input=ModelInput.from_ints([5, POISON, 7]),
            loss_fn_inputs={"target_tokens": [POISON, 7, 9], "weights": [1.0] * 3},
        )
    ]


def test_a_request_that_kills_its_workers_is_answered_with_an_error(stack, sc, sampler):
    """A sample that kills each worker that runs it, then a forward_backward that kills each owner of its session:
    each kills two workers, and the third answers it with CrashingRequestError (the SDK raises it, naming the
    request, the op, the deaths and the option), serves what follows, and logs it. The session goes on as if the
    op had never been sent, also when it is rebuilt from its journal (which holds the op) after another death."""
    reference = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
    reference.forward_backward(batch(1), "cross_entropy")
    reference.optim_step(ADAM)
    expected = adapter_of(sc, reference.save_state("without-poison").result(timeout=300).path)
    while len(stack.workers) < 2:
        stack.start_worker()
    consuming(sc, 2)
    sc.ops.redis.set("tests:poison", POISON)
    try:
        poisoned = sampler.sample(ModelInput.from_ints([5, POISON, 7]), 1, SamplingParams(max_tokens=4, seed=1))
        let_it_kill(stack)
        with pytest.raises(CrashingRequestError) as failed:
            poisoned.result(timeout=300)
        for part in (poisoned.id, "sample request", "2 workers died", "max_request_crashes=2"):
            assert part in failed.value.message
        sample_id = poisoned.id
        assert sampler.sample(PROMPTS[0], 1, SamplingParams(max_tokens=4, seed=1)).result(timeout=120).sequences

        while len(stack.workers) < 2:
            stack.start_worker()
        consuming(sc, 2)
        tc = sc.create_lora_training_client("tiny", rank=8, seed=SEED)
        poisoned = tc.forward_backward(poison_batch(), "cross_entropy")
        let_it_kill(stack)
        with pytest.raises(CrashingRequestError) as failed:
            poisoned.result(timeout=300)
        for part in (poisoned.id, "forward_backward request", "2 workers died"):
            assert part in failed.value.message
        tc.forward_backward(batch(1), "cross_entropy")
        tc.optim_step(ADAM).result(timeout=120)
        kill_worker(stack, sc, sc.ops.session_info(tc.session_id).worker or "")
        stack.start_worker()  # it rebuilds the session from its journal, poisoned op included: it must not run it
        assert_same_adapter(adapter_of(sc, tc.save_state("after-poison").result(timeout=300).path), expected)
    finally:
        sc.ops.redis.delete("tests:poison")
    assert all(p.poll() is None for p in stack.workers)
    logs = "".join(
        open(os.path.join(stack.home, "logs", f)).read() for f in os.listdir(os.path.join(stack.home, "logs"))
    )
    assert f"not running sample request {sample_id}" in logs
    assert f"of session {tc.session_id}: 2 workers died running it" in logs
