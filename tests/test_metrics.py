"""Prometheus metrics: the worker's registry served over HTTP, the deployment gauges read from real Redis,
the gateway's /metrics; every endpoint parses with prometheus_client.parser and the counters move."""

from __future__ import annotations

import json
import pathlib
import re
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from treadle.local_stack import free_port
from treadle.metering import OpUsage
from treadle.observability import metrics
from treadle.queue.sessions import SessionRecord, SessionRegistry
from treadle.queue.workers import ServedModel, WorkerAnnouncement, WorkerRegistry


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, from Prometheus text format."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return samples(r.read().decode())


def test_worker_metrics_server_parses_and_moves(redis_client):
    port = free_port()
    server, thread = metrics.start_metrics_server(port, "127.0.0.1", redis=redis_client, models=["m-metrics"])
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = scrape(url)
        key = ("treadle_tokens_total", (("base_model", "m-metrics"), ("kind", "trained")))
        usage = OpUsage(session_id="s", op_id="1", op="forward_backward", trained_tokens=14, prefill_tokens=14)
        metrics.observe_op("forward_backward", "m-metrics", 0.3, usage=usage)
        metrics.observe_op("forward_backward", "m-metrics", 0.01, outcome="user_error")
        metrics.observe_checkpoint("auto", 1.5, 4096)
        redis_client.rpush("treadle.m.m-metrics", b"x", b"y")
        after = scrape(url)
        assert after[key] - before.get(key, 0) == 14
        count = ("treadle_op_seconds_count", (("base_model", "m-metrics"), ("op", "forward_backward")))
        assert after[count] - before.get(count, 0) == 2
        errors = (
            "treadle_ops_total",
            (("base_model", "m-metrics"), ("op", "forward_backward"), ("outcome", "user_error")),
        )
        assert after[errors] - before.get(errors, 0) == 1
        assert after[("treadle_checkpoint_bytes_total", (("kind", "auto"),))] >= 4096
        assert after[("treadle_queue_depth", (("base_model", "m-metrics"),))] == 2
    finally:
        server.shutdown()


def test_deployment_collector_reads_workers_sessions_and_queues(redis_client):
    from prometheus_client import CollectorRegistry, generate_latest

    WorkerRegistry(redis_client).announce(
        WorkerAnnouncement(
            hostname="w@h",
            pid=1,
            started_at=time.time(),
            models=[ServedModel(name="tiny", path="/m", max_seq_len=64, vocab_size=100)],
        )
    )
    sessions = SessionRegistry(redis_client)
    for sid, status in [("a", "active"), ("b", "active"), ("c", "stopped")]:
        sessions.create(SessionRecord(session_id=sid, run_id=sid, base_model="tiny", status=status))
    redis_client.rpush("treadle.m.tiny", b"create")
    registry = CollectorRegistry()
    registry.register(metrics.DeploymentCollector(lambda: redis_client))
    got = samples(generate_latest(registry).decode())
    assert got[("treadle_deployment_workers", ())] == 1
    assert got[("treadle_deployment_active_sessions", (("base_model", "tiny"),))] == 2
    assert got[("treadle_queue_depth", (("base_model", "tiny"),))] == 1


def test_the_grafana_dashboard_queries_only_metrics_treadle_exports(redis_client):
    """Every metric a panel of deploy/grafana-dashboard.json queries is exported by the worker or the gateway."""
    from fastapi import FastAPI

    from treadle.gateway.metrics import install

    exported = {m.name for m in metrics.REGISTRY.collect()}
    exported |= {m.name for m in install(FastAPI(), lambda: redis_client).collect()}
    dashboard = json.loads(
        (pathlib.Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json").read_text()
    )
    queried = {
        re.sub(r"_(bucket|total|count|sum)$", "", name)
        for panel in dashboard["panels"]
        for t in panel["targets"]
        for name in re.findall(r"\btreadle_\w+", t["expr"])
    }
    assert len(queried) >= 10 and queried <= exported, queried - exported


def test_operations_doc_names_each_metric_under_the_process_that_exports_it(redis_client):
    """docs/operations.md's Gateway bullet lists exactly the gateway's metrics, its worker bullet exactly a worker's."""
    from fastapi import FastAPI

    from treadle.gateway.metrics import install

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    section = doc.split("## Metrics (Prometheus)", 1)[1].split("\n## ", 1)[0]
    gateway_text, worker_text = section.split("\n- Gateway:", 1)[1].split("\n- Each worker", 1)
    named = lambda text: {re.sub(r"_(total)$", "", n) for n in re.findall(r"\btreadle_\w+", text.split("\n\n")[0])}  # noqa: E731
    worker = {m.name for m in metrics.REGISTRY.collect()} | {
        "treadle_queue_depth"
    }  # the queue depths of the models it serves
    assert named(gateway_text) == {m.name for m in install(FastAPI(), lambda: redis_client).collect()}
    assert named(worker_text) == worker
