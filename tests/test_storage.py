"""The storage contract, run against every backend (`blob_store` is parametrized: local dir and real S3)."""

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from treadle.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    InvalidCheckpointNameError,
    InvalidRequestError,
    StorageError,
)
from treadle.storage import BlobStore, CheckpointPath, CheckpointStore, LocalDirStore

MULTIPART_SIZE = 9 * 1024 * 1024 + 17  # above the 8 MB multipart threshold, not a whole number of parts


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint_dir(root: Path, seed: int = 0, big: int = 4096) -> dict[str, bytes]:
    """An adapter-like directory with a nested file; returns relative name -> bytes."""
    rng = random.Random(seed)
    files = {
        "adapter_model.safetensors": rng.randbytes(big),
        "adapter_config.json": json.dumps({"r": 8, "seed": seed}).encode(),
        "optimizer/state.bin": rng.randbytes(1000),
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_dir(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def store(blob_store) -> CheckpointStore:
    return CheckpointStore(blob_store)


@pytest.fixture
def ckpt_dir(tmp_path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "ckpt"
    root.mkdir()
    return root, write_checkpoint_dir(root)


PATH = CheckpointPath.parse("treadle://sess-1:train:0/weights/step-3")


# -- blob store contract --------------------------------------------------------------------------------


def test_implements_the_protocol(blob_store):
    assert isinstance(blob_store, BlobStore)


def test_bytes_round_trip_and_overwrite(blob_store):
    blob_store.put_bytes("a/b.json", b'{"x": 1}')
    assert blob_store.exists("a/b.json")
    assert blob_store.get_bytes("a/b.json") == b'{"x": 1}'
    blob_store.put_bytes("a/b.json", b"second")
    assert blob_store.get_bytes("a/b.json") == b"second"


def test_missing_keys(blob_store, tmp_path):
    assert not blob_store.exists("nope/x")
    with pytest.raises(FileNotFoundError):
        blob_store.get_bytes("nope/x")
    with pytest.raises(FileNotFoundError):
        blob_store.get_file("nope/x", str(tmp_path / "out"))
    blob_store.delete("nope/x")  # deleting what is not there is fine


def test_multipart_sized_file_round_trips(blob_store, tmp_path):
    data = os.urandom(MULTIPART_SIZE)
    (tmp_path / "big.bin").write_bytes(data)
    blob_store.put_file(str(tmp_path / "big.bin"), "big/file.bin")
    blob_store.get_file("big/file.bin", str(tmp_path / "out" / "nested" / "big.bin"))
    assert sha256((tmp_path / "out" / "nested" / "big.bin").read_bytes()) == sha256(data)
    assert not [p.name for p in (tmp_path / "out" / "nested").iterdir() if p.name != "big.bin"], "temp file left"


def test_list_is_a_plain_string_prefix_and_list_dirs_gives_children(blob_store):
    for key in ["a/b1", "a/b10", "a/c/d", "a/c/e/f", "ab", "z"]:
        blob_store.put_bytes(key, b"x")
    assert blob_store.list("a/") == ["a/b1", "a/b10", "a/c/d", "a/c/e/f"]
    assert blob_store.list("a/b1") == ["a/b1", "a/b10"]
    assert blob_store.list("a") == ["a/b1", "a/b10", "a/c/d", "a/c/e/f", "ab"]
    assert blob_store.list("") == ["a/b1", "a/b10", "a/c/d", "a/c/e/f", "ab", "z"]
    assert blob_store.list("q/") == []
    assert blob_store.list_dirs("a/") == ["c"]
    assert blob_store.list_dirs("a/c/") == ["e"]
    assert blob_store.list_dirs("q/") == []


def test_delete_and_delete_prefix(blob_store):
    for key in ["p/1", "p/2/3", "pq", "other"]:
        blob_store.put_bytes(key, b"x")
    blob_store.delete("other")
    assert not blob_store.exists("other")
    assert blob_store.delete_prefix("p/") == 2
    assert blob_store.list("") == ["pq"]
    assert blob_store.list_dirs("") == []  # no empty "directory" p/ left behind


def test_local_store_refuses_keys_that_escape_its_root(tmp_path):
    store = LocalDirStore(str(tmp_path / "root"))
    for key in ["../escape", "a/../../escape", "/abs", "a//b", ".incoming/x"]:
        with pytest.raises(StorageError):
            store.put_bytes(key, b"x")
    assert not (tmp_path / "escape").exists()


# -- checkpoints ----------------------------------------------------------------------------------------


def test_save_then_load_round_trips_files_and_metadata(store, ckpt_dir, tmp_path):
    root, files = ckpt_dir
    saved = store.save(
        str(root),
        PATH,
        base_model="tiny-llama",
        lora_config={"rank": 8},
        step=3,
        applied_seq=7,
        ttl_seconds=3600,
        user_metadata={"note": "hello"},
        extra={"rng": "abc"},
    )
    assert {name: entry.model_dump() for name, entry in saved.files.items()} == {
        name: {"sha256": sha256(data), "size": len(data)} for name, data in files.items()
    }
    assert saved.expires_at == pytest.approx(saved.created_at + 3600)

    loaded = store.load(PATH, str(tmp_path / "out"))
    assert read_dir(tmp_path / "out") == files
    assert loaded == saved == store.manifest("treadle://sess-1:train:0/weights/step-3")
    assert (loaded.base_model, loaded.lora_config, loaded.step, loaded.applied_seq) == ("tiny-llama", {"rank": 8}, 3, 7)
    assert (loaded.user_metadata, loaded.extra) == ({"note": "hello"}, {"rng": "abc"})
    assert store.exists(PATH)


def test_multipart_sized_checkpoint_round_trips(store, tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    files = write_checkpoint_dir(root, big=MULTIPART_SIZE)
    store.save(str(root), PATH, base_model="m")
    store.load(PATH, str(tmp_path / "out"))
    assert read_dir(tmp_path / "out") == files


class RecordingBlobStore:
    """The real store underneath; records the order of writes."""

    def __init__(self, inner):
        self.inner, self.writes = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, local_path, key):
        self.inner.put_file(local_path, key)
        self.writes.append(key)

    def put_bytes(self, key, data):
        self.inner.put_bytes(key, data)
        self.writes.append(key)


def test_manifest_is_written_last(blob_store, ckpt_dir):
    recording = RecordingBlobStore(blob_store)
    CheckpointStore(recording).save(str(ckpt_dir[0]), PATH, base_model="m")
    prefix = PATH.key_prefix
    assert recording.writes[-1] == f"{prefix}/manifest.json"
    assert sorted(recording.writes[:-1]) == sorted(f"{prefix}/{name}" for name in ckpt_dir[1])


def test_files_without_a_manifest_are_not_a_checkpoint(store, blob_store, ckpt_dir, tmp_path):
    store.save(str(ckpt_dir[0]), PATH, base_model="m")
    blob_store.delete(f"{PATH.key_prefix}/manifest.json")  # as if the save had crashed before its last write
    assert blob_store.list(PATH.key_prefix + "/")  # the files are there...
    assert not store.exists(PATH)  # ...but the checkpoint is not
    assert store.list_checkpoints(PATH.run_id) == []
    with pytest.raises(CheckpointNotFoundError, match="step-3"):
        store.load(PATH, str(tmp_path / "out"))


def test_a_flipped_byte_fails_the_load_naming_the_file(store, blob_store, ckpt_dir, tmp_path):
    store.save(str(ckpt_dir[0]), PATH, base_model="m")
    key = f"{PATH.key_prefix}/adapter_model.safetensors"
    data = bytearray(blob_store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    blob_store.put_bytes(key, bytes(data))
    with pytest.raises(
        IntegrityError,
        match="'adapter_model.safetensors' of checkpoint treadle://sess-1:train:0/weights/step-3 is corrupt",
    ):
        store.load(PATH, str(tmp_path / "out"))
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists(), "a corrupt file was left in place"


def test_a_missing_file_fails_the_load_naming_the_file(store, blob_store, ckpt_dir, tmp_path):
    store.save(str(ckpt_dir[0]), PATH, base_model="m")
    blob_store.delete(f"{PATH.key_prefix}/optimizer/state.bin")
    with pytest.raises(IntegrityError, match="'optimizer/state.bin' .* missing"):
        store.load(PATH, str(tmp_path / "out"))


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(store, blob_store, ckpt_dir, tmp_path):
    manifest = store.save(str(ckpt_dir[0]), PATH, base_model="m")
    evil = manifest.model_copy(update={"files": {"../../escaped": manifest.files["adapter_config.json"]}})
    blob_store.put_bytes(f"{PATH.key_prefix}/manifest.json", evil.model_dump_json().encode())
    with pytest.raises(IntegrityError, match="outside its directory"):
        store.load(PATH, str(tmp_path / "a" / "b" / "out"))
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 300, "a\x01b", "a\tb"])
def test_bad_names_are_rejected_before_anything_is_written(store, blob_store, ckpt_dir, bad):
    with pytest.raises(InvalidCheckpointNameError):
        store.save(str(ckpt_dir[0]), f"treadle://run/weights/{bad}", base_model="m")
    with pytest.raises(InvalidCheckpointNameError):
        store.save(str(ckpt_dir[0]), CheckpointPath(run_id="run", kind="weights", name=bad), base_model="m")
    assert blob_store.list("") == []


def test_overwrite_false_refuses_and_keeps_the_original(store, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    files_1 = write_checkpoint_dir(first, seed=1)
    write_checkpoint_dir(second, seed=2)
    store.save(str(first), PATH, base_model="m")
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        store.save(str(second), PATH, base_model="m")
    store.load(PATH, str(tmp_path / "out"))
    assert read_dir(tmp_path / "out") == files_1


def test_overwrite_true_replaces_and_drops_files_the_new_version_lacks(store, blob_store, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_checkpoint_dir(first, seed=1)
    (first / "only_in_first.txt").write_text("old")
    files_2 = write_checkpoint_dir(second, seed=2)
    store.save(str(first), PATH, base_model="m", step=1)
    manifest = store.save(str(second), PATH, base_model="m", step=2, overwrite=True)
    assert manifest.step == 2 and store.manifest(PATH).step == 2
    assert f"{PATH.key_prefix}/only_in_first.txt" not in blob_store.list(PATH.key_prefix + "/")
    store.load(PATH, str(tmp_path / "out"))
    assert read_dir(tmp_path / "out") == files_2


def test_ttl_gc_removes_expired_and_keeps_live(store, ckpt_dir):
    root = str(ckpt_dir[0])
    short = store.save(root, "treadle://r/weights/short", base_model="m", ttl_seconds=60)
    store.save(root, "treadle://r/sampler_weights/long", base_model="m", ttl_seconds=7200)
    store.save(root, "treadle://r/weights/forever", base_model="m")
    assert store.gc() == []  # nothing has expired yet
    removed = store.gc(now=short.created_at + 120)
    assert removed == [CheckpointPath.parse("treadle://r/weights/short")]
    assert not store.exists("treadle://r/weights/short")
    assert store.exists("treadle://r/sampler_weights/long") and store.exists("treadle://r/weights/forever")
    assert store.gc(now=short.created_at + 120) == []


def test_ttl_must_be_positive(store, ckpt_dir):
    with pytest.raises(InvalidRequestError, match="ttl_seconds .* got 0"):
        store.save(str(ckpt_dir[0]), PATH, base_model="m", ttl_seconds=0)


def test_list_runs_checkpoints_and_delete(store, ckpt_dir):
    root = str(ckpt_dir[0])
    a = store.save(root, "treadle://run-a/weights/s1", base_model="m")
    b = store.save(root, "treadle://run-a/sampler_weights/s1", base_model="m")
    c = store.save(root, "treadle://run-a/weights/s2", base_model="m")
    store.save(root, "treadle://run-b:train:0/weights/s1", base_model="m")
    assert store.list_runs() == ["run-a", "run-b:train:0"]
    assert [m.path for m in store.list_checkpoints("run-a")] == [a.path, b.path, c.path]

    store.delete("treadle://run-a/weights/s1")
    assert not store.exists(a.path)
    assert [m.path for m in store.list_checkpoints("run-a")] == [b.path, c.path]
    with pytest.raises(CheckpointNotFoundError, match="run-a/weights/s1"):
        store.delete(a.path)
    store.delete("tinker://run-b:train:0/weights/s1")
    assert store.list_runs() == ["run-a"]


def test_run_metadata(store):
    assert store.get_run("run-a") is None
    info = {"base_model": "tiny", "lora_config": {"rank": 8}, "created_at": 1.5, "owner": "me", "user_metadata": {}}
    store.put_run("run-a", info)
    assert store.get_run("run-a") == info
    assert store.list_runs() == ["run-a"]


def test_local_dir_must_hold_files_and_no_manifest(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match="no files"):
        store.save(str(tmp_path / "empty"), PATH, base_model="m")
    with pytest.raises(InvalidRequestError, match="not a directory"):
        store.save(str(tmp_path / "absent"), PATH, base_model="m")
    (tmp_path / "reserved").mkdir()
    (tmp_path / "reserved" / "manifest.json").write_text("{}")
    with pytest.raises(InvalidRequestError, match="reserves"):
        store.save(str(tmp_path / "reserved"), PATH, base_model="m")
