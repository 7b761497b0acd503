"""The base model of a worker, loaded once: weights, tokenizer, device, dtype and limits.

Accelerate picks the device (CUDA, MPS or CPU); the dtype is bf16 on CUDA and fp32 elsewhere unless
asked otherwise. The base weights are frozen here and never change: only adapters are trained.
"""

from __future__ import annotations

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from treadle.gpu_worker.model.lora_targets import find_targets

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str | None) -> torch.device:
    """The requested device, or the one Accelerate's process state picks for this process."""
    return torch.device(device) if device else PartialState().device


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what LoRA training there uses), fp32 on CPU (bf16 matmuls are slow and lossy there)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class ModelHost:
    """A causal LM (hub id or local directory) and its tokenizer, on one device, frozen, in eval mode."""

    def __init__(self, model: str, *, device: str | None = None, dtype: str | None = None):
        self.name = model
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype).to(self.device)
        self.model.eval()  # no dropout anywhere: training steps must be deterministic
        self.model.requires_grad_(False)
        config = self.model.config.get_text_config(decoder=True)
        self.max_seq_len: int = int(config.max_position_embeddings)
        self.vocab_size: int = int(self.model.get_input_embeddings().num_embeddings)
        self.model_type: str = config.model_type
        # What LoRA can adapt on this model; a model whose layers cannot be classified is refused here, at load.
        self.targets = find_targets(self.model)
        self.eos_token_id: int = self.tokenizer.eos_token_id
        self.pad_token_id: int = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        )
        # Sampling settings come from each request only: a model's shipped defaults (temperature,
        # top_p, repetition penalty, ...) would silently change the distribution sampled from.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
