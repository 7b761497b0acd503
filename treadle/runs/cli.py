"""`treadle runs submit | list | status | logs | stop` and `treadle runner`.

Every command finds the stack's Redis by `--broker_url`, else `TREADLE_BROKER_URL`, else the running
`treadle up`. Logs are read from the blob store recorded in the run by its runner (for S3, boto3's
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
from pydantic import ValidationError

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


def cmd_submit(ns, store: RunStore) -> None:
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        sys.exit("nothing to run: treadle runs submit [options] -- COMMAND [ARGS ...]")
    cwd = os.path.abspath(ns.cwd or os.getcwd())
    log_dir = ns.log_dir or option_value(argv, "--log_dir")
    fields = {"name": ns.name or _default_name(argv), "command": argv, "cwd": cwd, "env": dict(os.environ),
              "resume_args": default_resume_args(argv) if ns.resume_args is None else shlex.split(ns.resume_args),
              "log_dir": os.path.join(cwd, log_dir) if log_dir else None}
    fields.update({k: getattr(ns, k) for k in ("max_restarts", "backoff_s", "backoff_max_s") if getattr(ns, k) is not None})
    try:
        spec = RunSpec.model_validate(fields)
    except ValidationError as exc:
        sys.exit("treadle runs submit: " + "; ".join(
            f"--{e['loc'][0]} {e.get('input')!r}: {e['msg']}" for e in exc.errors()))
    store.submit(spec)
    print(spec.name)
    if not live_runners(store.redis):
        print("note: no runner is alive; `treadle up` or `treadle runner` will start this run", file=sys.stderr)


def _summary(record: RunRecord) -> str:
    s = record.status
    step = (s.last_metrics or {}).get("step", "-")
    exit_code = "-" if s.last_exit_code is None else s.last_exit_code
    return (f"{record.name:<28} {s.state:<10} {s.restarts:>3}/{record.spec.max_restarts:<3} {exit_code!s:>5} "
            f"{step!s:>6}  {s.runner or '-':<20} {shlex.join(record.spec.command)[:60]}")


def cmd_list(ns, store: RunStore) -> None:
    records = store.list()
    if ns.json:
        for record in records:
            print(record.model_dump_json())
        return
    print(f"{'NAME':<28} {'STATE':<10} RESTARTS  EXIT   STEP  {'RUNNER':<20} COMMAND")
    for record in records:
        print(_summary(record))


def cmd_status(ns, store: RunStore) -> None:
    record = store.get(ns.name)
    if ns.json:
        print(record.model_dump_json(indent=2))
        return
    s, spec = record.status, record.spec
    print(f"name:        {record.name}\nstate:       {s.state}  ({s.message or 'no message'})\n"
          f"command:     {shlex.join(spec.command)}\ncwd:         {spec.cwd}\n"
          f"resume args: {shlex.join(spec.resume_args) or '(none: restarts unchanged)'}\n"
          f"restarts:    {s.restarts} of {spec.max_restarts}   adoptions: {s.adoptions}   attempts: {s.attempt}\n"
          f"last exit:   {s.last_exit_code}\nrunner:      {s.runner or '-'}  pid {s.pid or '-'} on {s.host or '-'}")
    print(f"metrics:     {json.dumps(s.last_metrics) if s.last_metrics else '-'}")
    print("checkpoints: " + ("\n             ".join(f"step {c['step']}: {c['state_path']}" for c in s.checkpoints) or "-"))
    if s.last_lines:
        print("last lines:\n  " + "\n  ".join(s.last_lines))


def _write_stdout(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def cmd_logs(ns, store: RunStore) -> None:
    record = store.get(ns.name)
    if not ns.follow:
        if record.status.log_url is not None:
            for _, data in read_segments(open_blob_store(record.status.log_url), ns.name):
                _write_stdout(data)
        return
    deadline = time.monotonic() + ns.timeout_s
    while record.status.log_url is None:  # no runner has taken it yet
        if record.finished or time.monotonic() > deadline:
            return
        time.sleep(ns.poll_s)
        record = store.get(ns.name)
    finished = follow(open_blob_store(record.status.log_url), ns.name, lambda: not store.get(ns.name).finished,
                      _write_stdout, ns.poll_s, max(0.0, deadline - time.monotonic()))
    if not finished:
        sys.exit(f"run {ns.name} still live after --timeout_s {ns.timeout_s}")


def cmd_stop(ns, store: RunStore) -> None:
    holder = f"cli-{socket.gethostname()}-{os.getpid()}"
    record = store.request_stop(ns.name, holder)
    deadline = time.monotonic() + ns.wait_s
    while not record.finished and time.monotonic() < deadline:
        time.sleep(0.2)
        # Again: when a dead runner's lease expires and no runner adopts the run first, it is stopped here.
        record = store.request_stop(ns.name, holder)
    print(f"{ns.name}: {record.status.state}")
    if not record.finished:
        sys.exit(f"run {ns.name} did not stop within --wait_s {ns.wait_s} (its runner stops it when it next looks)")


def add_runs_parser(parser: argparse.ArgumentParser) -> None:
    """The sub-commands of `treadle runs`."""
    sub = parser.add_subparsers(dest="runs_command", required=True)
    spec_help = {name: info.description for name, info in RunSpec.model_fields.items()}

    p = sub.add_parser("submit", help="Record a batch run; a runner starts, restarts and resumes it.",
                       usage="treadle runs submit [options] -- COMMAND [ARGS ...]")
    p.add_argument("--name", default=None, help=spec_help["name"] + " (default: the program's name + a random suffix)")
    p.add_argument("--max_restarts", type=int, default=None, help=spec_help["max_restarts"] + " (default: 5)")
    p.add_argument("--backoff_s", type=float, default=None, help=spec_help["backoff_s"] + " (default: 5)")
    p.add_argument("--backoff_max_s", type=float, default=None, help=spec_help["backoff_max_s"] + " (default: 300)")
    p.add_argument("--resume_args", default=None, help="Arguments appended on restart, one shell-quoted string; '' for "
                   "none (default: --resume for `-m treadle.recipes.*`, none otherwise).")
    p.add_argument("--log_dir", default=None, help=spec_help["log_dir"] + " (default: the command's --log_dir)")
    p.add_argument("--cwd", default=None, help="Working directory of the command (default: the current one).")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="The command, after `--`.")
    p.set_defaults(runs_func=cmd_submit)

    p = sub.add_parser("list", help="Every batch run: state, restarts, last exit code, last step.")
    p.add_argument("--json", action="store_true", help="One JSON record per line.")
    p.set_defaults(runs_func=cmd_list)

    p = sub.add_parser("status", help="One run: state, restarts, exit code, last metrics line, checkpoints, last lines.")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="The whole record as JSON.")
    p.set_defaults(runs_func=cmd_status)

    p = sub.add_parser("logs", help="A run's output, all attempts in order.")
    p.add_argument("name")
    p.add_argument("--follow", action="store_true", help="Keep printing new output until the run finishes.")
    p.add_argument("--poll_s", type=float, default=0.5, help="--follow: seconds between looks (default: 0.5).")
    p.add_argument("--timeout_s", type=float, default=86_400.0, help="--follow: give up after this long (default: a day).")
    p.set_defaults(runs_func=cmd_logs)

    p = sub.add_parser("stop", help="Stop a run (SIGTERM to its process group, SIGKILL after the runner's grace).")
    p.add_argument("name")
    p.add_argument("--wait_s", type=float, default=60.0, help="Wait this long for the run to be stopped (default: 60).")
    p.set_defaults(runs_func=cmd_stop)

    for p in sub.choices.values():
        p.add_argument("--broker_url", default=None, help="Redis URL of the stack (default: TREADLE_BROKER_URL, then `treadle up`).")
    parser.set_defaults(func=cmd_runs)


def cmd_runs(ns) -> None:
    store = RunStore(_redis(_stack_urls(ns.broker_url)[0]))
    try:
        ns.runs_func(ns, store)
    except TreadleError as exc:
        sys.exit(f"treadle runs {ns.runs_command}: {exc.message}")
    except redis_lib.RedisError as exc:
        sys.exit(f"treadle runs {ns.runs_command}: Redis at {ns.broker_url or 'the stack'}: {exc}")
