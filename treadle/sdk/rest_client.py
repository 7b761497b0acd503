"""RestClient: runs and checkpoints in the store, and getting weights out of treadle.

It reads the checkpoint store directly (file:// or s3://, with the same settings as the workers).
`export(merged=True)` builds a merged model locally and so needs the worker extra (torch).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.manifest import Manifest
from treadle.storage.paths import CheckpointPath
from treadle.types import Checkpoint, TrainingRun, WeightsInfo

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
MERGED_DIR = "merged"  # where save_weights_for_sampler(merge_weights=True) puts the merged model
# A training state's own files beside its weights (treadle.gpu_worker.training.state): not part of an export.
STATE_FILES = ("optimizer.safetensors", "gradients.safetensors", "rng_state.safetensors", "engine_state.json")


def _checkpoint(m: Manifest) -> Checkpoint:
    return Checkpoint(
        checkpoint_id=f"{m.kind}/{m.name}",
        checkpoint_type="training" if m.kind == "weights" else "sampler",
        time=m.created_at,
        treadle_path=m.path.uri(),
        size_bytes=m.size_bytes,
        expires_at=m.expires_at,
    )


class RestClient:
    def __init__(self, storage_url: str | None):
        if not storage_url:
            storage_url = "file://" + os.path.expanduser("~/.treadle/checkpoints")
        self.store = CheckpointStore.from_url(storage_url)

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> list[TrainingRun]:
        runs = []
        for run_id in self.store.list_runs()[offset : offset + limit]:
            run = self.get_training_run(run_id)
            if run is not None:
                runs.append(run)
        return runs

    def get_training_run(self, run_id: str) -> TrainingRun | None:
        info = self.store.get_run(run_id)
        if info is None:
            return None
        return TrainingRun.model_validate({"training_run_id": run_id, **info})

    def list_checkpoints(self, run_id: str) -> list[Checkpoint]:
        return [_checkpoint(m) for m in self.store.list_checkpoints(run_id)]

    def manifest(self, path: str) -> Manifest:
        return self.store.manifest(CheckpointPath.parse(path))

    def get_weights_info(self, path: str) -> WeightsInfo:
        m = self.manifest(path)
        lora = m.lora_config or {}
        return WeightsInfo(
            base_model=m.base_model,
            is_lora=m.lora_config is not None,
            lora_rank=lora.get("rank"),
            train_unembed=lora.get("train_unembed"),
            train_mlp=lora.get("train_mlp"),
            train_attn=lora.get("train_attn"),
        )

    def delete_checkpoint(self, path: str) -> None:
        self.store.delete(CheckpointPath.parse(path))

    def download(self, path: str, directory: str) -> str:
        """The checkpoint's files (verified against the manifest) into `directory`."""
        os.makedirs(directory, exist_ok=True)
        self.store.load(CheckpointPath.parse(path), directory)
        return directory

    def export(self, path: str, directory: str, merged: bool = False) -> str:
        """A PEFT adapter directory (PeftModel.from_pretrained, vLLM's LoRA layout), or a merged model.

        A merged model comes from the checkpoint itself when it was saved with `merge_weights=True`;
        otherwise it is built here from the base model the worker loaded, which must be reachable by
        that name or path from this machine too. A full fine-tuning session's checkpoint is a whole model
        directory (`AutoModelForCausalLM.from_pretrained` loads it), whatever `merged` says.
        """
        manifest = self.manifest(path)
        with tempfile.TemporaryDirectory() as tmp:
            self.download(path, tmp)
            os.makedirs(directory, exist_ok=True)
            if manifest.extra.get("full_config"):
                for name in os.listdir(tmp):
                    if name not in STATE_FILES:
                        shutil.move(os.path.join(tmp, name), os.path.join(directory, name))
                return directory
            if not merged:
                for name in ADAPTER_FILES:
                    shutil.move(os.path.join(tmp, name), os.path.join(directory, name))  # tmp may be another filesystem
                return directory
            stored = [name for name in manifest.files if name.startswith(MERGED_DIR + "/")]
            if stored:
                for name in stored:
                    target = os.path.join(directory, name[len(MERGED_DIR) + 1 :])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.move(os.path.join(tmp, name), target)
                return directory
            from treadle.storage.merged_export import export_merged

            export_merged(manifest.extra.get("base_model_path", manifest.base_model), tmp, directory)
        return directory

    def gc(self) -> list[str]:
        return [p.uri() for p in self.store.gc()]
