"""Checkpoint I/O: treadle's CheckpointStore against raw boto3 on the same S3 server, as a ratio.

What it does: starts its own SeaweedFS `weed mini` (real S3, SigV4), writes a training-state directory shaped
like SmolLM2-135M with LoRA r=32 on every linear layer (adapter ~39 MB fp32 + AdamW moments ~78 MB, random
so nothing compresses), then alternates, round by round:
  - treadle: `CheckpointStore.save` (hash every file, multipart uploads, manifest last) + `load` (download,
    verify every sha256), under a new name each round;
  - raw boto3: `put_object` of each file, then `get_object` streamed to disk: the same bytes, no hashing,
    no manifest, one request per file.
Both clients sign the same way (SigV4, path-style, checksums only where required). The first round of each
is a warm-up and is not counted; the table shows medians. Run: `.venv/bin/python benchmarks/checkpoint_io.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import boto3
import numpy as np
from botocore.config import Config
from safetensors.numpy import save_file

from treadle.storage import CheckpointStore, S3Settings, S3Store
from treadle.testing.seaweed import SeaweedServer

# SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64, MLP 1536.
LAYERS, HIDDEN, KV, MLP = 30, 576, 192, 1536
PROJECTIONS = {  # name: (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV),
    "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, MLP),
    "mlp.up_proj": (HIDDEN, MLP),
    "mlp.down_proj": (MLP, HIDDEN),
}


def write_training_state(root: Path, rank: int, seed: int = 0) -> int:
    """An adapter + optimizer directory like the engine writes; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    adapter, optimizer = {}, {}
    for layer in range(LAYERS):
        for proj, (fan_in, fan_out) in PROJECTIONS.items():
            stem = f"base_model.model.model.layers.{layer}.{proj}"
            for part, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                name = f"{stem}.{part}.weight"
                adapter[name] = rng.standard_normal(shape, dtype=np.float32)
                optimizer[f"{name}.exp_avg"] = rng.standard_normal(shape, dtype=np.float32)
                optimizer[f"{name}.exp_avg_sq"] = rng.random(shape, dtype=np.float32)
    root.mkdir(parents=True)
    save_file(adapter, str(root / "adapter_model.safetensors"))
    save_file(optimizer, str(root / "optimizer.safetensors"))
    (root / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"})
    )
    (root / "trainer_state.json").write_text(json.dumps({"step": 100, "applied_seq": 250}))
    return sum(p.stat().st_size for p in root.iterdir())


def raw_client(server: SeaweedServer):
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def raw_put(client, bucket: str, prefix: str, source: Path) -> None:
    for path in sorted(source.iterdir()):
        with open(path, "rb") as body:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=body)


def raw_get(client, bucket: str, prefix: str, source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{path.name}")["Body"]
        with open(target / path.name, "wb") as out:
            for chunk in body.iter_chunks(1 << 20):
                out.write(chunk)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank; 32 gives ~117 MB of adapter + optimizer.")
    parser.add_argument("--rounds", type=int, default=5, help="Measured rounds of each, after one warm-up round.")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="treadle-bench-"))
    try:
        with SeaweedServer() as server:
            source = work / "state"
            size = write_training_state(source, args.rank)
            s3 = S3Store(
                server.bucket,
                "bench-treadle",
                S3Settings(
                    endpoint_url=server.endpoint,
                    access_key_id=server.access_key,
                    secret_access_key=server.secret_key,
                    region_name=server.region,
                ),
            )
            s3.check()
            store = CheckpointStore(s3)
            client = raw_client(server)
            times: dict[str, list[float]] = {k: [] for k in ("treadle save", "treadle load", "raw put", "raw get")}
            for round_ in range(args.rounds + 1):
                path = f"treadle://bench/weights/round-{round_}"
                save = timed(lambda: store.save(str(source), path, base_model="SmolLM2-135M", step=100))
                load = timed(store.load, path, str(work / f"treadle-{round_}"))
                put = timed(raw_put, client, server.bucket, f"bench-raw/round-{round_}", source)
                get = timed(raw_get, client, server.bucket, f"bench-raw/round-{round_}", source, work / f"raw-{round_}")
                if round_ > 0:  # round 0 warms up the server, the connection pools and the page cache
                    for key, value in zip(times, (save, load, put, get)):
                        times[key].append(value)
                shutil.rmtree(work / f"treadle-{round_}")
                shutil.rmtree(work / f"raw-{round_}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {key: statistics.median(values) for key, values in times.items()}
    mb = size / 1e6
    rows = [
        ("save / put", med["treadle save"], med["raw put"]),
        ("load / get", med["treadle load"], med["raw get"]),
        ("save+load / put+get", med["treadle save"] + med["treadle load"], med["raw put"] + med["raw get"]),
    ]
    print(
        f"checkpoint I/O, {mb:.1f} MB in 4 files (LoRA r={args.rank}, SmolLM2-135M shapes), "
        f"weed mini on loopback, median of {args.rounds} rounds"
    )
    print(f"{'operation':<22}{'treadle s':>11}{'MB/s':>8}{'raw boto3 s':>13}{'MB/s':>8}{'ratio':>8}")
    for label, ours, raw in rows:
        print(f"{label:<22}{ours:>11.3f}{mb / ours:>8.0f}{raw:>13.3f}{mb / raw:>8.0f}{ours / raw:>8.2f}")
    print("ratio = treadle time / raw boto3 time (below 1: treadle is faster)")


if __name__ == "__main__":
    main()
