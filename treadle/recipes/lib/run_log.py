"""A run's log directory: config.json, metrics.jsonl, checkpoints.jsonl, other step-keyed JSONL
files (e.g. rollouts.jsonl), and optionally MLflow (params, metrics, artifacts, registered checkpoints).

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

from pydantic import BaseModel, Field

from treadle.recipes.lib.mlflow_log import MlflowRun

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


class RunConfig(BaseModel):
    """The fields every recipe's config shares: the model and the LoRA, the length of the run and its evals and
    checkpoints, resuming, and the MLflow mirror of its logs. A recipe overrides the defaults that differ."""

    base_model: str = Field(default="SmolLM2-135M-Instruct", description="Base model served by the workers.")
    log_dir: str = Field(default="runs/run", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    seed: int = Field(default=0, description="Seed of the data order, the sampler and the LoRA init.")
    steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    lora_rank: int = Field(default=16, ge=1, description="LoRA rank (alpha is 2 x rank).")
    full: bool = Field(
        default=False,
        description="Full fine-tuning: train every weight (fp32 weights and AdamW moments on the worker, about 16 "
        "bytes a parameter) instead of a LoRA adapter.",
    )
    learning_rate: float = Field(default=1e-4, gt=0.0, description="AdamW learning rate.")
    eval_every: int = Field(default=5, ge=0, description="Held-out eval every N steps (0: only before and after).")
    save_every: int = Field(default=10, ge=1, description="save_state every N steps (and at the end).")
    resume: bool = Field(default=False, description="Continue from the last checkpoint in log_dir's checkpoints.jsonl.")
    mlflow_experiment: str | None = Field(
        default=None, description="Also log to this MLflow experiment (needs mlflow)."
    )
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow store, e.g. sqlite:///mlflow.db (None: MLFLOW_TRACKING_URI or ./mlruns)."
    )
    registered_model_name: str | None = Field(
        default=None, description="Register every saved checkpoint as a version of this MLflow model."
    )


class RunLog:
    """Append-only logs of one run in `log_dir`, mirrored to MLflow when `mlflow_experiment` is set."""

    def __init__(
        self,
        log_dir: str,
        config: BaseModel,
        resume: bool = False,
        mlflow_experiment: str | None = None,
        *,
        mlflow_tracking_uri: str | None = None,
        registered_model_name: str | None = None,
    ):
        self.log_dir = os.path.abspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.log_dir, METRICS_FILE)
        self.checkpoints_path = os.path.join(self.log_dir, CHECKPOINTS_FILE)
        if not resume:
            for path in glob.glob(os.path.join(self.log_dir, "*.jsonl")):
                os.remove(path)
        with open(os.path.join(self.log_dir, CONFIG_FILE), "w") as f:
            f.write(config.model_dump_json(indent=2))
        if registered_model_name and not mlflow_experiment:
            raise ValueError(
                f"registered_model_name={registered_model_name!r} needs mlflow_experiment (the run its versions belong to)"
            )
        self._mlflow: MlflowRun | None = None
        if mlflow_experiment:
            self._mlflow = MlflowRun(
                mlflow_experiment,
                os.path.basename(self.log_dir),
                config.model_dump(),
                mlflow_tracking_uri,
                registered_model_name,
            )
        # Checkpoints wait here until their step's metrics are logged, so their registry tags carry them.
        self._unregistered: list[tuple[str, int, str]] = []
        self._logged: tuple[int, dict[str, float]] | None = (
            None  # the last metrics row: a checkpoint of its step is tagged with it
        )

    @classmethod
    def for_config(cls, cfg: Any) -> "RunLog":
        """The log of a recipe whose config has `log_dir` and the RunConfig fields."""
        return cls(
            cfg.log_dir,
            cfg,
            cfg.resume,
            cfg.mlflow_experiment,
            mlflow_tracking_uri=cfg.mlflow_tracking_uri,
            registered_model_name=cfg.registered_model_name,
        )

    # ------------------------------------------------------------ metrics
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        append_jsonl(self.metrics_path, {"step": step, **metrics})
        self._logged = (step, metrics)
        if self._mlflow is not None:
            self._mlflow.log_metrics(step, metrics)
            self._register(step, metrics)

    def metrics(self) -> list[dict]:
        return _read_jsonl(self.metrics_path)

    def append(self, filename: str, step: int, row: dict) -> None:
        """A row of another step-keyed JSONL file in the log dir (e.g. one line per rollout group)."""
        append_jsonl(os.path.join(self.log_dir, filename), {"step": step, **row})

    # ------------------------------------------------------------ checkpoints
    def record_checkpoint(
        self, name: str, step: int, state_path: str, extra: dict[str, Any] | None = None
    ) -> CheckpointRecord:
        record = CheckpointRecord(name=name, step=step, state_path=state_path, time=time.time(), extra=extra or {})
        append_jsonl(self.checkpoints_path, record.__dict__)
        self.record_sampler(state_path, step, kind="state")
        if self._mlflow is not None and self._logged is not None and self._logged[0] == step:
            self._register(step, self._logged[1])  # its step's row is written already (see loop.end_step)
        return record

    def record_sampler(self, path: str, step: int, kind: str = "sampler") -> None:
        """A checkpoint that is not a resume point (e.g. a sampler snapshot): only registered, when registering."""
        if self._mlflow is not None and self._mlflow.registered_model_name:
            self._unregistered.append((path, step, kind))

    def _register(self, up_to_step: float, metrics: dict[str, float]) -> None:
        for path, step, kind in self._unregistered:
            if step <= up_to_step:
                self._mlflow.register_checkpoint(path, step, kind, metrics)
        self._unregistered = [c for c in self._unregistered if c[1] > up_to_step]

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
        if self._mlflow is not None:
            # A resumed run is a new MLflow run: it starts with the steps it keeps, so it equals metrics.jsonl.
            for row in self.metrics():
                self._mlflow.log_metrics(row["step"], {k: v for k, v in row.items() if k != "step"})

    def close(self) -> None:
        """Finish the MLflow run: pending registrations, then the PNG curves and JSONL logs as artifacts."""
        if self._mlflow is not None:
            self._register(float("inf"), {})
            for path in sorted(
                glob.glob(os.path.join(self.log_dir, "*.png")) + glob.glob(os.path.join(self.log_dir, "*.jsonl"))
            ):
                self._mlflow.log_artifact(path)
            self._mlflow.close()
