"""The micro-batch budget a worker picks when not told (treadle.gpu_worker.model.host.microbatch_budget), when its
micro-batches are checkpointed (`MicrobatchMemory.fits`), and the matmul precision it sets on CUDA.

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
    microbatch_memory,
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
SMOLLM2_1_7B = dict(layers=24, hidden=2048, intermediate=8192, vocab=49152, heads=32, kv_heads=32)
LLAMA_8B = dict(layers=32, hidden=4096, intermediate=14336, vocab=128256, heads=32, kv_heads=8)


def budget(model: torch.nn.Module, dtype: torch.dtype, memory: int | None) -> int:
    return microbatch_budget(microbatch_memory(model, dtype, memory), memory)


def test_a_cpu_keeps_the_fixed_budget_and_checkpoints_what_is_over_it():
    model = shaped(llama(**SMOLLM2_135M), torch.float32)
    assert budget(model, torch.float32, None) == CPU_MICROBATCH_TOKENS == 4096
    memory = microbatch_memory(model, torch.float32, None)
    assert memory.fits(4096) and not memory.fits(4097)  # one datum of 8,192 tokens is checkpointed
    assert memory.fits(8192, checkpointed=True) and not memory.fits(64 * 4096, checkpointed=True)
    told = microbatch_memory(model, torch.float32, None, budget=16384)  # --max_tokens_per_microbatch 16384
    assert told.fits(16384) and not told.fits(16385)


@pytest.mark.parametrize(
    ("shape", "memory", "expected"),
    [
        # 1.8 MB a token (activation_bytes_per_token), 0.3 GB of weights; half of what they leave:
        (SMOLLM2_135M, H200, 32768),  # 75 GB: 35k tokens, capped
        (SMOLLM2_135M, H100, 16384),  # 40 GB: 18.7k
        (SMOLLM2_135M, L4, 4096),  # 11.8 GB: 5.6k
        (SMOLLM2_1_7B, H200, 8192),  # 6.0 MB a token, 73.6 GB: 12.2k
        # 15.4 MB a token, 16 GB of weights: never more than the CPU's budget
        (LLAMA_8B, H200, 4096),
        (LLAMA_8B, H100, 4096),
    ],
)
def test_small_models_get_larger_micro_batches_where_memory_allows(shape, memory, expected):
    assert budget(shaped(llama(**shape)), torch.bfloat16, memory) == expected


def test_a_model_whose_least_budget_does_not_fit_is_checkpointed():
    """8B on an H100: 4,096 tokens would take 63 GB of the 32 GB the weights leave for activations; checkpointed,
    3.0 GB (each of 32 layers keeps its 8 KB input a token, one layer its 475 KB while it is recomputed)."""
    memory = microbatch_memory(shaped(llama(**LLAMA_8B)), torch.bfloat16, H100)
    assert not memory.fits(4096) and memory.fits(4096, checkpointed=True)
    assert microbatch_memory(shaped(llama(**LLAMA_8B)), torch.bfloat16, H200).fits(4096)  # 67 GB left there


def test_the_budget_grows_with_memory_and_shrinks_with_the_dtype():
    model = shaped(llama(**SMOLLM2_135M))
    budgets = [budget(model, torch.bfloat16, gb * GB) for gb in (16, 24, 40, 48, 80, 96, 141, 192)]
    assert budgets == sorted(budgets) and budgets[0] == CPU_MICROBATCH_TOKENS and budgets[-1] == MAX_MICROBATCH_TOKENS
    fp32 = shaped(llama(**SMOLLM2_135M), torch.float32)
    assert budget(fp32, torch.float32, H100) < budget(model, torch.bfloat16, H100)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_has_what_the_estimate_reads(family):
    """Every family's config names its hidden size, layers and embeddings where the estimate looks (a missing
    attribute would stop a CUDA worker at load); a tiny model gets the largest budget on a big GPU."""
    config = family_config(family, vocab_size=512, max_position_embeddings=512, eos_token_id=0, pad_token_id=3)
    assert budget(shaped(config), torch.bfloat16, H200) == MAX_MICROBATCH_TOKENS


def test_tf32_only_under_a_half_precision_base():
    assert matmul_precision(torch.bfloat16) == matmul_precision(torch.float16) == "tf32"
    assert matmul_precision(torch.float32) == "none"  # torch's default: IEEE fp32, what the fp32 tolerances assume
