"""`treadle up | worker | gateway | demo | flower | status | usage | checkpoints | models | runs | runner | training-runs`.

Each command's options are generated from a pydantic config, so `--help` documents every knob, and
each is read with one precedence everywhere (`treadle.config`): flag > environment > config file >
default. A command's environment variables are `TREADLE_<COMMAND>_<FIELD>` (`TREADLE_GATEWAY_PORT`,
`TREADLE_WORKER_MODEL`), plus the shared `TREADLE_BROKER_URL`, `TREADLE_RESULT_URL`, `TREADLE_STORAGE_URL`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from pydantic import BaseModel, Field

from treadle.config import ConfigError, add_config_args, config_from_args


class UpConfig(BaseModel):
    model: list[str] = Field(description="Models for the worker: a hub id, a dir, or NAME=DIR.")
    home: str = Field(
        default=os.path.expanduser("~/.treadle/local"), description="State, logs, Redis data and checkpoints."
    )
    port: int | None = Field(default=None, description="Redis port (default: a free one).")
    workers: int = Field(
        default=1, ge=0, description="Worker processes (0: Redis only; workers run elsewhere with `treadle worker`)."
    )
    runners: int = Field(default=1, ge=0, description="Batch-run runners (`treadle runs submit`).")
    redis_password: str | None = Field(
        default=None, description="Require this password on the stack's Redis (it is carried in the URLs)."
    )


def cmd_up(ns) -> None:
    from treadle.local_stack import LocalStack

    cfg = config_from_args(UpConfig, ns, "TREADLE_UP_", "up")
    stack = LocalStack(
        cfg.model, home=cfg.home, port=cfg.port, workers=cfg.workers, runners=cfg.runners, password=cfg.redis_password
    )
    print(
        f"starting redis on 127.0.0.1:{stack.port} and {cfg.workers} worker(s) for {', '.join(cfg.model)} and {cfg.runners} runner(s) ...",
        flush=True,
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    try:
        stack.start()
        print(
            f"treadle is up. In another shell:\n"
            f"  export TREADLE_BROKER_URL={stack.broker_url} TREADLE_STORAGE_URL={stack.storage_url}\n"
            f"  python -c 'from treadle import ServiceClient; print(ServiceClient().list_base_models())'\n"
            f"(ServiceClient() with no settings also finds this stack.) Logs: {stack.home}/logs. Ctrl-C stops it.",
            flush=True,
        )
        while not stop["now"]:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        stack.stop()


def cmd_worker(ns) -> None:
    from treadle.gpu_worker.worker_config import WorkerConfig
    from treadle.gpu_worker.wiring import run_worker

    run_worker(config_from_args(WorkerConfig, ns, "TREADLE_WORKER_", "worker"))


def cmd_gateway(ns) -> None:
    from treadle.gateway.settings import GatewaySettings
    from treadle.gateway.server import run_gateway

    run_gateway(config_from_args(GatewaySettings, ns, section="gateway"))


def cmd_demo(ns) -> None:
    from treadle.demo.main import DemoConfig, run_demo

    run_demo(config_from_args(DemoConfig, ns, "TREADLE_DEMO_", "demo"))


class FlowerConfig(BaseModel):
    broker_url: str | None = Field(
        default=None, description="Redis URL of the broker (default: the running `treadle up` stack)."
    )
    port: int = Field(default=5555, ge=1, le=65535, description="Port of Flower's web UI and API.")
    address: str = Field(
        default="127.0.0.1", description="Interface to listen on; any other than loopback needs FLOWER_BASIC_AUTH."
    )


def cmd_flower(ns) -> None:
    """Flower on the stack's broker. Flower reads its own FLOWER_* variables (FLOWER_BASIC_AUTH=user:password)."""
    cfg = config_from_args(FlowerConfig, ns, "TREADLE_FLOWER_", "flower")
    broker = _broker(cfg.broker_url)
    # Flower shows every task's arguments and can revoke tasks: beyond loopback it must ask for a password.
    if cfg.address not in ("127.0.0.1", "localhost", "::1") and not os.environ.get("FLOWER_BASIC_AUTH"):
        sys.exit(f"flower --address {cfg.address} is reachable from other hosts: set FLOWER_BASIC_AUTH=user:password")
    os.execvp(
        sys.executable,
        [
            sys.executable,
            "-m",
            "celery",
            "--broker",
            broker,
            "flower",
            f"--port={cfg.port}",
            f"--address={cfg.address}",
        ],
    )


def _broker(url: str | None) -> str:
    """The given Redis URL, else the running `treadle up` stack's, else exit with what to set."""
    if url is None:
        from treadle.local_stack import find_running_stack

        found = find_running_stack()
        url = found.broker_url if found else None
    if url is None:
        sys.exit("no broker: pass --broker_url or set TREADLE_BROKER_URL")
    return url


class StatusConfig(BaseModel):
    broker_url: str | None = Field(
        default=None, description="Redis URL of the deployment (default: the running `treadle up` stack)."
    )
    include_stopped: bool = Field(default=False, description="Also list stopped and expired sessions.")
    as_json: bool = Field(default=False, alias="json", description="One JSON object, for scripts.")


def cmd_status(ns) -> None:
    """Workers, sessions and queue depths, as tables or (--json) as one JSON object."""
    from treadle.queue.connections import connect_redis
    from treadle.status import collect_status, render

    cfg = config_from_args(StatusConfig, ns, "TREADLE_STATUS_", "status")
    report = collect_status(connect_redis(_broker(cfg.broker_url)), include_stopped=cfg.include_stopped)
    print(report.model_dump_json(indent=2) if cfg.as_json else render(report))


class UsageConfig(BaseModel):
    broker_url: str | None = Field(
        default=None, description="Redis URL of the deployment (default: the running `treadle up` stack)."
    )
    owner: str | None = Field(
        default=None, description="Only this owner (`sdk`: sessions of the treadle SDK); default: every owner."
    )
    since: str | None = Field(
        default=None,
        description="Only ops finished since then: an ISO date-time (UTC if no zone), Unix seconds, or an age like 90m, 24h, 7d.",
    )
    as_json: bool = Field(default=False, alias="json", description="One JSON object, for scripts.")


def parse_since(value: str, now: float | None = None) -> float:
    """Unix seconds of an ISO date-time, of Unix seconds, or of an age before `now` (`90m`, `24h`, `7d`)."""
    from datetime import datetime, timezone

    now = time.time() if now is None else now
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if value[-1:] in units and value[:-1].replace(".", "", 1).isdigit():
            return now - float(value[:-1]) * units[value[-1]]
        if value.replace(".", "", 1).isdigit():
            return float(value)
        at = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"since: {value!r} is not an ISO date-time, Unix seconds or an age like 24h") from None
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()


def cmd_usage(ns) -> None:
    """Metered usage per owner (treadle.metering): ops, prefill, sampled and trained tokens, compute seconds."""
    from treadle.metering import Meter
    from treadle.queue.connections import connect_redis

    cfg = config_from_args(UsageConfig, ns, "TREADLE_USAGE_", "usage")
    since = None if cfg.since is None else parse_since(cfg.since)
    meter = Meter(connect_redis(_broker(cfg.broker_url)))
    usage = {owner: meter.owner_usage(owner, since=since) for owner in ([cfg.owner] if cfg.owner else meter.owners())}
    if cfg.as_json:
        print(json.dumps({"since": since, "owners": {o: u.model_dump() for o, u in usage.items()}}, indent=2))
        return
    print(
        f"{'owner':<20} {'ops':>8} {'prefill':>12} {'sampled':>12} {'trained':>12} {'compute_s':>10} {'memory_gib_s':>12}"
    )
    for owner, u in usage.items():
        print(
            f"{owner:<20} {u.ops:>8} {u.prefill_tokens:>12} {u.sampled_tokens:>12} {u.trained_tokens:>12} "
            f"{u.compute_s:>10.2f} {u.memory_gib_s:>12.3f}"
        )


def cmd_runner(ns) -> None:
    from treadle.runs.cli import run_runner
    from treadle.runs.runner import RunnerConfig

    run_runner(config_from_args(RunnerConfig, ns, "TREADLE_RUNNER_", "runner"))


def add_batch_run_commands(sub) -> None:
    """`treadle runs submit|list|status|logs|stop` and `treadle runner` (treadle/runs/)."""
    from treadle.runs.cli import add_runs_parser
    from treadle.runs.runner import RunnerConfig

    add_runs_parser(sub.add_parser("runs", help="Batch runs: submit a command; a runner restarts and resumes it."))
    p = sub.add_parser("runner", help="Run a batch-run runner (`treadle up` starts one).")
    add_config_args(p, RunnerConfig, "TREADLE_RUNNER_")
    p.set_defaults(func=cmd_runner)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="Start the embedded local stack (Redis + workers) in the foreground.")
    add_config_args(p, UpConfig, "TREADLE_UP_")
    p.set_defaults(func=cmd_up)

    from treadle.gpu_worker.worker_config import WorkerConfig

    p = sub.add_parser("worker", help="Run a GPU worker.")
    add_config_args(p, WorkerConfig, "TREADLE_WORKER_")
    p.set_defaults(func=cmd_worker)

    from treadle.demo.main import DemoConfig
    from treadle.gateway.settings import GatewaySettings

    p = sub.add_parser("gateway", help="Run the Tinker-compatible HTTP gateway.")
    add_config_args(p, GatewaySettings)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("demo", help="The main job: GRPO teaches SmolLM2-135M-Instruct arithmetic, on CPU.")
    add_config_args(p, DemoConfig, "TREADLE_DEMO_")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("flower", help="Flower queue monitoring for the stack.")
    add_config_args(p, FlowerConfig, "TREADLE_FLOWER_")
    p.set_defaults(func=cmd_flower)

    p = sub.add_parser("status", help="Workers (alive, models, sessions, memory), sessions and queue depths.")
    add_config_args(p, StatusConfig, "TREADLE_STATUS_")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("usage", help="Metered usage (tokens, compute seconds) per owner, all-time or since a time.")
    add_config_args(p, UsageConfig, "TREADLE_USAGE_")
    p.set_defaults(func=cmd_usage)

    from treadle.checkpoints_cli import add_checkpoint_commands
    from treadle.models_cli import add_model_commands

    add_checkpoint_commands(sub)
    add_model_commands(sub)
    add_batch_run_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        ns.func(ns)
    except ConfigError as exc:
        parser.error(f"{ns.command}: {exc}")


if __name__ == "__main__":
    main()
