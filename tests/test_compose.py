"""compose.yaml cannot run here (no Docker), so its structure is checked: the settings that matter."""

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_present_and_wired():
    compose = load()
    assert set(compose["services"]) >= {"redis", "minio", "minio-init", "worker", "gateway", "flower"}
    for name, svc in compose["services"].items():
        assert "image" in svc or "build" in svc, name
        for dep in svc.get("depends_on", {}):
            assert dep in compose["services"], f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_redis_is_durable_and_never_evicts():
    cmd = " ".join(load()["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd
    assert "--maxmemory-policy noeviction" in cmd


def test_minio_bucket_is_created_with_versioning():
    init = load()["services"]["minio-init"]
    script = " ".join(init["command"])
    assert "mc mb" in script and "mc version enable" in script
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def test_worker_reserves_a_gpu_caches_hf_and_restarts():
    worker = load()["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any("/cache/huggingface" in v for v in worker["volumes"])
    assert worker["environment"]["HF_HOME"] == "/cache/huggingface"
    assert worker["restart"] == "unless-stopped"
    assert worker["command"][0] == "worker"


def test_worker_command_parses_with_the_real_cli():
    from treadle.cli import build_parser

    worker = load()["services"]["worker"]
    args = [a.replace("${TREADLE_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}", "m") for a in worker["command"]]
    ns = build_parser().parse_args(args)
    assert ns.model == ["m"] and ns.checkpoint_every == 10
