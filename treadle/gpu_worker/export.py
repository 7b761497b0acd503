"""Merged export: base model + LoRA adapter folded into one plain model directory.

The result loads with `AutoModelForCausalLM.from_pretrained` alone (no peft), for serving with tools
that cannot apply LoRA themselves. The merge runs in fp32 and the result is cast back to the base
model's stored dtype.
"""

from __future__ import annotations

import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def export_merged(base_model: str, adapter_dir: str, out_dir: str) -> None:
    """Write base + adapter merged, with the base model's tokenizer, to `out_dir`."""
    stored_dtype = AutoConfig.from_pretrained(base_model).dtype
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    if isinstance(stored_dtype, torch.dtype):
        merged = merged.to(stored_dtype)
    merged.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(out_dir)
