"""Operations end to end, on real worker processes: metering across a SIGKILL, the metrics endpoints of a
worker and the gateway, the quota refusing a create (treadle SDK and official SDK through the gateway),
the SDK's billing and storage usage methods, `treadle usage`, and idle expiry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types as tt

from treadle import AdamParams, ModelInput, SamplingParams, ServiceClient
from treadle.errors import QuotaExceededError, SessionExpiredError
from treadle.gateway.server import BackgroundGateway
from treadle.gateway.settings import GatewaySettings
from treadle.local_stack import LocalStack, free_port
from treadle.metering import SDK_OWNER, Meter
from treadle.queue.ops import NoopRequest
from tests.test_durability import kill_owner, owner_process

ALICE_KEY, CAROL_KEY = "tml-ops-alice", "tml-ops-carol"
ADAM = AdamParams(learning_rate=5e-3)


def rows(step: int, lengths) -> list[list[int]]:
    return [[(step * 13 + i * 7 + j * 3) % 200 + 5 for j in range(n + 1)] for i, n in enumerate(lengths)]


def datums(step: int, lengths=(7, 5), types=None) -> list:
    """Cross-entropy datums (treadle's, or the official SDK's `types`) whose inputs are exactly `lengths` tokens."""
    t = types or sys.modules["treadle"]
    return [
        t.Datum(
            model_input=t.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
        )
        for toks in rows(step, lengths)
    ]


def scrape(url: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value; parsing fails the test if the text is not Prometheus format."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def usage_cli(stack: LocalStack, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "usage", "--json", *args],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def ops_stack(tiny_model_dir, tmp_path_factory):
    """Two workers serving `tiny`, each with a metrics port; carol may run one training session at a time.

    A third worker serves the same weights as `tiny-exp`, so only it ever owns those sessions: it expires
    sessions idle for 5 s and allows one session per owner (the SDK's owner too), which no other test here
    could live with. Workers without a limit for an owner never admit into its count, so the two limits
    stay apart (a deployment gives every worker the same limits)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    stack = LocalStack(
        [f"tiny={tiny_model_dir}"],
        home=str(tmp_path_factory.mktemp("ops")),
        workers=0,
        password="ops-redis-pw",
        worker_args=["--lease_ttl_s", "2", "--checkpoint_every", "2", "--owner_session_limits", '{"carol": 1}'],
    )
    stack.start()
    expiring = None
    try:
        stack.metrics_ports = {}
        for _ in range(2):
            port = free_port()
            stack.metrics_ports[stack.start_worker(["--metrics_port", str(port)]).pid] = port
        expiring = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "treadle.cli",
                "worker",
                "--model",
                f"tiny-exp={tiny_model_dir}",
                "--lease_ttl_s",
                "3",
                "--session_idle_ttl_s",
                "5",
                "--max_sessions_per_owner",
                "1",
            ],
            env=stack.env(),
            stdout=open(os.path.join(stack.home, "logs", "worker-expiring.log"), "ab"),
            stderr=subprocess.STDOUT,
        )
        stack.wait_for_workers(3, 180)
        settings = GatewaySettings(
            port=0,
            broker_url=stack.broker_url,
            storage_url=stack.storage_url,
            api_keys={ALICE_KEY: "alice", CAROL_KEY: "carol"},
            long_poll_seconds=5,
        )
        with BackgroundGateway(settings) as gateway:
            stack.gateway = gateway
            yield stack
    finally:
        if expiring is not None:
            expiring.terminate()
            expiring.wait(timeout=60)
        stack.stop()


def test_worker_and_gateway_metrics_parse_and_move(ops_stack):
    sc = ServiceClient(broker_url=ops_stack.broker_url, storage_url=ops_stack.storage_url)
    gateway_url = ops_stack.gateway.url + "/metrics"
    tc = sc.create_lora_training_client("tiny", rank=4, seed=1)
    port = ops_stack.metrics_ports[owner_process(ops_stack, sc, tc.session_id).pid]
    worker_url = f"http://127.0.0.1:{port}/metrics"
    worker_before, gateway_before = scrape(worker_url), scrape(gateway_url)

    tc.forward_backward(datums(0), "cross_entropy").result(timeout=120)
    tc.forward_backward(datums(1), "cross_entropy").result(timeout=120)
    tc.optim_step(ADAM).result(timeout=120)
    saved = sc.create_rest_client().manifest(tc.save_state("metrics-1").result(timeout=120).path)
    urllib.request.urlopen(ops_stack.gateway.url + "/api/v1/healthz", timeout=10).read()
    worker_after, gateway_after = scrape(worker_url), scrape(gateway_url)

    assert moved(worker_before, worker_after, "treadle_tokens_total", kind="trained", base_model="tiny") == 2 * 12
    assert (
        moved(worker_before, worker_after, "treadle_ops_total", op="forward_backward", base_model="tiny", outcome="ok")
        == 2
    )
    assert (
        moved(worker_before, worker_after, "treadle_ops_total", op="optim_step", base_model="tiny", outcome="ok") == 1
    )
    assert moved(worker_before, worker_after, "treadle_op_seconds_count", op="forward_backward", base_model="tiny") == 2
    assert moved(worker_before, worker_after, "treadle_checkpoint_bytes_total", kind="state") == saved.size_bytes > 0
    assert moved(worker_before, worker_after, "treadle_checkpoint_seconds_count", kind="state") == 1
    # The gauge follows the heartbeat (every lease_ttl_s / 3): wait for the next one, bounded.
    active = ("treadle_active_sessions", (("base_model", "tiny"),))
    deadline = time.monotonic() + 120
    while scrape(worker_url).get(active, 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scrape(worker_url)[active] == 1
    assert ("treadle_queue_depth", (("base_model", "tiny"),)) in worker_after
    assert (
        moved(
            gateway_before,
            gateway_after,
            "treadle_gateway_requests_total",
            route="/api/v1/healthz",
            method="GET",
            status="200",
        )
        == 1
    )
    assert gateway_after[("treadle_deployment_workers", ())] == 3
    assert gateway_after[("treadle_deployment_active_sessions", (("base_model", "tiny"),))] >= 1
    assert ("treadle_queue_depth", (("base_model", "tiny-exp"),)) in gateway_after
    other = next(p for pid, p in ops_stack.metrics_ports.items() if p != port)
    scrape(f"http://127.0.0.1:{other}/metrics")  # the idle worker's endpoint parses too
    tc.stop()


def test_usage_is_exact_across_a_worker_sigkill_and_replay(ops_stack):
    """Six steps of 12 trained tokens; the owner is SIGKILLed mid-stream and the other worker rebuilds the
    session from its checkpoint and replays the journal: every op still counts once, nothing more."""
    sc = ServiceClient(broker_url=ops_stack.broker_url, storage_url=ops_stack.storage_url)
    meter = Meter(sc.ops.redis)
    tc = sc.create_lora_training_client("tiny", rank=4, seed=2)
    victim = owner_process(ops_stack, sc, tc.session_id).pid
    survivor_url = f"http://127.0.0.1:{next(p for pid, p in ops_stack.metrics_ports.items() if pid != victim)}/metrics"
    survivor_before = scrape(survivor_url)
    pairs = []
    for step in range(6):
        pairs.append((tc.forward_backward(datums(step), "cross_entropy"), tc.optim_step(ADAM)))
        if step == 3:
            pairs[2][1].result(timeout=120)  # checkpoint at step 2 is written; steps 3.. replay or run anew
            kill_owner(ops_stack, sc, tc.session_id, replace=False)  # SIGKILL: the other worker adopts the session
    assert [opt.result(timeout=300).metrics["step:max"] for _, opt in pairs] == list(range(1, 7))
    assert "replayed_to" in (sc.ops.session_info(tc.session_id).last_recovery or "")  # it was taken over
    assert moved(survivor_before, scrape(survivor_url), "treadle_lease_takeovers_total", base_model="tiny") == 1
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = [11, 12, 13, 14]
    out = sampler.sample(
        ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=SamplingParams(max_tokens=5, temperature=1.0, seed=3),
    ).result(timeout=120)
    sampled = sum(len(s.tokens) for s in out.sequences)

    usage = meter.session_usage(tc.session_id)
    assert (usage.trained_tokens, usage.prefill_tokens, usage.sampled_tokens) == (6 * 12, len(prompt), sampled)
    ops = [o.op for o in meter.session_ops(tc.session_id)]
    assert (ops.count("forward_backward"), ops.count("optim_step"), ops.count("sample")) == (6, 6, 1)
    assert tc.get_usage() == usage
    assert usage_cli(ops_stack, "--owner", SDK_OWNER)["owners"][SDK_OWNER] == meter.owner_usage(SDK_OWNER).model_dump()
    tc.stop()


def test_gateway_quota_billing_and_storage_usage(ops_stack):
    """carol (limit 1) through the official SDK: a second create is refused clearly; her billing events sum
    to exactly the tokens she trained; her storage is her one checkpoint; `treadle usage` agrees."""
    official = tinker.ServiceClient(base_url=ops_stack.gateway.url, api_key=CAROL_KEY)
    tc = official.create_lora_training_client(base_model="tiny", rank=4).result()  # 0.38: a future-like client
    data = datums(0, lengths=(6, 9, 4), types=tt)
    tc.forward_backward(data, "cross_entropy").result()
    tc.forward_backward(data[:1], "cross_entropy").result()
    path = tc.save_state("carol-1").result().path
    base = official.create_sampling_client(base_model="tiny")  # the bare base model: billed to carol too
    out = base.sample(
        tt.ModelInput.from_ints([21, 22, 23]), num_samples=2, sampling_params=tt.SamplingParams(max_tokens=4, seed=5)
    ).result()
    sampled = sum(len(s.tokens) for s in out.sequences)
    with pytest.raises(
        tinker.RequestFailedError, match=r"owner 'carol' has 1 active training sessions and the limit is 1"
    ):
        official.create_lora_training_client(base_model="tiny", rank=4).result()

    admin = tinker.AdminClient(base_url=ops_stack.gateway.url, api_key=CAROL_KEY)
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    billing = admin.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1)).result()
    kinds = {}
    for event in billing.data:
        quantity = event.event_info.count if event.event_info.type == "checkpoint" else event.event_info.token_count
        key = (event.session_id, event.event_info.type)
        kinds[key] = kinds.get(key, 0) + quantity
        assert event.base_model == "tiny"
    assert kinds == {
        (tc.model_id, "training"): 19 + 6,
        (tc.model_id, "checkpoint"): 1,
        ("base:tiny", "sampling_prefill"): 3,
        ("base:tiny", "sampling_sample"): sampled,
    }
    storage = admin.get_current_checkpoint_storage_usage().result()
    manifest = (
        ServiceClient(broker_url=ops_stack.broker_url, storage_url=ops_stack.storage_url)
        .create_rest_client()
        .manifest(path.replace("tinker://", "treadle://"))
    )
    assert [(i.checkpoint_count, i.size_bytes) for i in storage.data] == [(1, manifest.size_bytes)]
    with pytest.raises(tinker.TinkerError, match="aligned to a UTC hour"):
        admin.get_billing_usage(hour + timedelta(minutes=5), hour + timedelta(hours=1)).result()
    # alice sees none of carol's usage
    alice = tinker.AdminClient(base_url=ops_stack.gateway.url, api_key=ALICE_KEY)
    assert alice.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1)).result().data == []

    served = scrape(ops_stack.gateway.url + "/metrics")  # labelled by route template, with the router's prefix
    route = dict(route="/api/v1/billing/usage/events", method="GET")
    assert (
        served[("treadle_gateway_requests_total", tuple(sorted({**route, "status": "200"}.items())))],
        served[("treadle_gateway_requests_total", tuple(sorted({**route, "status": "400"}.items())))],
    ) == (2, 1)
    assert usage_cli(ops_stack, "--owner", "carol", "--since", "1h")["owners"]["carol"]["trained_tokens"] == 25
    official.close("success")


def test_idle_expiry_checkpoints_stops_and_answers_every_waiter(ops_stack):
    """On the worker expiring sessions idle 5 s, with one session per owner: the quota refuses a second SDK
    session; the idle session is checkpointed and stopped; a waiter on an op that could not run yet
    (its predecessor never came) and the next op both get SessionExpiredError naming the checkpoint,
    which resumes the session and takes the freed quota slot."""
    sc = ServiceClient(broker_url=ops_stack.broker_url, storage_url=ops_stack.storage_url)
    tc = sc.create_lora_training_client("tiny-exp", rank=4, seed=4)
    with pytest.raises(QuotaExceededError, match=r"owner 'sdk' has 1 active training sessions and the limit is 1"):
        sc.create_lora_training_client("tiny-exp", rank=4)
    tc.forward_backward(datums(0), "cross_entropy").result(timeout=120)
    tc.optim_step(ADAM).result(timeout=120)
    # An op two seqs ahead waits for one that never comes: the session stays idle, the wait pending.
    early = sc.ops.submit(tc.session_id, NoopRequest(), seq=sc.ops.next_seq(tc.session_id) + 2)
    waited: list[BaseException | None] = []
    waiter = threading.Thread(target=lambda: waited.append(_error_of(lambda: sc.ops.wait(early, timeout=120))))
    waiter.start()
    waiter.join(timeout=150)
    assert not waiter.is_alive()
    record = sc.ops.session_info(tc.session_id)
    assert record.status == "expired" and record.checkpoint and record.checkpoint_seq == 2
    assert isinstance(waited[0], SessionExpiredError) and record.checkpoint in str(waited[0])
    with pytest.raises(SessionExpiredError, match=f"resume from {record.checkpoint}"):
        tc.forward_backward(datums(1), "cross_entropy").result(timeout=30)
    resumed = sc.create_training_client_from_state_with_optimizer(record.checkpoint)
    assert resumed.optim_step(ADAM).result(timeout=120).metrics["step:max"] == 2


def _error_of(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # the test inspects what the waiter got
        return exc
    return None
