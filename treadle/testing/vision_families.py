"""Tiny random-init vision-language models: a decoder as small as `families`' and a one-block vision tower.

A vision family is its model config (from transformers' own config classes), the special tokens its
processor and chat format need (added to the tiny tokenizer's specials, so the vocabulary stays 512), and
an image processor built offline from transformers' PIL backend, sized so that a small image is a few
tokens: Qwen's patches (14 pixels for Qwen2.5-VL, 16 for Qwen3-VL) merged 2 x 2, between 4 and 16 tokens an
image (56 x 56 pixels: 4 for Qwen2.5-VL); Gemma 3's every image resized to 56 x 56 pixels, 4 tokens. With the
processor's config, the tokenizer's chat template (an image part written as the family's marker) and, for
Qwen, a video processor's config, the directory is one that `AutoProcessor` loads: Gemma 3's anywhere, Qwen's
where torchvision is installed (their video processors' classes need it; PyPI has no CPU build of it for the
CPU torch that treadle's tests run on).

    python -m treadle.testing.tiny_model DIR --arch qwen2_5_vl
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 4, 16


@dataclass(frozen=True)
class VisionFamily:
    config: Callable[..., Any]  # (token ids by name, **the decoder's common fields) -> the model's config
    special_tokens: tuple[str, ...]
    image_processor: Callable[[], Any]
    # processor_config.json: the class `AutoProcessor` builds and its settings (the directory's other files give
    # it its image processor, tokenizer and chat template)
    processor: dict[str, Any]
    image_marker: str  # what the chat template writes for an image part, which the processor expands
    named_tokens: dict[str, str] = field(default_factory=dict)  # the tokenizer's special tokens by role (Gemma 3's)
    video_processor: dict[str, Any] | None = None  # video_preprocessor_config.json (its class needs torchvision)


def _qwen_image_processor(patch: int = 14):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    token = (2 * patch) ** 2  # one image token: a 2 x 2 merge of patches
    return Qwen2VLImageProcessorPil(
        patch_size=patch, min_pixels=MIN_IMAGE_TOKENS * token, max_pixels=MAX_IMAGE_TOKENS * token
    )


def _qwen_video_processor(name: str, patch: int) -> dict[str, Any]:
    """A Qwen video processor's config, sized as the image processor (a frame is 4 to 16 tokens)."""
    token = (2 * patch) ** 2
    return dict(
        video_processor_type=name,
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": MIN_IMAGE_TOKENS * token, "longest_edge": MAX_IMAGE_TOKENS * token},
    )


QWEN_IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen_image_tokens(ids: dict[str, int]) -> dict[str, int]:
    """The ids of the special tokens Qwen's vision configs name (the tiny tokenizer's, `ids`)."""
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _qwen2_5_vl(ids: dict[str, int], **text):
    from transformers import Qwen2_5_VLConfig

    # M-RoPE: the rotary half of each 16-wide head split over time, height and width.
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        window_size=56,
        fullatt_block_indexes=[0],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        **_qwen_image_tokens(ids),
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        tie_word_embeddings=False,
    )


def _qwen3_vl(ids: dict[str, int], **text):
    from transformers import Qwen3VLConfig

    # Interleaved M-RoPE over 16-wide heads; the tower feeds its first block's features to the decoder's first
    # layers too (deepstack).
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        **_qwen_image_tokens(ids),
        tie_word_embeddings=False,
    )


def _qwen3_5_vision(ids: dict[str, int], **text):
    from transformers import Qwen3_5Config

    # The decoder of `families`' qwen3_5 (a gated-delta-net layer, then a full-attention one) with M-RoPE, and
    # Qwen3-VL's tower without deepstack.
    text |= dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=64,
    )
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        **_qwen_image_tokens(ids),
        tie_word_embeddings=False,
    )


GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def _gemma3_image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


def _gemma3_vision(ids: dict[str, int], **text):
    from transformers import Gemma3Config

    # `families`' gemma3 decoder (a sliding-window layer, then a full one) under a one-layer SigLIP tower: 56 x 56
    # pixels, 4 x 4 patches pooled to 4 image tokens.
    text |= dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )


def _qwen(config: Callable[..., Any], processor: str, video_processor: str, patch: int) -> VisionFamily:
    return VisionFamily(
        config,
        QWEN_VISION_TOKENS,
        lambda: _qwen_image_processor(patch),
        {"processor_class": processor},
        QWEN_IMAGE_MARKER,
        video_processor=_qwen_video_processor(video_processor, patch),
    )


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_5_vl": _qwen(_qwen2_5_vl, "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", patch=14),
    "qwen3_vl": _qwen(_qwen3_vl, "Qwen3VLProcessor", "Qwen3VLVideoProcessor", patch=16),
    "qwen3_5_vision": _qwen(_qwen3_5_vision, "Qwen3VLProcessor", "Qwen3VLVideoProcessor", patch=16),
    "gemma3_vision": VisionFamily(
        _gemma3_vision,
        GEMMA3_IMAGE_TOKENS,
        _gemma3_image_processor,
        # an image's tokens, as the model's mm_tokens_per_image
        {"processor_class": "Gemma3Processor", "image_seq_length": 4},
        "<start_of_image>",
        named_tokens=dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA3_IMAGE_TOKENS)),
    ),
}
