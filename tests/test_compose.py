"""compose.yaml: its structure, its privacy (no published port without authentication, no default secret),
and its services run on the host exactly as configured (tests/fixtures/compose.py), driven through the gateway
with the official tinker SDK and through the treadle SDK."""

import copy
import json
import pathlib
import re
import time
import urllib.error
import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.compose import (
    COMPOSE_KEY,
    TREADLE_IMAGE,
    MissingVariable,
    basic_auth_header,
    interpolate,
    load_compose,
)

load = load_compose
REQUIRED = {"REDIS_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "FLOWER_BASIC_AUTH", "TREADLE_KEYS_FILE"}
_SECRET_NAME = re.compile(r"PASSWORD|SECRET|AUTH|TOKEN|ACCESS_KEY|_USER\b", re.I)
_REQUIRED_REF = re.compile(r"^\$\{\w+:\?[^}]*\}$")


def test_services_present_and_wired():
    compose = load()
    assert set(compose["services"]) >= {"redis", "minio", "minio-init", "worker", "gateway", "flower"}
    for name, svc in compose["services"].items():
        assert "image" in svc or "build" in svc, name
        for dep in svc.get("depends_on", {}):
            assert dep in compose["services"], f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_redis_is_durable_and_never_evicts():
    cmd = " ".join(load()["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd
    assert "--maxmemory-policy noeviction" in cmd


def test_minio_bucket_is_created_with_versioning():
    init = load()["services"]["minio-init"]
    script = " ".join(init["command"])
    assert "mc mb" in script and "mc version enable" in script
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def test_worker_reserves_a_gpu_caches_hf_and_restarts():
    worker = load()["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any("/cache/huggingface" in v for v in worker["volumes"])
    assert worker["environment"]["HF_HOME"] == "/cache/huggingface"
    assert worker["restart"] == "unless-stopped"
    assert worker["command"][0] == "worker"


@pytest.mark.parametrize("devices", [None, "4"])
def test_worker_reserves_one_gpu_per_rank_of_its_device_group(devices):
    # `--devices N` uses cuda:0..N-1: the reservation must give the container exactly that many GPUs.
    worker = load()["services"]["worker"]
    env = {} if devices is None else {"TREADLE_WORKER_DEVICES": devices}
    count = interpolate(worker["deploy"]["resources"]["reservations"]["devices"][0]["count"], env)
    ranks = interpolate(worker["environment"]["TREADLE_WORKER_DEVICES"], env)
    assert str(count) == str(ranks) == (devices or "1")


def test_worker_command_parses_with_the_real_cli():
    from treadle.cli import build_parser

    worker = load()["services"]["worker"]
    args = [a.replace("${TREADLE_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}", "m") for a in worker["command"]]
    ns = build_parser().parse_args(args)
    assert ns.model == ["m"] and ns.checkpoint_every == 10


def env_drift(compose: dict) -> list[str]:
    """Every TREADLE_* variable of a treadle service that its command's config does not read: a misspelled
    or unknown option, or one of another command. The shared connection variables are every command's."""
    from treadle.cli import build_parser
    from treadle.config import CONFIG_ENV, SHARED_ENV, keys_of

    problems = []
    for name, svc in compose["services"].items():
        if svc.get("image") != TREADLE_IMAGE:
            continue
        model, prefix, _ = build_parser().parse_args(svc["command"]).config_spec
        options = keys_of(model)
        for key in svc.get("environment") or {}:
            if not key.startswith("TREADLE_") or key == CONFIG_ENV or key in SHARED_ENV.values():
                continue
            if not (key.startswith(prefix) and key[len(prefix) :].lower() in options):
                problems.append(
                    f"{name}: {key} is no option of `treadle {svc['command'][0]}` (its variables: "
                    f"{prefix}<OPTION>, see `treadle {svc['command'][0]} --help`)"
                )
    return problems


def test_every_treadle_variable_of_compose_is_an_option_of_its_command():
    assert env_drift(load()) == []


def test_the_drift_check_catches_a_misspelled_and_a_foreign_variable():
    compose = load()
    worker_env = compose["services"]["worker"]["environment"]
    worker_env["TREADLE_WORKER_METRICS_PROT"] = worker_env.pop("TREADLE_WORKER_METRICS_PORT")
    compose["services"]["runner"]["environment"]["TREADLE_GATEWAY_PORT"] = "8000"
    found = env_drift(compose)
    assert len(found) == 2 and found[0].startswith(
        "worker: TREADLE_WORKER_METRICS_PROT is no option of `treadle worker`"
    )
    assert found[1].startswith("runner: TREADLE_GATEWAY_PORT is no option of `treadle runner`")


def test_operations_doc_states_the_metrics_port_compose_gives_the_worker():
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    env = load()["services"]["worker"]["environment"]
    stated = re.search(
        r"compose\.yaml's worker sets `TREADLE_WORKER_METRICS_PORT=(\w+)` and "
        r"`TREADLE_WORKER_METRICS_ADDRESS=([\w.]+)`",
        doc,
    )
    assert stated and stated.groups() == (env["TREADLE_WORKER_METRICS_PORT"], env["TREADLE_WORKER_METRICS_ADDRESS"])


# ---------------------------------------------------------------- private by default


def _required(value) -> bool:
    """A value the operator must set: exactly one `${VAR:?...}` (compose refuses to start without it)."""
    return isinstance(value, str) and bool(_REQUIRED_REF.match(value))


def _auth_of(name: str, svc: dict) -> str | None:
    """How a service that publishes a port authenticates its clients, or None."""
    env, cmd = svc.get("environment") or {}, svc.get("command") or []
    if "--requirepass" in cmd and _required(cmd[cmd.index("--requirepass") + 1]):
        return "redis requirepass"
    if name == "minio" and _required(env.get("MINIO_ROOT_PASSWORD")):
        return "SigV4 keys"
    if "TREADLE_GATEWAY_API_KEYS_FILE" in env and any(
        _REQUIRED_REF.match(v.rsplit(":", 2)[0]) for v in svc.get("volumes", [])
    ):
        return "gateway API keys"
    if _required(env.get("FLOWER_BASIC_AUTH")) and env.get("FLOWER_UNAUTHENTICATED_API") == "false":
        return "flower basic auth"
    return None


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def privacy_problems(compose: dict) -> list[str]:
    """Every published port without authentication, every non-loopback port but the gateway's, every default secret."""
    problems = []
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            if _auth_of(name, svc) is None:
                problems.append(f"{name} publishes {port} without authentication")
            if not port.startswith("127.0.0.1:") and name != "gateway":
                problems.append(f"{name} publishes {port} beyond loopback (only the gateway is a door for tenants)")
        for key, value in (svc.get("environment") or {}).items():
            if _SECRET_NAME.search(key) and key != "FLOWER_UNAUTHENTICATED_API" and not _required(value):
                problems.append(f"{name}: {key} is not a required ${{VAR:?...}}: {value!r}")
    for text in _strings(compose):
        for m in re.finditer(r"\$\{(\w+):?-([^}]*)\}", text):
            if _SECRET_NAME.search(m.group(1)) or "KEYS" in m.group(1):
                problems.append(f"default secret ${{{m.group(1)}:-{m.group(2)}}}")
        for m in re.finditer(r"rediss?://([^@\s]*)@", text):
            if not re.fullmatch(r":\$\{\w+:\?[^}]*\}", m.group(1)):
                problems.append(f"a redis URL with a literal password: {m.group(0)}")
    return problems


def test_compose_is_private_by_default():
    assert privacy_problems(load()) == []


def test_the_privacy_check_catches_an_open_redis_and_a_default_password():
    """The check itself: the old compose file's faults are each reported."""
    compose = load()
    open_redis = copy.deepcopy(compose)
    open_redis["services"]["redis"]["command"] = ["redis-server", "--appendonly", "yes"]
    open_redis["services"]["redis"]["ports"] = ["6379:6379"]
    found = privacy_problems(open_redis)
    assert "redis publishes 6379:6379 without authentication" in found
    assert any("beyond loopback" in p for p in found)
    default_pw = copy.deepcopy(compose)
    default_pw["services"]["flower"]["environment"]["FLOWER_BASIC_AUTH"] = "${FLOWER_BASIC_AUTH:-admin:change-me}"
    assert any("FLOWER_BASIC_AUTH" in p for p in privacy_problems(default_pw))
    default_keys = copy.deepcopy(compose)
    default_keys["services"]["gateway"]["volumes"] = [
        "${TREADLE_KEYS_FILE:-./deploy/keys.example.toml}:/etc/treadle/keys.toml:ro"
    ]
    assert any("default secret" in p for p in privacy_problems(default_keys))
    literal = copy.deepcopy(compose)
    literal["services"]["worker"]["environment"]["TREADLE_BROKER_URL"] = "redis://:hunter2@redis:6379/0"
    assert any("literal password" in p for p in privacy_problems(literal))


def test_compose_refuses_to_start_without_each_operator_secret(tmp_path):
    full = {
        "REDIS_PASSWORD": "a",
        "MINIO_ROOT_USER": "b",
        "MINIO_ROOT_PASSWORD": "c",
        "FLOWER_BASIC_AUTH": "d:e",
        "TREADLE_KEYS_FILE": str(tmp_path / "k.toml"),
    }
    assert REQUIRED == set(full)
    interpolate(load(), full)
    for name in REQUIRED:
        with pytest.raises(MissingVariable, match=name):
            interpolate(load(), {**full, name: ""})


# ---------------------------------------------------------------- the services, run on the host


def _ce_datum(types_module, ids):
    return types_module.Datum(
        model_input=types_module.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def test_compose_services_train_through_the_gateway_and_the_sdk(compose_on_host, monkeypatch):
    import tinker
    from tinker import types as tt

    from treadle import ServiceClient
    from treadle import types as rt

    dep = compose_on_host
    assert redis.Redis.from_url(dep.broker_url).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(dep.broker_url.replace(":host-redis-pw-5c1e@", "")).ping()

    # One step through the gateway with the official tinker SDK, as a tenant would.
    monkeypatch.setenv("TINKER_BASE_URL", dep.gateway_url)
    monkeypatch.setenv("TINKER_API_KEY", COMPOSE_KEY)
    official = tinker.ServiceClient()
    try:
        tc = official.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        out = tc.forward_backward([_ce_datum(tt, [5, 6, 7, 8, 9, 10])], "cross_entropy").result()
        tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result()
        assert out.metrics["loss:sum"] > 0
    finally:
        official.close("success")

    # One step through the treadle SDK, as a trusted user of this host would, with a checkpoint in "MinIO".
    for key, value in dep.client_env.items():
        monkeypatch.setenv(key, value)
    sc = ServiceClient(broker_url=dep.broker_url, storage_url=dep.storage_url)
    rc = sc.create_lora_training_client("tiny", rank=4, seed=0)
    out = rc.forward_backward([_ce_datum(rt, [5, 6, 7, 8, 9, 10])], "cross_entropy").result(timeout=120)
    rc.optim_step(rt.AdamParams(learning_rate=1e-3)).result(timeout=60)
    path = rc.save_state("compose-step").result(timeout=120).path
    assert out.metrics["loss:sum"] > 0 and path.startswith("treadle://")
    assert any(c.treadle_path == path for c in sc.create_rest_client().list_checkpoints(rc.run_id))
    rc.stop()

    # The worker serves metrics on the port compose gives it (9400 there; a free port on this host), and it
    # counted the ops above.
    assert dep.compose["services"]["worker"]["environment"]["TREADLE_WORKER_METRICS_PORT"] == "9400"
    with urllib.request.urlopen(dep.worker_metrics_url, timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    trained = [
        s.value
        for s in families["treadle_tokens"].samples
        if s.labels.get("kind") == "trained" and s.name.endswith("_total")
    ]
    assert trained and trained[0] >= 10  # two forward_backwards of 5 tokens each


def _http_status(url: str) -> int:
    """The status of a GET, waiting (bounded) for the server to listen."""
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            assert time.monotonic() < deadline, f"nothing answers {url}"
            time.sleep(0.5)


def test_compose_flower_lists_the_worker_behind_basic_auth(compose_on_host):
    dep = compose_on_host
    assert _http_status(f"{dep.flower_url}/api/workers") == 401
    request = urllib.request.Request(
        f"{dep.flower_url}/api/workers?refresh=1", headers=basic_auth_header(dep.flower_auth)
    )
    deadline, seen = time.monotonic() + 90, {}
    while dep.worker_hostname not in seen:
        assert time.monotonic() < deadline, f"flower never listed {dep.worker_hostname}; saw {list(seen)}"
        with urllib.request.urlopen(request, timeout=30) as r:
            seen = json.load(r)
        time.sleep(0.5)


def test_every_treadle_service_of_compose_runs_on_the_host(compose_on_host):
    """Each service of the treadle image was started from compose.yaml and is still running after the others' tests."""
    dep = compose_on_host
    treadle_services = {name for name, svc in dep.compose["services"].items() if svc.get("image") == "treadle:latest"}
    assert treadle_services >= {"worker", "gateway", "flower"} and treadle_services <= set(dep.procs)
    exited = {name: proc.returncode for name, proc in dep.procs.items() if proc.poll() is not None}
    assert exited == {}, f"compose services exited: {exited}"
