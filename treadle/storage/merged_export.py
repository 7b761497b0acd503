"""Merged export: base model + LoRA adapter folded into one plain model directory.

The result loads with `AutoModelForCausalLM.from_pretrained` alone (no peft), for serving with tools
that cannot apply LoRA themselves; a vision-language model's with `AutoModelForImageTextToText`, and
`AutoProcessor` loads the base model's processor from it (its files copied as they are). The merge runs in fp32 and the result is cast back to the base
model's stored dtype.

Models that tie the output layer to the input embeddings (SmolLM2, Qwen2-0.5B, ...) are untied
first when the adapter trains `lm_head`: merging the LoRA delta into a shared matrix would also
change the input embeddings, which the adapter never did.
"""

from __future__ import annotations

import os
import shutil

import torch
from peft import PeftConfig, PeftModel
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)
from transformers.utils import cached_file


def export_merged(base_model: str, adapter_dir: str, out_dir: str) -> None:
    """Write base + adapter merged, with the base model's tokenizer, to `out_dir`."""
    config = AutoConfig.from_pretrained(base_model)
    stored_dtype = config.dtype
    untie = (
        bool(getattr(config, "tie_word_embeddings", False))
        and "lm_head" in PeftConfig.from_pretrained(adapter_dir).target_modules
    )
    vision = getattr(config, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(base_model, dtype=torch.float32)
    if untie:
        model.config.tie_word_embeddings = False
        model.get_output_embeddings().weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    if isinstance(stored_dtype, torch.dtype):
        merged = merged.to(stored_dtype)
    merged.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(out_dir)
    if vision:
        copy_processor(base_model, out_dir)


# A processor's own files. Copied, not re-saved through AutoProcessor: loading one may need packages the worker
# lacks (Qwen's video processor needs torchvision), and a re-save drops what its class does not know.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def copy_processor(base_model: str, out_dir: str) -> None:
    """The base model's processor files (a directory's, or the hub cache's) into `out_dir`."""
    for name in PROCESSOR_FILES:
        path = cached_file(base_model, name, _raise_exceptions_for_missing_entries=False)
        if path is not None:
            shutil.copyfile(path, os.path.join(out_dir, name))
