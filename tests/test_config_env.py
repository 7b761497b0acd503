"""Configuration precedence (flag > environment > config file > default) and every long-running command
(`up`, `worker`, `gateway`, `flower`) started as a subprocess configured only by environment variables."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
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
    assert (got.port, got.host, got.broker_url, got.models, got.verbose) == (
        5,
        "file-host",
        "redis://env",
        ["a", "b"],
        True,
    )
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


def _leaf_commands(parser, path=()):
    """(path, parser) of every command that runs: `worker`, `runs submit`, ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
    for name, child in subs[0].choices.items() if subs else ():
        yield from _leaf_commands(child, (*path, name))


def _commands():
    from treadle.cli import build_parser

    return dict(_leaf_commands(build_parser()))


@pytest.mark.parametrize("command", list(_commands()))
def test_every_option_of_every_command_is_absent_unless_given(command):
    """A flag not given must leave the namespace without it (argparse.SUPPRESS), or its argparse default would
    override the environment and the config file; and every command takes a config file."""
    parser = _commands()[command]
    options = [a for a in parser._actions if a.option_strings]
    assert [a.option_strings for a in options if a.default is not argparse.SUPPRESS] == []
    assert any("--config" in a.option_strings for a in options)
    assert parser.get_default("config_spec") is not None  # its options come from a pydantic config


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else json.dumps(value)


# command, positionals, option, section of the config file, then its value from the file, the environment, a flag
NEWLY_WIRED = [
    ("checkpoints", ["list"], "out", "checkpoints", "/from-file", "/from-env", "/from-flag"),
    ("checkpoints", ["list"], "storage_url", "checkpoints", "file:///f", "file:///e", "file:///x"),
    ("training-runs", [], "limit", "training-runs", 3, 4, 5),
    ("runs submit", ["--", "true"], "name", "runs.submit", "file-run", "env-run", "flag-run"),
    ("runs list", [], "broker_url", "runs.list", "redis://file", "redis://env", "redis://flag"),
    ("runs status", ["r-1"], "json", "runs.status", False, True, False),
    ("runs logs", ["r-1"], "poll_s", "runs.logs", 1.5, 2.5, 3.5),
    ("runs stop", ["r-1"], "wait_s", "runs.stop", 7.0, 8.0, 9.0),
]


@pytest.mark.parametrize("command,positionals,option,section,from_file,from_env,from_flag", NEWLY_WIRED)
def test_environment_beats_the_file_and_a_flag_beats_the_environment(
    command, positionals, option, section, from_file, from_env, from_flag, tmp_path, monkeypatch
):
    from treadle.cli import build_parser
    from treadle.config import config_of

    cfg_file = tmp_path / "treadle.toml"
    cfg_file.write_text(f"[{section}]\n{option} = {_toml(from_file)}\n")
    monkeypatch.setenv("TREADLE_CONFIG", str(cfg_file))
    flag = [f"--{option}" if from_flag is not False else f"--no-{option}"] + (
        [] if isinstance(from_flag, bool) else [str(from_flag)]
    )

    def resolved(*flags: str):
        ns = build_parser().parse_args([*command.split(), *flags, *positionals])
        model, prefix, _ = ns.config_spec
        name = next(n for n, i in model.model_fields.items() if (i.alias or n) == option)  # `json` is `as_json`
        return getattr(config_of(ns), name), prefix

    got, prefix = resolved()
    assert got == from_file
    monkeypatch.setenv(f"{prefix}{option}".upper(), _toml(from_env).strip('"'))
    assert resolved()[0] == from_env
    assert resolved(*flag)[0] == from_flag


# ---------------------------------------------------------------- the commands, configured by environment only


def _treadle(command: str, env: dict[str, str], log) -> subprocess.Popen:
    """`treadle <command>` with no flags at all; the TREADLE_* of the test process are dropped first."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "FLOWER_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", command],
        env={**base, "OMP_NUM_THREADS": "1", **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        # as from a terminal: a test run started in the background (`... &`) ignores SIGINT
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


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
        _treadle(
            "worker",
            {
                **shared,
                "TREADLE_WORKER_MODEL": f"env-tiny={tiny_model_dir}",
                "TREADLE_WORKER_HOSTNAME": hostname,
                "TREADLE_WORKER_LEASE_TTL_S": "3",
                "TREADLE_WORKER_TASK_EVENTS": "true",
            },
            log,
        ),
        _treadle(
            "gateway",
            {**shared, "TREADLE_GATEWAY_PORT": str(gw_port), "TREADLE_GATEWAY_API_KEYS": json.dumps({KEY: "env"})},
            log,
        ),
        _treadle("flower", {**shared, "TREADLE_FLOWER_PORT": str(fl_port), "FLOWER_UNAUTHENTICATED_API": "true"}, log),
    ]
    try:
        registry = WorkerRegistry(redis.Redis.from_url(stack.broker_url))
        worker = _wait(
            "the env-configured worker",
            lambda: next((w for w in registry.live_workers() if w.hostname == hostname), None),
            procs,
        )
        assert [m.name for m in worker.models] == ["env-tiny"]
        caps = _wait(
            "the gateway",
            lambda: _get_json(f"http://127.0.0.1:{gw_port}/api/v1/get_server_capabilities", {"X-API-Key": KEY}),
            procs,
        )
        assert {"env-tiny", "tiny"} <= {m["model_name"] for m in caps["supported_models"]}
        _wait(
            "flower listing the worker",
            lambda: hostname in _get_json(f"http://127.0.0.1:{fl_port}/api/workers?refresh=1"),
            procs,
        )
        # TREADLE_WORKER_TASK_EVENTS: the worker sends task events, so Flower lists the session's op and its outcome.
        tc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url).create_lora_training_client(
            "env-tiny", rank=4
        )
        tc.save_state("events").result()
        op = f"{tc.session_id}:1"
        task = _wait("flower listing the op", lambda: _get_json(f"http://127.0.0.1:{fl_port}/api/tasks").get(op), procs)
        _wait(
            "flower seeing the op succeed",
            lambda: _get_json(f"http://127.0.0.1:{fl_port}/api/task/info/{op}")["state"] == "SUCCESS",
            procs,
        )
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
        proc = _treadle(
            "up",
            {
                "TREADLE_UP_MODEL": f"tiny={tiny_model_dir}",
                "TREADLE_UP_HOME": home,
                "TREADLE_UP_WORKERS": "0",
                "TREADLE_UP_RUNNERS": "0",
                "TREADLE_UP_PORT": str(port),
                "TREADLE_UP_REDIS_PASSWORD": password,
            },
            log,
        )
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


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`treadle <args>` to completion, with the test process's TREADLE_* dropped first."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def test_training_runs_reads_its_store_from_flag_env_then_file(tmp_path):
    """Three checkpoint stores, one run in each: the one listed is the store of the highest layer set."""
    from treadle.storage.checkpoint_store import CheckpointStore

    urls = {}
    for layer in ("file", "env", "flag"):
        urls[layer] = f"file://{tmp_path / layer}"
        CheckpointStore.from_url(urls[layer]).put_run(f"run-from-{layer}", {"base_model": "tiny"})
    cfg_file = tmp_path / "treadle.toml"
    cfg_file.write_text(f'[training-runs]\nstorage_url = "{urls["file"]}"\n')

    def listed(env, *flags):
        out = _run(["training-runs", *flags], {"TREADLE_CONFIG": str(cfg_file), **env})
        assert out.returncode == 0, out.stderr
        return [json.loads(line)["training_run_id"] for line in out.stdout.splitlines()]

    assert listed({}) == ["run-from-file"]
    env = {"TREADLE_TRAINING_RUNS_STORAGE_URL": urls["env"]}
    assert listed(env) == ["run-from-env"]
    assert listed(env, "--storage_url", urls["flag"]) == ["run-from-flag"]


def test_runs_list_reads_its_broker_from_env_over_the_file_and_a_flag_over_env(redis_url, redis_client, tmp_path):
    """The losing layers name a Redis where nothing listens: the command works only if the right one wins."""
    from treadle.runs.records import RunSpec, RunStore

    RunStore(redis_client).submit(RunSpec(name="env-listed", command=["true"], cwd=str(tmp_path)))
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    cfg_file = tmp_path / "treadle.toml"
    cfg_file.write_text(f'[runs.list]\nbroker_url = "{nowhere}"\n')
    env = {"TREADLE_CONFIG": str(cfg_file), "TREADLE_RUNS_LIST_BROKER_URL": redis_url, "TREADLE_RUNS_LIST_JSON": "true"}
    out = _run(["runs", "list"], env)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["spec"]["name"] for line in out.stdout.splitlines()] == ["env-listed"]
    out = _run(["runs", "list", "--broker_url", redis_url], {**env, "TREADLE_RUNS_LIST_BROKER_URL": nowhere})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["spec"]["name"] == "env-listed"


def test_operations_doc_lists_every_command():
    """docs/operations.md's list of the commands this precedence holds for names each one the CLI has."""
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    paragraph = doc.split("## Configuration", 1)[1].split("\n\n")[1]
    listed = set()
    for quoted in re.findall(r"`([^`]+)`", paragraph):  # `runs submit|list` is `runs submit` and `runs list`
        *head, last = quoted.split()
        listed |= {" ".join([*head, alt]) for alt in last.split("|")}
    assert set(_commands()) - listed == set()
