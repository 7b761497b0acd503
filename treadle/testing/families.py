"""Tiny random-init configs of every model family treadle serves, built from transformers' own config classes.

Each config keeps what makes its family different from Llama at the smallest size that still shows it:
fused projections (phi3), mixture-of-experts blocks with 3-D expert tensors (qwen3_moe, gpt_oss,
deepseek_v3, llama4), shared experts and latent attention (deepseek_v3, with fewer key-value heads than
query heads in its config), alternating sliding-window layers (gemma3, gpt_oss, olmo3), chunked attention and
position-scaled queries (llama4), attention sinks (gpt_oss), linear-attention layers beside full ones
(qwen3_5), scaled residuals (granite). Sliding windows are 8 tokens, so a 20-token sequence already
runs past them. Every family shares the tiny byte-level tokenizer of `tiny_model` (512 tokens).

The family matrix (`tests/test_model_families.py`) and `treadle models check` use these.
"""

from __future__ import annotations

from typing import Any, Callable

SLIDING_WINDOW = 8

# Shared by every family: 2 layers, hidden 64, 4 query heads of 16 over 2 key/value heads.
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    bos_token_id=None,
)

# YaRN as gpt-oss and DeepSeek-V3 ship it, scaled to the tiny context (512 = 8 x 64 positions).
_YARN = dict(
    rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, rope_theta=10000.0
)

_ALTERNATING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=SLIDING_WINDOW)


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**kw)


def _qwen3(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


def _mistral(**kw):
    from transformers import MistralConfig

    return MistralConfig(**kw, sliding_window=None)  # Mistral v0.2 and later: full attention


def _olmo2(**kw):
    from transformers import Olmo2Config

    return Olmo2Config(**kw)


def _olmo3(**kw):
    from transformers import Olmo3Config

    return Olmo3Config(**kw, **_ALTERNATING)


def _granite(**kw):
    from transformers import GraniteConfig

    # Granite scales embeddings, residuals, attention and logits by constants: non-defaults show them.
    return GraniteConfig(
        **kw, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0
    )


def _phi3(**kw):
    from transformers import Phi3Config

    return Phi3Config(**kw)  # fused qkv_proj and gate_up_proj


def _gemma3(**kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**kw, "tie_word_embeddings": True}, query_pre_attn_scalar=16, **_ALTERNATING)


def _qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True
    )


def _gpt_oss(**kw):
    from transformers import GptOssConfig

    kw = {**kw, "intermediate_size": 32}  # per expert
    return GptOssConfig(
        **kw, num_local_experts=4, num_experts_per_tok=2, attention_bias=True, rope_parameters=_YARN, **_ALTERNATING
    )


def _deepseek_v3(**kw):
    from transformers import DeepseekV3Config

    # Latent attention expands keys and values to every query head (kv_b_proj), so num_key_value_heads (2 of
    # 4, from _COMMON) groups nothing; some checkpoints set it anyway (`model.host.ungroup_latent_attention`).
    kw.pop("head_dim")
    # Layer 0 dense, layer 1 a MoE block with one shared expert; queries and keys/values through
    # low-rank latents (q_a/q_b, kv_a_with_mqa/kv_b), rotary and plain head parts of 8 each.
    return DeepseekV3Config(
        **kw,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _llama4(**kw):
    from transformers import Llama4TextConfig

    # Llama 4's text model: layer 0 attends within chunks of 8 tokens (with RoPE and QK norm), layer 1 over
    # everything without RoPE, its queries scaled by position (temperature tuning: from position 3 on with this
    # floor_scale, 8192 in the released models, and by more with this attn_scale than their 0.1, so that a wrong
    # position shows); layer 1 a MoE block of 4 experts, top-1, beside a shared expert.
    kw = {**kw, "intermediate_size": 32}  # per expert
    return Llama4TextConfig(
        **kw,
        intermediate_size_mlp=128,
        num_local_experts=4,
        num_experts_per_tok=1,
        moe_layers=[1],
        no_rope_layers=[1, 0],
        attention_chunk_size=SLIDING_WINDOW,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=1.0,
    )


def _qwen3_5(**kw):
    from transformers import Qwen3_5TextConfig

    # One gated-delta-net (linear attention) layer, then one full-attention layer.
    return Qwen3_5TextConfig(
        **kw,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


def _falcon_h1(**kw):
    from transformers import FalconH1Config

    # Every layer runs a Mamba-2 mixer and attention side by side (a hybrid cache layer holds both).
    return FalconH1Config(
        **kw, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16
    )


def _nemotron_h(**kw):
    from transformers import NemotronHConfig

    # A Mamba-2 layer, an attention layer, an MLP layer (the pattern string: M = Mamba, * = attention, - = MLP).
    kw = {**kw, "num_hidden_layers": 3}
    return NemotronHConfig(
        **kw,
        hybrid_override_pattern="M*-",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=16,
    )


FAMILIES: dict[str, Callable[..., Any]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "granite": _granite,
    "phi3": _phi3,
    "gemma3": _gemma3,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "llama4": _llama4,
    "qwen3_5": _qwen3_5,
    "falcon_h1": _falcon_h1,
    "nemotron_h": _nemotron_h,
}


def family_config(family: str, *, vocab_size: int, max_position_embeddings: int, eos_token_id: int, pad_token_id: int):
    """The tiny config of `family` (a key of FAMILIES)."""
    if family not in FAMILIES:
        raise ValueError(f"family: unknown {family!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[family](
        **_COMMON,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
