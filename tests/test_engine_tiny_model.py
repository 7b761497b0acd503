"""The tiny-model helper: deterministic, both architectures, a ChatML tokenizer whose template masks assistant turns."""

import filecmp

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.testing.tiny_model import MAX_POSITION_EMBEDDINGS, VOCAB_SIZE, build_tiny_model


def test_same_seed_same_files(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again", arch="llama", seed=0)
    names = ["model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"]
    match, mismatch, errors = filecmp.cmpfiles(tiny_model_dir, again, names, shallow=False)
    assert match == names and not mismatch and not errors


@pytest.mark.parametrize("model_fixture,model_type", [("tiny_model_dir", "llama"), ("tiny_qwen2_dir", "qwen2")])
def test_loads_with_auto_classes(model_fixture, model_type, request):
    directory = request.getfixturevalue(model_fixture)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.model_type == model_type
    assert model.config.vocab_size == VOCAB_SIZE and model.config.max_position_embeddings == MAX_POSITION_EMBEDDINGS
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000


def test_chatml_template_with_assistant_mask(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|pad|>"
    messages = [{"role": "user", "content": "hi café 東京"}, {"role": "assistant", "content": "two plus two"}]
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>user\nhi café 東京<|im_end|>\n<|im_start|>assistant\ntwo plus two<|im_end|>"
    )
    assistant = [t for t, m in zip(ids, mask) if m]
    assert tokenizer.decode(assistant) == "two plus two<|im_end|>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
