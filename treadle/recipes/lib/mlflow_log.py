"""A run mirrored to MLflow: params, per-step metrics, artifacts, and checkpoints as registered model versions.

Metric names are the ones in metrics.jsonl, unchanged (MLflow accepts `:` and `/`), so a run reads
the same in both places. The client is an explicit `MlflowClient` on one tracking URI (argument,
else `MLFLOW_TRACKING_URI`, else MLflow's default `./mlruns`), not the fluent API's process-global
active run: a recipe that crashed cannot leave a run open that the next one would collide with.

With `registered_model_name`, each checkpoint the run saves becomes a version of that model in
MLflow's model registry: its source is the checkpoint's `treadle://` path, and its tags carry the
path, the step, the kind (`state`: resumable training state, `sampler`: a sampler snapshot) and
the metrics logged at that step. The registry needs a database-backed store (`sqlite:///mlflow.db`,
or an `mlflow server` with one); a plain `file:` store refuses it, with MLflow's own message.
"""

from __future__ import annotations

import time
from typing import Any


def _client_module():
    try:
        import mlflow
        from mlflow import MlflowClient
    except ImportError:
        raise RuntimeError(
            "MLflow logging needs the mlflow package: pip install mlflow-skinny (plus SQLAlchemy and "
            "alembic for a sqlite:// store)"
        ) from None
    return mlflow, MlflowClient


class MlflowRun:
    """One MLflow run in `experiment`, created at once; `close()` marks it finished."""

    def __init__(
        self,
        experiment: str,
        run_name: str,
        params: dict[str, Any],
        tracking_uri: str | None = None,
        registered_model_name: str | None = None,
    ):
        mlflow, client_cls = _client_module()
        from mlflow.entities import Param

        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = client_cls(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        # MLflow caps a param value at 6000 characters; a long list of stop strings stays readable.
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        self.registered_model_name = registered_model_name
        if registered_model_name and not self.client.search_registered_models(f"name = '{registered_model_name}'"):
            self.client.create_registered_model(registered_model_name, description="Checkpoints of treadle runs.")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def register_checkpoint(self, path: str, step: int, kind: str, metrics: dict[str, float]) -> str:
        """A new version of the registered model for the checkpoint at `path`; returns the version number."""
        tags = {
            "treadle_path": path,
            "step": str(step),
            "kind": kind,
            **{f"metric.{k}": repr(float(v)) for k, v in metrics.items()},
        }
        version = self.client.create_model_version(
            self.registered_model_name,
            source=path,
            run_id=self.run_id,
            tags=tags,
            description=f"{kind} checkpoint after step {step}: {path}",
        )
        return str(version.version)

    def log_artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
