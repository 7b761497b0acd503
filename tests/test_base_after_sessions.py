"""The base model stays sampleable while training sessions come and go, through the official SDK.

A worker frees a session's LoRA adapter when its client closes. Once the last adapter of a base model
was gone, PEFT still named it as the active adapter and every base-model pass (a teacher, a grader, a
plain base sampler) failed with `KeyError: 'adapter_1'`. Here a worker of its own serves the tiny model
as `solo`, so no other test's adapter keeps the bank non-empty: the base model is sampled before, during
and after sessions with their own snapshots open and close, and its logprobs never move.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY
from treadle.queue import names
from treadle.queue.ops_client import OpsClient

MODEL = "solo"
PROMPT = list(range(5, 17))


@pytest.fixture(scope="module")
def solo(stack, gateway, tiny_model_dir, tmp_path_factory):
    """A worker serving the tiny model as `solo` on the shared stack's Redis and storage."""
    home = tmp_path_factory.mktemp("solo-worker")
    log = open(home / "worker.log", "wb")
    worker = subprocess.Popen(
        [*stack.worker_command, "--model", f"{MODEL}={tiny_model_dir}", "--lease_ttl_s", "3"],
        env={**stack.env(), "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    ops = OpsClient(stack.broker_url)
    deadline = time.monotonic() + 180
    while not any(m.name == MODEL for m in ops.served_models()):
        assert worker.poll() is None and time.monotonic() < deadline, (home / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_BASE_URL", gateway.url)
        mp.setenv("TINKER_API_KEY", ALICE_KEY)
        yield ops
    worker.terminate()
    worker.wait(timeout=60)
    log.close()


def _prompt_logprobs(**where) -> list[float | None]:
    """Prompt logprobs of the base model (or of `model_path=`), from a new client each time, as a separate
    program (a teacher, a grader) would ask."""
    service = tinker.ServiceClient()
    try:
        sampler = service.create_sampling_client(**(where or {"base_model": MODEL}))
        out = sampler.sample(
            tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=2, seed=1), include_prompt_logprobs=True
        ).result()
        assert len(out.sequences[0].tokens) == 2
        return out.prompt_logprobs
    finally:
        service.close("success")


def _session(lr: float) -> tuple[tinker.ServiceClient, tinker.TrainingClient]:
    """A service client with one LoRA session that ran a forward (and, with lr > 0, a step that moved it)."""
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )
    training.forward([datum], "cross_entropy").result()
    if lr > 0:
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(tt.AdamParams(learning_rate=lr)).result()
    return service, training


def _close(ops: OpsClient, service: tinker.ServiceClient, training: tinker.TrainingClient) -> None:
    """Close the client and wait until its worker has freed the session (stopped, lease released)."""
    service.close("success")
    deadline = time.monotonic() + 120
    while True:
        record = ops.session_info(training.model_id)
        if (
            record is not None
            and record.status == "stopped"
            and not ops.redis.exists(names.lease_key(training.model_id))
        ):
            return
        assert time.monotonic() < deadline, f"session {training.model_id} still {record and record.status}"
        time.sleep(0.2)


def test_base_model_samples_before_during_and_after_sessions(solo):
    before = _prompt_logprobs()

    # The reproduction: one session runs a forward and closes; its adapter was the model's only one.
    _close(solo, *_session(lr=0.0))
    assert _prompt_logprobs() == before

    # Two sessions that trained, each with a sampler snapshot; the base model is sampled between every change.
    first, second = _session(lr=0.5), _session(lr=0.5)
    snapshot = first[1].save_weights_for_sampler("first").result().path
    tuned = _prompt_logprobs(model_path=snapshot)
    assert tuned != before  # the step moved the adapter, so "base" below cannot be this adapter by accident
    assert _prompt_logprobs() == before
    _close(solo, *first)
    assert _prompt_logprobs() == before
    assert _prompt_logprobs(model_path=snapshot) == tuned  # the snapshot outlives its session
    second[1].save_weights_for_sampler("second").result()
    _close(solo, *second)
    assert _prompt_logprobs() == before

    # A session created after sessions came and went trains and samples as any other.
    third = _session(lr=0.5)
    assert _prompt_logprobs(model_path=third[1].save_weights_for_sampler("third").result().path) != before
    _close(solo, *third)
    assert _prompt_logprobs() == before
