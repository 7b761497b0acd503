"""`treadle runs submit | list | status | logs | stop` and `treadle runner`.

Each sub-command's options are a pydantic config (flag > environment > config file > default, as every
treadle command): `TREADLE_RUNS_<SUB>_<FIELD>` (`TREADLE_RUNS_LOGS_POLL_S`), a `[runs.<sub>]` table of
the config file. Every command finds the stack's Redis by `--broker_url`, else `TREADLE_RUNS_<SUB>_BROKER_URL`,
else `TREADLE_BROKER_URL`, else the config file, else the running `treadle up`. Logs are read from the blob store recorded in the run by its runner (for S3, boto3's
usual AWS_* variables supply the endpoint and keys).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import sys
import time
import uuid

import redis as redis_lib
from pydantic import BaseModel, Field, ValidationError

from treadle.config import add_config_args, config_of
from treadle.errors import TreadleError
from treadle.runs.logs import follow, read_segments
from treadle.runs.records import RunRecord, RunSpec, RunStore
from treadle.runs.runner import Runner, RunnerConfig, live_runners
from treadle.settings import ConnectionSettings
from treadle.storage import open_blob_store


def _stack_urls(broker_url: str | None, storage_url: str | None = None) -> tuple[str, str | None]:
    settings = ConnectionSettings()
    broker_url, storage_url = broker_url or settings.broker_url, storage_url or settings.storage_url
    if broker_url is None:
        from treadle.local_stack import find_running_stack

        found = find_running_stack()
        if found is None:
            sys.exit("no stack: pass --broker_url, set TREADLE_BROKER_URL, or start `treadle up`")
        broker_url, storage_url = found.broker_url, storage_url or found.storage_url
    return broker_url, storage_url


def _redis(url: str):
    """Bounded waits on every call: a Redis that is down fails a command within seconds."""
    return redis_lib.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30)


# -------------------------------------------------------------------- treadle runner
def run_runner(cfg: RunnerConfig) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker_url, storage_url = _stack_urls(cfg.broker_url, cfg.log_url)
    if storage_url is None:
        sys.exit("no log store: pass --log_url or set TREADLE_STORAGE_URL")
    blobs = open_blob_store(storage_url)
    blobs.check()
    runner_id = cfg.runner_id or f"{socket.gethostname()}-{os.getpid()}"
    runner = Runner(cfg, RunStore(_redis(broker_url), ttl_ms=int(cfg.lease_ttl_s * 1000)), blobs, runner_id)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.shutdown())
    runner.serve()


# -------------------------------------------------------------------- treadle runs ...
_SPEC = RunSpec.model_fields


class _RunsCommand(BaseModel):
    broker_url: str | None = Field(default=None, description="Redis URL of the stack (None: the running `treadle up`).")


class RunsSubmitConfig(_RunsCommand):
    name: str | None = Field(
        default=None, description=_SPEC["name"].description + " (None: the program's name + a random suffix)"
    )
    # No bounds here: RunSpec checks them, and its message names the option and the limit.
    max_restarts: int | None = Field(default=None, description=_SPEC["max_restarts"].description + " (None: 5)")
    backoff_s: float | None = Field(default=None, description=_SPEC["backoff_s"].description + " (None: 5)")
    backoff_max_s: float | None = Field(default=None, description=_SPEC["backoff_max_s"].description + " (None: 300)")
    resume_args: str | None = Field(
        default=None,
        description="Arguments appended on restart, one shell-quoted string; '' for "
        "none (None: --resume for `-m treadle.recipes.*`, none otherwise).",
    )
    log_dir: str | None = Field(
        default=None, description=_SPEC["log_dir"].description + " (None: the command's --log_dir)"
    )
    stall_s: float | None = Field(default=None, description=_SPEC["stall_s"].description + " (None: 1800)")
    cwd: str | None = Field(default=None, description="Working directory of the command (None: the current one).")


class RunsListConfig(_RunsCommand):
    as_json: bool = Field(default=False, alias="json", description="One JSON record per line.")


class RunsStatusConfig(_RunsCommand):
    as_json: bool = Field(default=False, alias="json", description="The whole record as JSON.")


class RunsLogsConfig(_RunsCommand):
    follow: bool = Field(default=False, description="Keep printing new output until the run finishes.")
    poll_s: float = Field(default=0.5, gt=0.0, description="--follow: seconds between looks.")
    timeout_s: float = Field(
        default=86_400.0, ge=0.0, description="--follow: give up after this long (default: a day)."
    )


class RunsStopConfig(_RunsCommand):
    wait_s: float = Field(default=60.0, ge=0.0, description="Wait this long for the run to be stopped.")


def default_resume_args(argv: list[str]) -> list[str]:
    """treadle's recipes (`python -m treadle.recipes.<name>`) resume with `--resume`; other commands restart as they are."""
    modules = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"]
    return ["--resume"] if any(m.startswith("treadle.recipes.") for m in modules) else []


def option_value(argv: list[str], option: str) -> str | None:
    """The value of `--option X` or `--option=X` in argv, the last one winning."""
    value = None
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(option + "="):
            value = arg.partition("=")[2]
    return value


def _default_name(argv: list[str]) -> str:
    modules = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"]
    stem = modules[-1].rpartition(".")[2] if modules else os.path.basename(argv[0])
    return f"{''.join(c if c.isalnum() or c in '._-' else '-' for c in stem)[:100] or 'run'}-{uuid.uuid4().hex[:6]}"


def cmd_submit(ns, cfg: RunsSubmitConfig, store: RunStore) -> None:
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        sys.exit("nothing to run: treadle runs submit [options] -- COMMAND [ARGS ...]")
    cwd = os.path.abspath(cfg.cwd or os.getcwd())
    log_dir = cfg.log_dir or option_value(argv, "--log_dir")
    fields = {
        "name": cfg.name or _default_name(argv),
        "command": argv,
        "cwd": cwd,
        "env": dict(os.environ),
        "resume_args": default_resume_args(argv) if cfg.resume_args is None else shlex.split(cfg.resume_args),
        "log_dir": os.path.join(cwd, log_dir) if log_dir else None,
    }
    fields.update(
        {
            k: getattr(cfg, k)
            for k in ("max_restarts", "backoff_s", "backoff_max_s", "stall_s")
            if getattr(cfg, k) is not None
        }
    )
    try:
        spec = RunSpec.model_validate(fields)
    except ValidationError as exc:
        sys.exit(
            "treadle runs submit: " + "; ".join(f"--{e['loc'][0]} {e.get('input')!r}: {e['msg']}" for e in exc.errors())
        )
    store.submit(spec)
    print(spec.name)
    if not live_runners(store.redis):
        print("note: no runner is alive; `treadle up` or `treadle runner` will start this run", file=sys.stderr)


def _summary(record: RunRecord) -> str:
    s = record.status
    step = (s.last_metrics or {}).get("step", "-")
    exit_code = "-" if s.last_exit_code is None else s.last_exit_code
    return (
        f"{record.name:<28} {s.state:<10} {s.restarts:>3}/{record.spec.max_restarts:<3} {exit_code!s:>5} "
        f"{step!s:>6}  {s.runner or '-':<20} {shlex.join(record.spec.command)[:60]}"
    )


def cmd_list(ns, cfg: RunsListConfig, store: RunStore) -> None:
    records = store.list()
    if cfg.as_json:
        for record in records:
            print(record.model_dump_json())
        return
    print(f"{'NAME':<28} {'STATE':<10} RESTARTS  EXIT   STEP  {'RUNNER':<20} COMMAND")
    for record in records:
        print(_summary(record))


def cmd_status(ns, cfg: RunsStatusConfig, store: RunStore) -> None:
    record = store.get(ns.name)
    if cfg.as_json:
        print(record.model_dump_json(indent=2))
        return
    s, spec = record.status, record.spec
    print(
        f"name:        {record.name}\nstate:       {s.state}  ({s.message or 'no message'})\n"
        f"command:     {shlex.join(spec.command)}\ncwd:         {spec.cwd}\n"
        f"resume args: {shlex.join(spec.resume_args) or '(none: restarts unchanged)'}\n"
        f"restarts:    {s.restarts} of {spec.max_restarts}   adoptions: {s.adoptions}   attempts: {s.attempt}\n"
        f"last exit:   {s.last_exit_code}\nrunner:      {s.runner or '-'}  pid {s.pid or '-'} on {s.host or '-'}"
    )
    print(f"metrics:     {json.dumps(s.last_metrics) if s.last_metrics else '-'}")
    print(
        "checkpoints: " + ("\n             ".join(f"step {c['step']}: {c['state_path']}" for c in s.checkpoints) or "-")
    )
    if s.last_lines:
        print("last lines:\n  " + "\n  ".join(s.last_lines))


def _write_stdout(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def cmd_logs(ns, cfg: RunsLogsConfig, store: RunStore) -> None:
    record = store.get(ns.name)
    if not cfg.follow:
        if record.status.log_url is not None:
            for _, data in read_segments(open_blob_store(record.status.log_url), ns.name):
                _write_stdout(data)
        return
    deadline = time.monotonic() + cfg.timeout_s
    while record.status.log_url is None:  # no runner has taken it yet
        if record.finished or time.monotonic() > deadline:
            return
        time.sleep(cfg.poll_s)
        record = store.get(ns.name)
    finished = follow(
        open_blob_store(record.status.log_url),
        ns.name,
        lambda: not store.get(ns.name).finished,
        _write_stdout,
        cfg.poll_s,
        max(0.0, deadline - time.monotonic()),
    )
    if not finished:
        sys.exit(f"run {ns.name} still live after --timeout_s {cfg.timeout_s}")


def cmd_stop(ns, cfg: RunsStopConfig, store: RunStore) -> None:
    holder = f"cli-{socket.gethostname()}-{os.getpid()}"
    record = store.request_stop(ns.name, holder)
    deadline = time.monotonic() + cfg.wait_s
    while not record.finished and time.monotonic() < deadline:
        time.sleep(0.2)
        # Again: when a dead runner's lease expires and no runner adopts the run first, it is stopped here.
        record = store.request_stop(ns.name, holder)
    print(f"{ns.name}: {record.status.state}")
    if not record.finished:
        sys.exit(f"run {ns.name} did not stop within --wait_s {cfg.wait_s} (its runner stops it when it next looks)")


def add_runs_parser(parser: argparse.ArgumentParser) -> None:
    """The sub-commands of `treadle runs`."""
    sub = parser.add_subparsers(dest="runs_command", required=True)

    def command(name: str, config: type[BaseModel], func, **kwargs) -> argparse.ArgumentParser:
        p = sub.add_parser(name, **kwargs)
        add_config_args(p, config, f"TREADLE_RUNS_{name.upper()}_", section=f"runs.{name}")
        p.set_defaults(runs_func=func)
        return p

    p = command(
        "submit",
        RunsSubmitConfig,
        cmd_submit,
        help="Record a batch run; a runner starts, restarts and resumes it.",
        usage="treadle runs submit [options] -- COMMAND [ARGS ...]",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER, help="The command, after `--`.")
    command("list", RunsListConfig, cmd_list, help="Every batch run: state, restarts, last exit code, last step.")
    p = command(
        "status",
        RunsStatusConfig,
        cmd_status,
        help="One run: state, restarts, exit code, last metrics line, checkpoints, last lines.",
    )
    p.add_argument("name")
    p = command("logs", RunsLogsConfig, cmd_logs, help="A run's output, all attempts in order.")
    p.add_argument("name")
    p = command(
        "stop",
        RunsStopConfig,
        cmd_stop,
        help="Stop a run (SIGTERM to its process group, SIGKILL after the runner's grace).",
    )
    p.add_argument("name")
    parser.set_defaults(func=cmd_runs)


def cmd_runs(ns) -> None:
    cfg = config_of(ns)
    store = RunStore(_redis(_stack_urls(cfg.broker_url)[0]))
    try:
        ns.runs_func(ns, cfg, store)
    except TreadleError as exc:
        sys.exit(f"treadle runs {ns.runs_command}: {exc.message}")
    except redis_lib.RedisError as exc:
        sys.exit(f"treadle runs {ns.runs_command}: Redis at {cfg.broker_url or 'the stack'}: {exc}")
