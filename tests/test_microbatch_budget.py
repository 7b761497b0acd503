"""The micro-batch budget a worker picks when not told (treadle.gpu_worker.model.host.microbatch_budget), and the
matmul precision it sets on CUDA.

The models are built on the meta device: their shapes, dtypes and parameter counts are real (transformers' own
config classes), their memory is not allocated, so an 8B-shaped model costs nothing here.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from treadle.gpu_worker.model.host import (
    CPU_MICROBATCH_TOKENS,
    MAX_MICROBATCH_TOKENS,
    matmul_precision,
    microbatch_budget,
)
from treadle.testing.families import FAMILIES, family_config

GB = 10**9
H200 = 143_771 * 2**20  # what torch reports for the lent H200
H100 = 80 * GB
L4 = 24 * GB


def shaped(config, dtype=torch.bfloat16) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def llama(layers: int, hidden: int, intermediate: int, vocab: int, heads: int, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
    )


SMOLLM2_135M = dict(layers=30, hidden=576, intermediate=1536, vocab=49152, heads=9, kv_heads=3)
LLAMA_8B = dict(layers=32, hidden=4096, intermediate=14336, vocab=128256, heads=32, kv_heads=8)


def test_a_cpu_keeps_the_fixed_budget():
    assert microbatch_budget(shaped(llama(**SMOLLM2_135M)), torch.float32, None) == CPU_MICROBATCH_TOKENS == 4096


@pytest.mark.parametrize(
    ("shape", "memory", "expected"),
    [
        # 34 x 576 x 30 + 6 x 49152 = 0.88 MB a token: a quarter of what the 0.27 GB of weights leave
        (SMOLLM2_135M, H200, 32768),  # 35.9 GB: 40.7k tokens, capped
        (SMOLLM2_135M, H100, 16384),  # 19.9 GB: 22.5k
        (SMOLLM2_135M, L4, 4096),  # 5.9 GB: 6.7k
        # 34 x 4096 x 32 + 6 x 128256 = 5.2 MB a token, 16 GB of weights: never more than the CPU's budget
        (LLAMA_8B, H200, 4096),
        (LLAMA_8B, H100, 4096),
    ],
)
def test_small_models_get_larger_micro_batches_where_memory_allows(shape, memory, expected):
    assert microbatch_budget(shaped(llama(**shape)), torch.bfloat16, memory) == expected


def test_the_budget_grows_with_memory_and_shrinks_with_the_dtype():
    model = shaped(llama(**SMOLLM2_135M))
    budgets = [microbatch_budget(model, torch.bfloat16, gb * GB) for gb in (16, 24, 40, 48, 80, 96, 141, 192)]
    assert budgets == sorted(budgets) and budgets[0] == CPU_MICROBATCH_TOKENS and budgets[-1] == MAX_MICROBATCH_TOKENS
    fp32 = shaped(llama(**SMOLLM2_135M), torch.float32)
    assert microbatch_budget(fp32, torch.float32, H100) < microbatch_budget(model, torch.bfloat16, H100)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_has_what_the_estimate_reads(family):
    """Every family's config names its hidden size, layers and embeddings where the estimate looks (a missing
    attribute would stop a CUDA worker at load); a tiny model gets the largest budget on a big GPU."""
    config = family_config(family, vocab_size=512, max_position_embeddings=512, eos_token_id=0, pad_token_id=3)
    assert microbatch_budget(shaped(config), torch.bfloat16, H200) == MAX_MICROBATCH_TOKENS


def test_tf32_only_under_a_half_precision_base():
    assert matmul_precision(torch.bfloat16) == matmul_precision(torch.float16) == "tf32"
    assert matmul_precision(torch.float32) == "none"  # torch's default: IEEE fp32, what the fp32 tolerances assume
