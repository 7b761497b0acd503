"""The base model of a worker, loaded once: weights, tokenizer, device, dtype and limits.

Accelerate picks the device (CUDA, MPS or CPU); the dtype is bf16 on CUDA and fp32 elsewhere unless
asked otherwise. The base weights are frozen here and never change: only adapters are trained.

On CUDA the host also sets how the worker computes there: fp32 matmuls in TF32 under a bf16 or fp16 base
(`matmul_precision`), and how many tokens one forward/backward micro-batch may hold (`microbatch_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch
from accelerate import PartialState
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
)

from treadle.gpu_worker.model.lora_targets import find_targets
from treadle.gpu_worker.model.sharding import log_memory, parameter_bytes, shard_model
from treadle.gpu_worker.model.vision import Vision, is_vision_model
from treadle.types.base import DEFAULT_MAX_IMAGE_PIXELS

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


def matmul_precision(dtype: torch.dtype) -> str:
    """cuBLAS's precision for fp32 matmuls: TF32 under a half-precision base, IEEE fp32 under an fp32 one.

    PEFT keeps LoRA weights in fp32 over a bf16 base, so the adapters' products are fp32 matmuls; in IEEE
    fp32 they run on CUDA cores, not tensor cores, and were the largest kernels of a bf16 training step on an
    H200 (benchmarks/step_profile.py). Their bf16 inputs are exact in TF32 (10 mantissa bits against bf16's
    7), and the optimizer's master weights stay fp32. An fp32 base asked for fp32 results: no TF32.
    """
    return "tf32" if dtype in (torch.bfloat16, torch.float16) else "none"


CPU_MICROBATCH_TOKENS = 4096  # the budget on a CPU, and the least one on CUDA
MAX_MICROBATCH_TOKENS = 32768
ACTIVATION_SHARE = 0.5  # of the device memory left after the base weights; the rest holds sessions and the KV cache
# fp32 logits the output projection computes at once (`chunk_tokens`, treadle.gpu_worker.training.logprobs): a
# micro-batch's logits never exist whole, whatever its length.
LOGITS_CHUNK_BYTES = 64 * 2**20


def chunk_tokens(vocab_size: int) -> int:
    """Positions whose fp32 logits take `LOGITS_CHUNK_BYTES`: what the output projection computes at once."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def activation_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, *, checkpointed: bool = False) -> float:
    """What one token of a LoRA forward/backward keeps on the device, estimated from the config's shapes: per layer
    34 bytes per unit of hidden size in bf16 with SDPA (docs/scaling.md), plus the fp32 copies PEFT's LoRA layers
    keep (their inputs and their B products: about 10 hidden sizes and 3 MLP widths of fp32). On an H200 a 16 x
    1024 step of SmolLM2-1.7B's shapes took 4.5 MB a token (6.0 estimated, and 0.3 MB of logits), of
    SmolLM2-135M's 0.7 MB (1.8 estimated).

    `checkpointed` (every decoder layer checkpointed): each layer keeps only its input, and the backward pass
    holds one layer's activations at a time while it recomputes them. The logits are not per token: a chunk of
    them at a time (`logits_bytes`)."""
    text = config.get_text_config(decoder=True)
    hidden = text.hidden_size
    # MoE: the widths of the experts one token runs, when the config names them.
    mlp = max(
        getattr(text, "intermediate_size", None) or 4 * hidden,
        (getattr(text, "moe_intermediate_size", None) or 0) * (getattr(text, "num_experts_per_tok", None) or 1),
    )
    per_layer = 34 * hidden * dtype.itemsize / 2 + 4 * (10 * hidden + 3 * mlp)
    if checkpointed:
        return text.num_hidden_layers * hidden * dtype.itemsize + per_layer
    return text.num_hidden_layers * per_layer


def logits_bytes(config: PretrainedConfig, dtype: torch.dtype, tokens: int) -> float:
    """The output projection's memory for a micro-batch of `tokens`, at most that of one chunk whatever the tokens:
    its logits in `dtype`, their fp32 log-softmax, and the gradients of both while the chunk's backward runs."""
    vocab = config.get_text_config(decoder=True).vocab_size
    return min(tokens, chunk_tokens(vocab)) * vocab * (2 * dtype.itemsize + 8)


@dataclass(frozen=True)
class MicrobatchMemory:
    """The memory one forward/backward micro-batch takes, with and without activation checkpointing, and the room
    it has (docs/scaling.md, "Long sequences")."""

    per_token: float  # bytes a token keeps (activation_bytes_per_token)
    per_token_checkpointed: float  # the same with every decoder layer checkpointed
    logits: Callable[[int], float]  # the output projection's bytes for a micro-batch of so many tokens (logits_bytes)
    room: float  # bytes the activations and the logits may take

    def fits(self, tokens: int, *, checkpointed: bool = False) -> bool:
        per_token = self.per_token_checkpointed if checkpointed else self.per_token
        return tokens * per_token + self.logits(tokens) <= self.room


def microbatch_memory(
    model: torch.nn.Module, dtype: torch.dtype, device_memory: int | None, budget: int | None = None
) -> MicrobatchMemory:
    """The arithmetic for `model` on a device of `device_memory` bytes (None: a CPU). On CUDA the room is
    `ACTIVATION_SHARE` of the memory the base weights leave. A CPU's memory is not the worker's to size, so its
    room is what its token budget holds (`budget`, default `CPU_MICROBATCH_TOKENS`) without checkpointing: a
    micro-batch over the budget (one sequence longer than it) does not fit unless checkpointed."""
    memory = MicrobatchMemory(
        per_token=activation_bytes_per_token(model.config, dtype),
        per_token_checkpointed=activation_bytes_per_token(model.config, dtype, checkpointed=True),
        logits=partial(logits_bytes, model.config, dtype),
        room=0.0,
    )
    if device_memory is None:
        budget = budget or CPU_MICROBATCH_TOKENS
        room = budget * memory.per_token + memory.logits(budget)
    else:
        held = parameter_bytes(model)  # a sharded rank's weights: its shards and the units it gathers whole
        weights = held.local + (held.largest_unit if held.local < held.whole else 0)
        room = ACTIVATION_SHARE * (device_memory - weights)
    return replace(memory, room=room)


def microbatch_budget(memory: MicrobatchMemory, device_memory: int | None) -> int:
    """Tokens of one forward/backward micro-batch when the worker is not told: 4096 on a CPU
    (`device_memory` None); on CUDA the largest power of two up to 32768 whose activations fit `memory`'s room
    without checkpointing, and never less than 4096 (a model whose 4096 tokens do not fit has them checkpointed:
    `MicrobatchMemory.fits`). A step of a small model then runs in fewer, larger passes: on a GPU each pass costs
    its kernel launches whatever its size. From the device's total memory, not its free memory, so the same
    model on the same GPU always splits a batch the same way (recovery replays a step bit for bit)."""
    if device_memory is None:
        return CPU_MICROBATCH_TOKENS
    budget = CPU_MICROBATCH_TOKENS
    while budget * 2 <= MAX_MICROBATCH_TOKENS and memory.fits(budget * 2):
        budget *= 2
    return budget


def ungroup_latent_attention(model: torch.nn.Module) -> None:
    """Latent attention (DeepSeek-V2/V3, Kimi) expands its cached latents into keys and values for every query head
    (`kv_b_proj`), so its keys are never shared by groups of heads. A config whose num_key_value_heads is below
    num_attention_heads still makes the attention module repeat those per-head keys for groups (transformers'
    eager attention and masked SDPA then fail on the doubled heads; its unmasked SDPA reads the keys as they are,
    one per head). Every head attends its own keys here too, as that unmasked forward computes."""
    for module in model.modules():
        if hasattr(module, "kv_b_proj") and getattr(module, "num_key_value_groups", 1) != 1:
            module.num_key_value_groups = 1


class ModelHost:
    """A causal LM (hub id or local directory) and its tokenizer, on one device, frozen, in eval mode; a
    vision-language model also with its image path (`vision`; None for a text model).

    `shard`: the weights are sharded over the default process group's ranks (treadle.gpu_worker.model.sharding);
    each rank reads the whole model into host memory once, then keeps its shards on its device."""

    def __init__(
        self,
        model: str,
        *,
        device: str | None = None,
        dtype: str | None = None,
        shard: bool = False,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        self.name = model
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        multimodal = is_vision_model(AutoConfig.from_pretrained(model))
        auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        self.model = auto.from_pretrained(model, dtype=self.dtype)
        self.model.requires_grad_(False)
        if shard:
            shard_model(self.model, self.device)
            log_memory(self.model, self.device, f"loaded {model}")
        else:
            self.model.to(self.device)
        self.model.eval()  # no dropout anywhere: training steps must be deterministic
        ungroup_latent_attention(self.model)
        self.device_memory: int | None = None  # bytes; None on a CPU
        if self.device.type == "cuda":
            self.device_memory = torch.cuda.get_device_properties(self.device).total_memory
            torch.backends.cuda.matmul.fp32_precision = matmul_precision(self.dtype)  # process-wide: one dtype a worker
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
        self.vision = Vision(self.model, model, max_image_pixels=max_image_pixels) if multimodal else None
        # Sampling settings come from each request only: a model's shipped defaults (temperature,
        # top_p, repetition penalty, ...) would silently change the distribution sampled from.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
