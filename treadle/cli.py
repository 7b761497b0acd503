"""`treadle up | worker | gateway | demo | flower | checkpoints | runs`.

Each command's options are generated from a pydantic config, so `--help` documents every knob.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import typing

from pydantic import BaseModel, Field


def add_config_args(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One `--field` per config field, with its type, default and description."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        default = info.default_factory() if info.default_factory is not None else info.default
        help_text = f"{info.description or ''} (default: {default!r})" if not info.is_required() else f"{info.description or ''} (required)"
        if annotation is bool:
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=info.default, help=help_text)
        elif origin is dict:
            parser.add_argument(f"--{name}", type=json.loads, default=None, help=help_text + " [JSON]")
        elif origin is list:
            parser.add_argument(f"--{name}", action="append", required=info.is_required(), help=help_text + " [repeatable]")
        else:
            kind = args[0] if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args else annotation
            kind = kind if kind in (int, float, str) else str
            parser.add_argument(f"--{name}", type=kind, default=None if info.is_required() else info.default,
                                required=info.is_required(), help=help_text)


def config_from_args(model: type[BaseModel], ns: argparse.Namespace):
    return model.model_validate({k: v for k, v in vars(ns).items() if k in model.model_fields and v is not None})


class UpConfig(BaseModel):
    model: list[str] = Field(description="Models for the worker: a hub id, a dir, or NAME=DIR.")
    home: str = Field(default=os.path.expanduser("~/.treadle/local"), description="State, logs, Redis data and checkpoints.")
    port: int | None = Field(default=None, description="Redis port (default: a free one).")
    workers: int = Field(default=1, ge=1, description="Worker processes.")


def cmd_up(ns) -> None:
    from treadle.local_stack import LocalStack

    cfg = config_from_args(UpConfig, ns)
    stack = LocalStack(cfg.model, home=cfg.home, port=cfg.port, workers=cfg.workers)
    print(f"starting redis on 127.0.0.1:{stack.port} and {cfg.workers} worker(s) for {', '.join(cfg.model)} ...", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    try:
        stack.start()
        print(f"treadle is up. In another shell:\n"
              f"  export TREADLE_BROKER_URL={stack.broker_url} TREADLE_STORAGE_URL={stack.storage_url}\n"
              f"  python -c 'from treadle import ServiceClient; print(ServiceClient().list_base_models())'\n"
              f"(ServiceClient() with no settings also finds this stack.) Logs: {stack.home}/logs. Ctrl-C stops it.", flush=True)
        while not stop["now"]:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        stack.stop()


def cmd_worker(ns) -> None:
    from treadle.gpu_worker.worker_main import WorkerConfig, run_worker

    run_worker(config_from_args(WorkerConfig, ns))


def cmd_gateway(ns) -> None:
    from treadle.gateway.settings import GatewaySettings
    from treadle.gateway.server import run_gateway

    run_gateway(config_from_args(GatewaySettings, ns))


def cmd_demo(ns) -> None:
    from treadle.demo.main import DemoConfig, run_demo

    run_demo(config_from_args(DemoConfig, ns))


def cmd_flower(ns) -> None:
    """Flower on the stack's broker (`FLOWER_UNAUTHENTICATED_API=true` opens its /api too)."""
    from treadle.settings import ConnectionSettings

    broker = ns.broker_url or ConnectionSettings().broker_url
    if broker is None:
        from treadle.local_stack import find_running_stack

        found = find_running_stack()
        broker = found.broker_url if found else None
    if broker is None:
        sys.exit("no broker: pass --broker_url or set TREADLE_BROKER_URL")
    os.execvp(sys.executable, [sys.executable, "-m", "celery", "--broker", broker, "flower",
                               f"--port={ns.port}", f"--address={ns.address}"])


def _rest(ns):
    from treadle.sdk.rest_client import RestClient
    from treadle.settings import ConnectionSettings

    url = ns.storage_url or ConnectionSettings().storage_url
    if url is None:
        from treadle.local_stack import find_running_stack

        found = find_running_stack()
        url = found.storage_url if found else None
    return RestClient(url)


def cmd_checkpoints(ns) -> None:
    rest = _rest(ns)
    if ns.action == "list":
        runs = [ns.target] if ns.target else [r.training_run_id for r in rest.list_training_runs(limit=10_000)]
        for run in runs:
            for c in rest.list_checkpoints(run):
                expires = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.expires_at)) if c.expires_at else "never"
                print(f"{c.treadle_path}\t{c.size_bytes or 0:>12,d} B\texpires {expires}")
    elif ns.action == "info":
        print(rest.manifest(ns.target).model_dump_json(indent=2))
    elif ns.action == "download":
        print(rest.download(ns.target, ns.out))
    elif ns.action == "export":
        print(rest.export(ns.target, ns.out, merged=ns.merged))
    elif ns.action == "delete":
        rest.delete_checkpoint(ns.target)
        print(f"deleted {ns.target}")
    elif ns.action == "gc":
        removed = rest.gc()
        print("\n".join(removed) or "nothing expired")


def cmd_runs(ns) -> None:
    for run in _rest(ns).list_training_runs(limit=ns.limit):
        print(json.dumps(run.model_dump(), default=str))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="Start the embedded local stack (Redis + workers) in the foreground.")
    add_config_args(p, UpConfig)
    p.set_defaults(func=cmd_up)

    from treadle.gpu_worker.worker_main import WorkerConfig

    p = sub.add_parser("worker", help="Run a GPU worker.")
    add_config_args(p, WorkerConfig)
    p.set_defaults(func=cmd_worker)

    from treadle.demo.main import DemoConfig
    from treadle.gateway.settings import GatewaySettings

    p = sub.add_parser("gateway", help="Run the Tinker-compatible HTTP gateway.")
    add_config_args(p, GatewaySettings)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("demo", help="The main job: GRPO teaches SmolLM2-135M-Instruct arithmetic, on CPU.")
    add_config_args(p, DemoConfig)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("flower", help="Flower queue monitoring for the stack.")
    p.add_argument("--broker_url", default=None)
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(func=cmd_flower)

    p = sub.add_parser("checkpoints", help="List, inspect, download, export, delete and expire checkpoints.")
    p.add_argument("action", choices=["list", "info", "download", "export", "delete", "gc"])
    p.add_argument("target", nargs="?", help="A run id (list) or a treadle:// path.")
    p.add_argument("--out", default=".", help="Directory for download/export.")
    p.add_argument("--merged", action="store_true", help="export: a merged model instead of the adapter.")
    p.add_argument("--storage_url", default=None)
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser("runs", help="List training runs.")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--storage_url", default=None)
    p.set_defaults(func=cmd_runs)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    ns.func(ns)


if __name__ == "__main__":
    main()
