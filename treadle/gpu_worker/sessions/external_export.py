"""External weights: a session's adapter as plain PEFT files for download (a full fine-tuning session's weights as
a model directory), optionally age-encrypted.

Tinker's `save_weights_external` exports a checkpoint whose files the client downloads through signed
URLs; with `age_encryption_recipients` every file is encrypted to those recipients (native `age1...`
keys or SSH public keys) and stored with a `.age` suffix, so the store only ever holds ciphertext.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyrage

from treadle.errors import InvalidRequestError
from treadle.gpu_worker.model import full_weights

# The files of a PEFT adapter directory; the training state beside them (optimizer, RNG) is not exported.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
AGE_SUFFIX = ".age"


def parse_recipients(recipients: list[str]) -> list:
    """age recipients from their text form; a bad one is a user error naming it."""
    parsed = []
    for i, text in enumerate(recipients):
        kind = pyrage.ssh if text.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(text))
        except pyrage.RecipientError as exc:
            raise InvalidRequestError(
                f"age_encryption_recipients[{i}]: {text[:40]!r} is not an age or SSH public key ({exc})"
            ) from None
    return parsed


def export_adapter(state_dir: str, out_dir: str, recipients: list[str] | None) -> None:
    """Copy the adapter files of `state_dir` into `out_dir`, each encrypted to `recipients` when given."""
    keys = parse_recipients(recipients) if recipients else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = full_weights.model_dir_files(state_dir) if full_weights.is_full_dir(state_dir) else ADAPTER_FILES
    for name in files:
        source = Path(state_dir) / name
        if keys is None:
            shutil.copyfile(source, out / name)
        else:
            pyrage.encrypt_file(str(source), str(out / (name + AGE_SUFFIX)), keys)
