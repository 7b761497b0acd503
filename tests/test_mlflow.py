"""MLflow for real: a recipe's params, per-step metrics and curve in a sqlite-backed MLflow store, read back
with MlflowClient and compared with metrics.jsonl; its checkpoints as versions of a registered model."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient
from pydantic import BaseModel

from treadle.recipes import dpo
from treadle.recipes.lib.preference_data import arithmetic_pairs, write_jsonl
from treadle.recipes.lib.run_log import RunLog


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _history(client: MlflowClient, run_id: str, rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    keys = sorted({k for row in rows for k in row if k != "step"})
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    keys = sorted({k for row in rows for k in row if k != "step"})
    return {k: [(r["step"], float(r[k])) for r in rows if k in r] for k in keys}


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    """One sqlite-backed store (tracking and registry) for the module: creating its tables takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_dpo_run_in_mlflow_equals_metrics_jsonl_and_registers_every_checkpoint(service_client, tmp_path, tracking_uri):
    uri = tracking_uri
    heldout = write_jsonl(str(tmp_path / "pairs.jsonl"), arithmetic_pairs(4, max_operand=3))
    cfg = dpo.Config(
        base_model="tiny",
        log_dir=str(tmp_path / "dpo-run"),
        pairs=8,
        heldout_path=heldout,
        heldout_pairs=2,
        max_operand=3,
        steps=4,
        batch_size=4,
        beta=0.5,
        learning_rate=5e-3,
        lora_rank=4,
        max_tokens=3,
        eval_every=2,
        save_every=2,
        mlflow_experiment="treadle-test",
        mlflow_tracking_uri=uri,
        registered_model_name="tiny-dpo",
    )
    result = dpo.main(cfg, service_client)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("treadle-test").experiment_id])
    assert run.info.run_name == "dpo-run" and run.info.status == "FINISHED"
    assert run.data.params["beta"] == "0.5" and run.data.params["steps"] == "4"
    rows = _rows(result.metrics_path)
    assert _history(client, run.info.run_id, rows) == _expected(rows)  # every metric of every step, exactly
    assert {"curve.png", "metrics.jsonl", "checkpoints.jsonl"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)
    }

    versions = sorted(client.search_model_versions("name = 'tiny-dpo'"), key=lambda v: int(v.version))
    # sampler snapshots of the evals at steps 0, 2, 4 and the training states of steps 2 and 4, in the order saved
    assert [(v.tags["kind"], int(v.tags["step"])) for v in versions] == [
        ("sampler", 0),
        ("sampler", 2),
        ("state", 2),
        ("sampler", 4),
        ("state", 4),
    ]
    states = [c["state_path"] for c in _rows(tmp_path / "dpo-run" / "checkpoints.jsonl")]
    assert [v.source for v in versions if v.tags["kind"] == "state"] == states
    rest = service_client.create_rest_client()
    by_step = {r["step"]: r for r in rows}
    for v in versions:
        assert v.source == v.tags["treadle_path"] and v.source.startswith("treadle://") and v.run_id == run.info.run_id
        assert rest.manifest(v.source).base_model == "tiny"  # the path names a real checkpoint in the store
        assert float(v.tags["metric.eval/margin"]) == by_step[int(v.tags["step"])]["eval/margin"]


class _Cfg(BaseModel):
    lr: float = 0.1


def test_a_resumed_run_is_a_new_mlflow_run_that_equals_the_rewound_metrics(tmp_path, tracking_uri):
    uri = tracking_uri
    first = RunLog(str(tmp_path / "run"), _Cfg(), mlflow_experiment="resume", mlflow_tracking_uri=uri)
    for step in range(4):
        first.log_metrics(step, {"loss": 1.0 / (step + 1)})
        if step == 1:
            first.record_checkpoint("step-1", 1, "treadle://r/weights/step-1")
    # the process dies after step 3 without close(); the next one resumes from the checkpoint of step 1
    second = RunLog(str(tmp_path / "run"), _Cfg(), resume=True, mlflow_experiment="resume", mlflow_tracking_uri=uri)
    second.rewind_to(second.last_checkpoint().step)
    for step in (2, 3):
        second.log_metrics(step, {"loss": 2.0 + step})
    second.close()
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["loss"] for r in rows] == [1.0, 0.5, 4.0, 5.0]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs(
        [client.get_experiment_by_name("resume").experiment_id], order_by=["attributes.start_time DESC"]
    )
    assert len(runs) == 2 and runs[0].info.status == "FINISHED"
    assert _history(client, runs[0].info.run_id, rows) == _expected(rows)
