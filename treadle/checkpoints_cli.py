"""`treadle checkpoints list|info|download|export|delete|gc` and `treadle training-runs`: the checkpoint store's
REST view (`treadle.sdk.rest_client.RestClient`), from the command line.

The store is `--storage_url`, else `TREADLE_CHECKPOINTS_STORAGE_URL` / `TREADLE_TRAINING_RUNS_STORAGE_URL`,
else the shared `TREADLE_STORAGE_URL`, else a config file's `storage_url`, else the running `treadle up`.
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, Field

from treadle.config import add_config_args, config_of


class CheckpointsConfig(BaseModel):
    storage_url: str | None = Field(
        default=None,
        description="Checkpoint store, file:///dir or s3://bucket/prefix (default: the running `treadle up` stack's).",
    )
    out: str = Field(default=".", description="Directory for download/export.")
    merged: bool = Field(default=False, description="export: a merged model instead of the adapter.")


class TrainingRunsConfig(BaseModel):
    storage_url: str | None = Field(
        default=None,
        description="Checkpoint store, file:///dir or s3://bucket/prefix (default: the running `treadle up` stack's).",
    )
    limit: int = Field(default=50, ge=1, description="List at most this many runs.")


def _rest(storage_url: str | None):
    from treadle.sdk.rest_client import RestClient

    if storage_url is None:
        from treadle.local_stack import find_running_stack

        found = find_running_stack()
        storage_url = found.storage_url if found else None
    return RestClient(storage_url)


def cmd_checkpoints(ns) -> None:
    cfg = config_of(ns)
    rest = _rest(cfg.storage_url)
    if ns.action == "list":
        runs = [ns.target] if ns.target else [r.training_run_id for r in rest.list_training_runs(limit=10_000)]
        for run in runs:
            for c in rest.list_checkpoints(run):
                expires = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.expires_at)) if c.expires_at else "never"
                print(f"{c.treadle_path}\t{c.size_bytes or 0:>12,d} B\texpires {expires}")
    elif ns.action == "info":
        print(rest.manifest(ns.target).model_dump_json(indent=2))
    elif ns.action == "download":
        print(rest.download(ns.target, cfg.out))
    elif ns.action == "export":
        print(rest.export(ns.target, cfg.out, merged=cfg.merged))
    elif ns.action == "delete":
        rest.delete_checkpoint(ns.target)
        print(f"deleted {ns.target}")
    elif ns.action == "gc":
        removed = rest.gc()
        print("\n".join(removed) or "nothing expired")


def cmd_training_runs(ns) -> None:
    cfg = config_of(ns)
    for run in _rest(cfg.storage_url).list_training_runs(limit=cfg.limit):
        print(json.dumps(run.model_dump(), default=str))


def add_checkpoint_commands(sub) -> None:
    p = sub.add_parser("checkpoints", help="List, inspect, download, export, delete and expire checkpoints.")
    p.add_argument("action", choices=["list", "info", "download", "export", "delete", "gc"])
    p.add_argument("target", nargs="?", help="A run id (list) or a treadle:// path.")
    add_config_args(p, CheckpointsConfig, "TREADLE_CHECKPOINTS_", section="checkpoints")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser("training-runs", help="List training runs (the checkpoint store's runs of sessions).")
    add_config_args(p, TrainingRunsConfig, "TREADLE_TRAINING_RUNS_", section="training-runs")
    p.set_defaults(func=cmd_training_runs)
