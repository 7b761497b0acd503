"""Every wait has a bound: a future waited on without a timeout ends, with an error that names the request and the
reason, once nothing can answer it (treadle.queue.wait_bounds). Real Redis, a real worker killed for good, the
treadle SDK and the official tinker SDK through the gateway."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import tinker
from tinker import types as tt

from treadle import Datum, ModelInput, SamplingParams, ServiceClient
from treadle.errors import NoWorkerError, RequestExpiredError
from treadle.gateway.server import BackgroundGateway
from treadle.gateway.settings import GatewaySettings
from treadle.local_stack import LocalStack
from treadle.queue.wait_bounds import CHECK_EVERY_S
from treadle.queue.workers import HEARTBEAT_TTL_S

KEY = "tml-bounds-test-key"
GRACE_S = 2
# The documented bound (a dead worker's announcement, the grace, one check), with room for a loaded machine: it only
# stops a hang.
BOUND_S = HEARTBEAT_TTL_S + GRACE_S + CHECK_EVERY_S + 120
TOKENS, TARGETS = [5, 6, 7, 8], {"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4}
DATUM = Datum(model_input=ModelInput.from_ints(TOKENS), loss_fn_inputs=TARGETS)


def _outcome(wait):
    started = time.monotonic()
    try:
        wait()
    except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def test_waits_without_a_timeout_end_with_a_clear_error_when_the_only_worker_is_gone(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("TREADLE_NO_WORKER_GRACE_S", str(GRACE_S))  # read by every OpsClient below, the gateway's too
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LocalStack([f"tiny={tiny_model_dir}"], home=str(tmp_path / "stack")) as stack:
        settings = GatewaySettings(
            port=0, broker_url=stack.broker_url, storage_url=stack.storage_url, api_keys={KEY: "alice"}
        )
        with BackgroundGateway(settings) as gateway:
            sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
            tc = sc.create_lora_training_client("tiny", rank=4, seed=0)
            tc.forward_backward([DATUM], "cross_entropy").result(timeout=120)
            sampler = sc.create_sampling_client(base_model="tiny")
            with monkeypatch.context() as short:
                short.setenv("TREADLE_SAMPLE_TTL_S", "1")  # this client's sample requests live 1 s
                short_lived = ServiceClient(broker_url=stack.broker_url).create_sampling_client(base_model="tiny")
            official = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
            otc = official.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
            osampler = otc.save_weights_and_get_sampling_client().result()

            (worker,) = stack.workers
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            params = SamplingParams(max_tokens=4, seed=1)
            futures = {
                "forward_backward": tc.forward_backward([DATUM], "cross_entropy"),
                "sample": sampler.sample(ModelInput.from_ints([5, 6, 7]), 2, params),
                "expiring sample": short_lived.sample(ModelInput.from_ints([5, 6, 7]), 2, params),
                "tinker forward_backward": otc.forward_backward(
                    [tt.Datum(model_input=tt.ModelInput.from_ints(TOKENS), loss_fn_inputs=TARGETS)],
                    "cross_entropy",
                ),
                "tinker sample": osampler.sample(
                    tt.ModelInput.from_ints([5, 6, 7]), 2, tt.SamplingParams(max_tokens=4)
                ),
            }
            with ThreadPoolExecutor(len(futures)) as pool:
                waits = {name: pool.submit(_outcome, future.result) for name, future in futures.items()}  # no timeout
                outcomes = {name: wait.result(timeout=BOUND_S) for name, wait in waits.items()}
            official.close("success")
    print({name: f"{type(exc).__name__} after {s:.1f} s" for name, (exc, s) in outcomes.items()})

    no_worker = "no live worker has served 'tiny' for"
    error, _ = outcomes["forward_backward"]
    assert isinstance(error, NoWorkerError), error
    fid = futures["forward_backward"].id
    assert f"forward_backward {fid.rpartition(':')[2]} of session {tc.session_id} (future {fid})" in error.message
    assert (
        no_worker in error.message
        and "past the grace of 2 s (no_worker_grace_s, TREADLE_NO_WORKER_GRACE_S)" in error.message
    )
    assert f"wait on {fid} again" in error.message
    error, _ = outcomes["sample"]
    assert isinstance(error, NoWorkerError), error
    assert f"sample request {futures['sample'].id}: cannot be answered: {no_worker}" in error.message
    # The lifetime ends a sample's wait whatever the workers: here before the grace does.
    error, _ = outcomes["expiring sample"]
    assert isinstance(error, RequestExpiredError), error
    assert f"sample request {futures['expiring sample'].id}: expired, unanswered" in error.message
    assert "lifetime of 1 s (sample_ttl_s, TREADLE_SAMPLE_TTL_S)" in error.message
    # The official SDK, polling retrieve_future, gets the same errors as its RequestFailedError.
    for name in ("tinker forward_backward", "tinker sample"):
        error, _ = outcomes[name]
        assert isinstance(error, tinker.RequestFailedError), error
        assert "cannot be answered" in str(error) and no_worker in str(error)
    assert "forward_backward" in str(outcomes["tinker forward_backward"][0])
