"""A tiny random-init causal LM plus a freshly trained byte-level BPE tokenizer, written to a directory.

Tests (and anyone trying treadle offline) need a real model directory that the real loading code
(`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`) reads, without a download.
Everything is built from a config and a seeded synthetic corpus, so the same seed gives the same
files. The tokenizer speaks ChatML (`<|im_start|>role\\n...<|im_end|>`) and its chat template marks
assistant turns with `{% generation %}` so `return_assistant_tokens_mask=True` works.

    python -m treadle.testing.tiny_model DIR [--arch llama|qwen3_moe|gpt_oss|...] [--seed 0]

`--arch` takes any family of `treadle.testing.families` (llama, the default, is the tests' usual model) or
of `treadle.testing.vision_families` (qwen2_5_vl, qwen3_vl, qwen3_5_vision, gemma3_vision: vision-language models, whose
directory also holds what `AutoProcessor` loads: the image processor, which the worker reads, and the
processor's config).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from treadle.testing.families import _COMMON, FAMILIES, family_config
from treadle.testing.vision_families import VISION_FAMILIES, VisionFamily


VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def chatml_template(image_marker: str = "") -> str:
    """ChatML. With `image_marker` (a vision model's), a message's content may also be a list of parts, as
    transformers' processors and OpenAI's messages have them: `{"type": "text", "text": ...}`, and an image
    (`{"type": "image"}`) written as the marker that the model's processor expands into its image tokens."""
    content = "{{ message['content'] }}"
    if image_marker:
        content = (
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}"
            f"{{% if part['type'] == 'image' %}}{image_marker}{{% else %}}{{{{ part['text'] }}}}{{% endif %}}"
            "{% endfor %}{% endif %}"
        )
    return (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        f"<|im_start|>assistant\n{{% generation %}}{content}<|im_end|>{{% endgeneration %}}\n"
        "{% else %}"
        f"<|im_start|>{{{{ message['role'] }}}}\n{content}<|im_end|>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHATML_TEMPLATE = chatml_template()

_WORDS = (
    "the a one two three four five six seven eight nine ten plus minus times equals answer question "
    "what is of and to in model train sample token loss step cat dog red blue green sun moon tree "
    "river stone hello world yes no please thanks user assistant system think because so then"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Synthetic text with words, digits, punctuation and a little Unicode, so BPE learns useful merges."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(f"{rng.randint(0, 999)} + {rng.randint(0, 999)} = {rng.randint(0, 1998)}")
        if rng.random() < 0.05:
            words.append("café ñ ü 東京")
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ""]))
    return out


def build_tokenizer(
    seed: int = 0,
    extra_special_tokens: tuple[str, ...] = (),
    *,
    named_tokens: dict[str, str] | None = None,
    image_marker: str = "",
):
    """A 512-token byte-level BPE with ChatML special tokens, and `extra_special_tokens` after them (a vision
    model's image markers) within the same 512 (trains in well under a second). `named_tokens` gives some of
    them a role that the model's processor reads (`tokenizer.boi_token`); `image_marker`: `chatml_template`'s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template=chatml_template(image_marker),
        **({"extra_special_tokens": named_tokens} if named_tokens else {}),
        additional_special_tokens=list(extra_special_tokens) or None,
    )


def _config(arch: str, tokenizer, tie_word_embeddings: bool, head_dim: int | None, initializer_range: float | None):
    sizes = dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch in VISION_FAMILIES:
        family = VISION_FAMILIES[arch]
        ids = {name: tokenizer.convert_tokens_to_ids(name) for name in family.special_tokens}
        config = family.config(ids, **_COMMON, **sizes)
    else:
        config = family_config(arch, **sizes)
    # On a vision-language model these shape its decoder; its weights' spread applies to the tower's too.
    for part in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if tie_word_embeddings:
            part.tie_word_embeddings = True
        if head_dim:
            part.head_dim = head_dim
        if initializer_range:
            part.initializer_range = initializer_range
            if getattr(part, "vision_config", None) is not None:
                part.vision_config.initializer_range = initializer_range
    return config


def build_tiny_model(
    directory: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    initializer_range: float | None = None,
) -> str:
    """Write a tiny random-init causal LM and its tokenizer to `directory`; returns the path as a str.

    `tie_word_embeddings=True` shares lm_head with the input embeddings, as many small real models do.
    `head_dim` widens each attention head (default 16, hidden size / heads): vLLM's CPU attention
    kernels take head sizes of 32 and up only. `initializer_range` (the std of the random weights;
    transformers' default 0.02) makes a model's outputs far from uniform when raised (0.2): a check that
    compares two ways of computing logprobs then sees a wrong mask or cache, which a near-uniform model hides.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vision = VISION_FAMILIES.get(arch)
    if vision:
        tokenizer = build_tokenizer(
            seed, vision.special_tokens, named_tokens=vision.named_tokens, image_marker=vision.image_marker
        )
    else:
        tokenizer = build_tokenizer(seed)
    assert len(tokenizer) == VOCAB_SIZE, f"tokenizer has {len(tokenizer)} tokens, expected {VOCAB_SIZE}"
    config = _config(arch, tokenizer, tie_word_embeddings, head_dim, initializer_range)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    # Gemma 3's projector into the decoder starts at zero in transformers (a model before its training), which would
    # keep every image's features from the decoder: drawn as the other weights are instead.
    for name, weight in model.named_parameters():
        if name.endswith("mm_input_projection_weight"):
            torch.nn.init.normal_(weight, std=config.get_text_config().initializer_range)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if vision:
        _write_processor(directory, vision)
    return str(directory)


def _write_processor(directory: Path, vision: VisionFamily) -> None:
    """What `AutoProcessor` assembles beside the tokenizer and its chat template: the image processor, the
    processor's own config and, for a model that also takes videos, its video processor's config (written as
    JSON: the class needs torchvision, which the processor's loading then does too)."""
    vision.image_processor().save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps(vision.processor, indent=2) + "\n")
    if vision.video_processor:
        config = json.dumps(vision.video_processor, indent=2) + "\n"
        (directory / "video_preprocessor_config.json").write_text(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="Output directory (created if missing).")
    parser.add_argument("--arch", choices=[*FAMILIES, *VISION_FAMILIES], default="llama", help="Model family.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights and the tokenizer corpus.")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="Share lm_head with the input embeddings.")
    parser.add_argument(
        "--head-dim", type=int, default=None, help="Attention head size (default 16; vLLM's CPU kernels need >= 32)."
    )
    args = parser.parse_args(argv)
    print(
        build_tiny_model(
            args.directory,
            arch=args.arch,
            seed=args.seed,
            tie_word_embeddings=args.tie_word_embeddings,
            head_dim=args.head_dim,
        )
    )


if __name__ == "__main__":
    main()
