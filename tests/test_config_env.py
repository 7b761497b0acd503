"""Configuration precedence (flag > environment > config file > default) and every long-running command
(`up`, `worker`, `gateway`, `flower`) started as a subprocess configured only by environment variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import redis
from pydantic import BaseModel, Field

from treadle import ServiceClient
from treadle.config import ConfigError, load_config, parse_config
from treadle.local_stack import find_running_stack, free_port
from treadle.queue.workers import WorkerRegistry

KEY = "tml-env-only-key"


class Example(BaseModel):
    port: int = Field(default=1, ge=1, description="A port.")
    host: str = Field(default="default-host", description="A host.")
    broker_url: str | None = Field(default=None, description="A shared connection field.")
    models: list[str] = Field(default_factory=list, description="A list.")
    verbose: bool = Field(default=False, description="A flag.")


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    cfg_file = tmp_path / "treadle.toml"
    cfg_file.write_text('[example]\nport = 3\nhost = "file-host"\nbroker_url = "redis://file"\n')
    env = {"T_EX_PORT": "4", "TREADLE_BROKER_URL": "redis://env", "T_EX_MODELS": "a,b", "T_EX_VERBOSE": "true"}
    got = load_config(Example, {"port": 5}, env_prefix="T_EX_", config_file=cfg_file, section="example", environ=env)
    assert (got.port, got.host, got.broker_url, got.models, got.verbose) == (5, "file-host", "redis://env", ["a", "b"], True)
    assert load_config(Example, {}, env_prefix="T_EX_", environ={}).host == "default-host"
    # The command-specific variable wins over the shared one.
    env["T_EX_BROKER_URL"] = "redis://specific"
    assert load_config(Example, {}, env_prefix="T_EX_", environ=env).broker_url == "redis://specific"


def test_a_flag_not_given_never_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("T_EX_HOST", "env-host")
    monkeypatch.setenv("T_EX_MODELS", '["x=1", "y=2"]')
    cfg = parse_config(Example, ["--port", "7"], env_prefix="T_EX_")
    assert (cfg.port, cfg.host, cfg.models, cfg.verbose) == (7, "env-host", ["x=1", "y=2"], False)
    assert parse_config(Example, ["--host", "flag-host", "--no-verbose"], env_prefix="T_EX_").host == "flag-host"


def test_bad_values_name_the_field_the_value_and_the_source(tmp_path):
    with pytest.raises(ConfigError, match=r"port: .*greater than or equal to 1 .*got .0. from \$T_EX_PORT\)"):
        load_config(Example, {}, env_prefix="T_EX_", environ={"T_EX_PORT": "0"})
    bad_file = tmp_path / "c.toml"
    bad_file.write_text("prot = 3\n")
    with pytest.raises(ValueError, match="unknown option.*prot"):
        load_config(Example, {}, config_file=bad_file, environ={})
    with pytest.raises(ValueError, match=r"\$T_EX_MODELS: models needs JSON"):
        load_config(Example, {}, env_prefix="T_EX_", environ={"T_EX_MODELS": "[not json"})


def test_every_command_documents_its_environment_variables():
    from treadle.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    helps = {name: sub[name].format_help().replace("\n", " ") for name in ("up", "worker", "gateway", "flower")}
    assert "$TREADLE_UP_REDIS_PASSWORD" in helps["up"]
    assert "$TREADLE_WORKER_MODEL" in helps["worker"] and "$TREADLE_BROKER_URL" in helps["worker"]
    assert "$TREADLE_GATEWAY_PORT" in helps["gateway"] and "$TREADLE_GATEWAY_BROKER_URL" in helps["gateway"]
    assert "$TREADLE_FLOWER_PORT" in helps["flower"]


# ---------------------------------------------------------------- the commands, configured by environment only


def _treadle(command: str, env: dict[str, str], log) -> subprocess.Popen:
    """`treadle <command>` with no flags at all; the TREADLE_* of the test process are dropped first."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "FLOWER_"))}
    return subprocess.Popen([sys.executable, "-m", "treadle.cli", command], env={**base, "OMP_NUM_THREADS": "1", **env},
                            stdout=log, stderr=subprocess.STDOUT)


def _wait(what: str, check, procs, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            assert proc.poll() is None, f"{what}: {proc.args} exited with {proc.returncode}"
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} not seen within {timeout} s"
        time.sleep(0.5)


def _get_json(url: str, headers: dict | None = None):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return json.load(r)


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_worker_gateway_and_flower_use_only_their_environment(stack, tiny_model_dir, tmp_path):
    """A worker serving `env-tiny` under a chosen hostname, a gateway on a chosen port with a chosen key, Flower on
    a chosen port: each proves it read the shared Redis URL (with its password) and its own variables."""
    hostname = "env-only-worker@test"
    gw_port, fl_port = free_port(), free_port()
    shared = {"TREADLE_BROKER_URL": stack.broker_url, "TREADLE_STORAGE_URL": stack.storage_url}
    log = open(tmp_path / "commands.log", "wb")
    procs = [
        _treadle("worker", {**shared, "TREADLE_WORKER_MODEL": f"env-tiny={tiny_model_dir}",
                            "TREADLE_WORKER_HOSTNAME": hostname, "TREADLE_WORKER_LEASE_TTL_S": "3",
                            "TREADLE_WORKER_TASK_EVENTS": "true"}, log),
        _treadle("gateway", {**shared, "TREADLE_GATEWAY_PORT": str(gw_port), "TREADLE_GATEWAY_API_KEYS": json.dumps({KEY: "env"})}, log),
        _treadle("flower", {**shared, "TREADLE_FLOWER_PORT": str(fl_port), "FLOWER_UNAUTHENTICATED_API": "true"}, log),
    ]
    try:
        registry = WorkerRegistry(redis.Redis.from_url(stack.broker_url))
        worker = _wait("the env-configured worker", lambda: next((w for w in registry.live_workers() if w.hostname == hostname), None), procs)
        assert [m.name for m in worker.models] == ["env-tiny"]
        caps = _wait("the gateway", lambda: _get_json(f"http://127.0.0.1:{gw_port}/api/v1/get_server_capabilities", {"X-API-Key": KEY}), procs)
        assert {"env-tiny", "tiny"} <= {m["model_name"] for m in caps["supported_models"]}
        _wait("flower listing the worker", lambda: hostname in _get_json(f"http://127.0.0.1:{fl_port}/api/workers?refresh=1"), procs)
        # TREADLE_WORKER_TASK_EVENTS: the worker sends task events, so Flower lists the session's op and its outcome.
        tc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url).create_lora_training_client("env-tiny", rank=4)
        tc.save_state("events").result()
        op = f"{tc.session_id}:1"
        task = _wait("flower listing the op", lambda: _get_json(f"http://127.0.0.1:{fl_port}/api/tasks").get(op), procs)
        _wait("flower seeing the op succeed", lambda: _get_json(f"http://127.0.0.1:{fl_port}/api/task/info/{op}")["state"] == "SUCCESS", procs)
        assert task["name"] == "treadle.op.save_state" and task["worker"] == hostname
    finally:
        _stop(procs)
        log.close()
    assert not registry.is_alive(hostname)  # SIGTERM: a clean shutdown that withdrew it


def test_up_uses_only_its_environment(tiny_model_dir, tmp_path):
    """`treadle up` on the port, home, Redis password and process counts from TREADLE_UP_* (Redis only: the
    worker command has its own test above): Redis refuses a client without the password."""
    home, port, password = str(tmp_path / "home"), free_port(), "env-only-secret"
    with open(tmp_path / "up.log", "wb") as log:
        proc = _treadle("up", {"TREADLE_UP_MODEL": f"tiny={tiny_model_dir}", "TREADLE_UP_HOME": home, "TREADLE_UP_WORKERS": "0",
                               "TREADLE_UP_RUNNERS": "0", "TREADLE_UP_PORT": str(port), "TREADLE_UP_REDIS_PASSWORD": password}, log)
        try:
            info = _wait("the stack", lambda: find_running_stack(home), [proc])
            assert info.broker_url == f"redis://:{password}@127.0.0.1:{port}/0"
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port).ping()
            assert len(info.pids) == 1  # Redis alone, as TREADLE_UP_WORKERS=0 and TREADLE_UP_RUNNERS=0 asked
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    assert proc.returncode == 0
