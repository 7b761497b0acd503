"""What only the S3 backend does: start-up checks, boto3's environment, bucket creation, versioning."""

import uuid

import pytest

from tests.fixtures.s3_server import s3_settings_for
from treadle.errors import StorageError
from treadle.storage import CheckpointStore, S3Settings, S3Store
from treadle.testing.seaweed import free_ports


def test_wrong_secret_fails_at_check(s3_server):
    store = S3Store(s3_server.bucket, "x", s3_settings_for(s3_server).model_copy(update={"secret_access_key": "wrong"}))
    with pytest.raises(StorageError, match="SignatureDoesNotMatch.*AWS_SECRET_ACCESS_KEY"):
        store.check()


def test_unknown_access_key_fails_at_check(s3_server):
    store = S3Store(s3_server.bucket, "x", s3_settings_for(s3_server).model_copy(update={"access_key_id": "nobody"}))
    with pytest.raises(StorageError, match=s3_server.endpoint):
        store.check()


def test_unreachable_endpoint_fails_at_check():
    (port,) = free_ports(1)  # nothing listens there
    store = S3Store(
        "b", "", S3Settings(endpoint_url=f"http://127.0.0.1:{port}", access_key_id="a", secret_access_key="b")
    )
    with pytest.raises(StorageError, match=f"127.0.0.1:{port}.*Could not connect"):
        store.check()


def test_from_url_uses_boto3_environment_creates_the_bucket_and_turns_versioning_on(s3_server, monkeypatch, tmp_path):
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    bucket = f"fresh-{uuid.uuid4().hex[:8]}"
    store = CheckpointStore.from_url(f"s3://{bucket}/ckpts")
    assert store.url == f"s3://{bucket}/ckpts/"
    client = s3_server.client()
    assert client.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"

    (tmp_path / "a.bin").write_bytes(b"abc")
    store.save(str(tmp_path), "treadle://r/weights/w", base_model="m")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert sorted(keys) == ["ckpts/runs/r/weights/w/a.bin", "ckpts/runs/r/weights/w/manifest.json"]


def test_from_url_with_bad_credentials_fails_at_start_up(s3_server, monkeypatch):
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageError, match="SignatureDoesNotMatch"):
        CheckpointStore.from_url(s3_server.url)


def test_overwrite_keeps_history_in_a_versioned_bucket(s3_store, s3_server, tmp_path):
    assert s3_store.versioning_enabled
    store = CheckpointStore(s3_store)
    for step in (1, 2):
        (tmp_path / "adapter.bin").write_bytes(f"weights at step {step}".encode())
        store.save(str(tmp_path), "treadle://r/weights/latest", base_model="m", step=step, overwrite=True)

    client = s3_server.client()
    key = f"{s3_store.prefix}runs/r/weights/latest/adapter.bin"
    versions = client.list_object_versions(Bucket=s3_store.bucket, Prefix=key)["Versions"]
    assert len(versions) == 2
    older = next(v for v in versions if not v["IsLatest"])
    body = client.get_object(Bucket=s3_store.bucket, Key=key, VersionId=older["VersionId"])["Body"].read()
    assert body == b"weights at step 1"
    assert store.manifest("treadle://r/weights/latest").step == 2
