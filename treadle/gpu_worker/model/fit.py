"""Whether a model fits a worker's devices, from its config's shapes alone (`treadle models check MODEL --memory_gb G`).

The model is built on the meta device (shapes, no weights), and each rank's memory is added up the way a worker
spends it (docs/scaling.md):

- base weights: on one device or a replicated group, all of them; on a sharded group (`shard`), each weight's
  dim-0 shard (ceil(dim 0 / N) rows, FSDP2's split: the bytes a sharded rank logs at load), plus the units
  gathered whole at once: the root (embeddings, final norm, output projection: whole from a step's backward pass
  to its end) and two decoder layers (one computing, the next one's all-gather prefetched);
- per resident session, replicated on every rank: 16 bytes a LoRA parameter (fp32 weight, gradient, two AdamW
  moments) at rank `lora_rank` on every target (attention, MLP, experts, lm_head);
- activations of one micro-batch (`activation_bytes_per_token`, the worker's own estimate), at the largest
  power of two from 128 to 32768 tokens within `ACTIVATION_SHARE` of what the weights leave;
- `OVERHEAD_GB` of CUDA context and allocator slack.

What is left after those holds the resident sessions; a model fits when at least one session does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from treadle.gpu_worker.model.host import (
    ACTIVATION_SHARE,
    MAX_MICROBATCH_TOKENS,
    activation_bytes_per_token,
    logits_bytes,
)
from treadle.gpu_worker.model.lora_targets import decoder_layers, find_targets

GB = 1e9
OVERHEAD_GB = 4.0
MIN_MICROBATCH_TOKENS = 128
SESSION_BYTES_PER_LORA_PARAM = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Fit:
    """One rank's memory for a model on `devices` devices of `memory_gb` (bytes, but for the counts)."""

    devices: int
    shard: bool
    memory_gb: float
    parameters: int
    weights: int  # this rank's base weights: all of them, or its shards
    gathered: int  # base weights gathered whole at once on a sharded rank
    session: int  # one resident session's adapter and optimizer state
    lora_parameters: int
    tokens: int  # tokens of one micro-batch (0: not even the smallest fits)
    activations: int
    sessions: int

    @property
    def fits(self) -> bool:
        return self.tokens > 0 and self.sessions > 0

    def render(self) -> str:
        how = f"{self.devices} device{'s' if self.devices > 1 else ''}" + (", sharded" if self.shard else "")
        lines = [
            f"fits          {'yes' if self.fits else 'no'} ({how} of {self.memory_gb:g} GB)",
            f"parameters    {self.parameters / 1e9:.2f} B; per rank {self.weights / GB:.1f} GB of base weights"
            + (f" + {self.gathered / GB:.1f} GB gathered at once" if self.shard else ""),
            f"session       {self.session / GB:.2f} GB each ({self.lora_parameters / 1e6:.0f} M LoRA parameters)",
            f"micro-batch   {self.tokens} tokens ({self.activations / GB:.1f} GB of activations): "
            f"--max_tokens_per_microbatch {self.tokens}",
            f"sessions      {self.sessions} resident per worker",
        ]
        return "\n".join(lines)


def meta_model(model: str) -> nn.Module:
    """The model of `model`'s config (a directory or cached hub id), on the meta device: shapes, no weights."""
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def lora_parameters(model: nn.Module, rank: int) -> int:
    """LoRA parameters of a rank-`rank` adapter on every target (what PEFT adds: r x (in + out) per Linear,
    r x experts x (in + out) per 3-D expert weight)."""
    targets = find_targets(model)
    suffixes = (*targets.attention, *targets.mlp)
    total = 0
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(suffixes):
                total += rank * (module.in_features + module.out_features)
        for name, param in layer.named_parameters():
            if param.dim() == 3 and name.removesuffix(".weight").endswith(targets.experts):
                total += rank * param.shape[0] * (param.shape[1] + param.shape[2])
    head = model.get_output_embeddings()
    return total + rank * (head.in_features + head.out_features)


def shard_bytes(param: torch.Tensor, ranks: int, itemsize: int) -> int:
    """One rank's bytes of `param` under FSDP2's dim-0 split (the largest shard)."""
    return math.ceil(param.shape[0] / ranks) * (param.numel() // max(param.shape[0], 1)) * itemsize


def plan(
    model: str, *, devices: int, shard: bool, memory_gb: float, dtype: str = "bfloat16", lora_rank: int = 32
) -> Fit:
    meta, torch_dtype = meta_model(model), _DTYPES[dtype]
    itemsize = torch_dtype.itemsize
    params = list(meta.parameters())
    whole = sum(p.numel() for p in params) * itemsize
    gathered = 0
    weights = whole
    if shard:
        weights = sum(shard_bytes(p, devices, itemsize) for p in params)
        layer = max(sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(meta)) * itemsize
        root = whole - sum(p.numel() for layer in decoder_layers(meta) for p in layer.parameters()) * itemsize
        gathered = root + 2 * layer
    lora = lora_parameters(meta, lora_rank)
    session = SESSION_BYTES_PER_LORA_PARAM * lora
    left = memory_gb * GB - OVERHEAD_GB * GB - weights - gathered
    per_token = activation_bytes_per_token(meta.config, torch_dtype)
    logits = partial(logits_bytes, meta.config, torch_dtype)
    tokens = 0
    candidate = MIN_MICROBATCH_TOKENS
    while candidate <= MAX_MICROBATCH_TOKENS and candidate * per_token + logits(candidate) <= ACTIVATION_SHARE * left:
        tokens, candidate = candidate, candidate * 2
    activations = int(tokens * per_token + logits(tokens))
    sessions = max(0, int((left - activations) // session)) if tokens else 0
    return Fit(
        devices=devices,
        shard=shard,
        memory_gb=memory_gb,
        parameters=sum(p.numel() for p in params),
        weights=weights,
        gathered=gathered,
        session=session,
        lora_parameters=lora,
        tokens=tokens,
        activations=activations,
        sessions=sessions,
    )
