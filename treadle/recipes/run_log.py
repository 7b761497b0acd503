"""A run's log directory: config.json, metrics.jsonl, checkpoints.jsonl, other step-keyed JSONL
files (e.g. rollouts.jsonl), and optionally MLflow.

`checkpoints.jsonl` records, beside each saved training state, the loop position it corresponds to
(`step` = the number of completed steps) and whatever else the loop needs to continue (`extra`,
e.g. a data cursor). `--resume` reads its last line, restores the state with its optimizer, and
continues at `step + 1`. Metrics of steps after that checkpoint were produced by weights the resumed
run never sees, so they are dropped (from every step-keyed JSONL file): every step appears in
metrics.jsonl exactly once. A run that does not resume starts its log files afresh.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_FILE = "checkpoints.jsonl"
CONFIG_FILE = "config.json"


@dataclass
class CheckpointRecord:
    name: str
    step: int
    state_path: str
    time: float
    extra: dict[str, Any] = field(default_factory=dict)


def _read_jsonl(path: str) -> list[dict]:
    """Rows of a JSONL file; a torn last line (the process died mid-write) is ignored."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


class RunLog:
    """Append-only logs of one run in `log_dir`, mirrored to MLflow when `mlflow_experiment` is set."""

    def __init__(self, log_dir: str, config: BaseModel, resume: bool = False, mlflow_experiment: str | None = None):
        self.log_dir = os.path.abspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.log_dir, METRICS_FILE)
        self.checkpoints_path = os.path.join(self.log_dir, CHECKPOINTS_FILE)
        if not resume:
            for path in glob.glob(os.path.join(self.log_dir, "*.jsonl")):
                os.remove(path)
        with open(os.path.join(self.log_dir, CONFIG_FILE), "w") as f:
            f.write(config.model_dump_json(indent=2))
        self._mlflow = None
        if mlflow_experiment:
            try:
                import mlflow
            except ImportError:
                raise RuntimeError(f"mlflow_experiment={mlflow_experiment!r} needs the mlflow package: pip install mlflow") from None
            mlflow.set_experiment(mlflow_experiment)
            mlflow.start_run(run_name=os.path.basename(self.log_dir))
            mlflow.log_params({k: str(v) for k, v in config.model_dump().items()})
            self._mlflow = mlflow

    # ------------------------------------------------------------ metrics
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        append_jsonl(self.metrics_path, {"step": step, **metrics})
        if self._mlflow is not None:
            self._mlflow.log_metrics({k.replace(":", "_").replace("/", "_"): float(v) for k, v in metrics.items()}, step=step)

    def metrics(self) -> list[dict]:
        return _read_jsonl(self.metrics_path)

    def append(self, filename: str, step: int, row: dict) -> None:
        """A row of another step-keyed JSONL file in the log dir (e.g. one line per rollout group)."""
        append_jsonl(os.path.join(self.log_dir, filename), {"step": step, **row})

    # ------------------------------------------------------------ checkpoints
    def record_checkpoint(self, name: str, step: int, state_path: str, extra: dict[str, Any] | None = None) -> CheckpointRecord:
        record = CheckpointRecord(name=name, step=step, state_path=state_path, time=time.time(), extra=extra or {})
        append_jsonl(self.checkpoints_path, record.__dict__)
        return record

    def checkpoints(self) -> list[CheckpointRecord]:
        return [CheckpointRecord(**row) for row in _read_jsonl(self.checkpoints_path)]

    def last_checkpoint(self) -> CheckpointRecord | None:
        records = self.checkpoints()
        return records[-1] if records else None

    def rewind_to(self, step: int) -> None:
        """Drop rows of steps after `step` (they will be run again from the checkpoint at `step`)."""
        for path in glob.glob(os.path.join(self.log_dir, "*.jsonl")):
            if path == self.checkpoints_path:
                continue
            kept = [row for row in _read_jsonl(path) if row["step"] <= step]
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in kept)
            os.replace(path + ".tmp", path)

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run()
