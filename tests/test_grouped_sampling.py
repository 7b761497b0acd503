"""The sampler's grouped forwards, at the forward level: one attention call per decode step over rows of
any padding (`row_invariant`), and every adapter's LoRA delta in one grouped product (`mixed_lora`).

Each row of a mixed batch must equal the same row alone, bit for bit: the property that makes a seeded
request reproduce whatever shares its batch (`tests/test_batch_sampling.py` checks it end to end)."""

import functools

import pytest
import torch

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.sampling.hf import cache_rows, mixed_lora, row_invariant
from treadle.gpu_worker.sampling.hf.batch_decode import forward_rows
from treadle.types import LoraConfig
from tests.test_batch_sampling import bank_of

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 101], [200, 201, 202, 203, 204, 205], [9]]


@pytest.fixture(scope="module")
def bank(tiny_model_dir) -> AdapterBank:
    """Adapters x, y, z (rank 4) and w (rank 8), with random B matrices so each changes the outputs; y2 is
    y with other weights."""
    return bank_of(tiny_model_dir, [("x", 4), ("y", 4), ("z", 4), ("w", 8), ("y2", 4)])


def prefill_and_steps(bank, prompts, adapters, steps=3) -> list[torch.Tensor]:
    """Per row, its last-position logits of the prefill and of `steps` decode steps (fixed next tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), bank.host.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    out = forward_rows(
        bank,
        adapters,
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
        cache=cache_rows.new_cache(bank.host.model.config),
    )
    logits, cache, positions = [out.logits[:, -1]], out.cache, mask.sum(1)
    for step in range(steps):
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
        out = forward_rows(
            bank,
            adapters,
            input_ids=torch.full((len(prompts), 1), 30 + step),
            attention_mask=mask,
            position_ids=positions.unsqueeze(1),
            cache=cache,
            use_cache=True,
        )
        logits.append(out.logits[:, -1])
        cache, positions = out.cache, positions + 1
    return [torch.stack([step[row] for step in logits]) for row in range(len(prompts))]


def test_mixed_batch_rows_equal_each_row_alone_bitwise(bank):
    # Five prompt lengths, four adapters of two ranks and the base model, rows of one adapter apart.
    adapters = ["x", "w", "y", None, "x"]
    batched = prefill_and_steps(bank, PROMPTS, adapters)
    for row, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):
        alone = prefill_and_steps(bank, [prompt, prompt, prompt], [adapter] * 3)
        assert torch.equal(alone[0], batched[row]), f"row {row} ({adapter}) differs alone and batched"
        assert torch.equal(alone[0], alone[2])
    # The adapters matter: the same row under another adapter scores differently.
    assert not torch.equal(batched[0], prefill_and_steps(bank, [PROMPTS[0]], ["z"])[0])


def test_a_row_is_unaffected_by_another_adapters_weights(bank):
    with_y = prefill_and_steps(bank, PROMPTS[:2], ["x", "y"])
    with_y2 = prefill_and_steps(bank, PROMPTS[:2], ["x", "y2"])
    assert torch.equal(with_y[0], with_y2[0])
    assert not torch.equal(with_y[1], with_y2[1])


def test_stacks_are_kept_per_adapter_set_until_the_bank_changes(bank):
    first = mixed_lora.stacks_for(bank, ("x", "y"))
    assert mixed_lora.stacks_for(bank, ("x", "y")) is first
    layer, stacks = next(iter(first.items()))
    assert [s.names for s in stacks] == [("x", "y")] and stacks[0].a_t.shape[0] == 2
    # One adapter: its own weights, not a copy.
    alone = mixed_lora.stacks_for(bank, ("w",))[layer][0]
    assert alone.a_t.data_ptr() == layer.lora_A["w"].weight.data_ptr()
    # Two ranks: two stacks.
    assert [s.names for s in mixed_lora.stacks_for(bank, ("w", "x"))[layer]] == [("w",), ("x",)]
    bank.add("extra", bank.lora_config(LoraConfig(rank=4, alpha=8)), seed=9)
    try:
        assert mixed_lora.stacks_for(bank, ("x", "y")) is not first
    finally:
        bank.remove("extra")


def test_grouped_adapters_puts_each_layers_own_forward_back(bank):
    # The block replaces the LoRA layers' forwards on the shared model: training forwards after it, or after a
    # forward that failed inside it, must find the layers as they were.
    layers = mixed_lora.stacks_for(bank, ("x",))
    with pytest.raises(RuntimeError, match="inside"):
        with mixed_lora.grouped_adapters(bank, ["x"], layers):
            assert all("forward" in layer.__dict__ for layer in layers)
            raise RuntimeError("failed inside")
    assert not any("forward" in layer.__dict__ for layer in layers)
    layer = next(iter(layers))
    layer.forward = own = functools.partial(type(layer).forward, layer)  # as a wrapper (accelerate's) would be
    try:
        with mixed_lora.grouped_adapters(bank, ["x"], layers):
            assert layer.forward is not own
        assert layer.forward is own
    finally:
        del layer.forward


ATTENTION_VARIANTS = [  # heads, kv_heads, dim, value_dim, variant
    (4, 4, 16, 16, {}),
    (9, 3, 64, 64, {}),
    (8, 1, 32, 32, {"sliding_window": 8}),
    (16, 2, 64, 32, {"s_aux": "sink"}),
    (8, 2, 24, 16, {"softcap": 30.0}),
]
LENGTHS = [1, 7, 64, 65, 130, 3, 300, 700]


def attention_case(heads, kv_heads, dim, value_dim, variant):
    """Rows of LENGTHS keys, one query each: (attend(q, k, v, starts, **kw), query, keys, values, left_pad)."""
    generator = torch.Generator().manual_seed(0)
    if variant.get("s_aux") == "sink":
        variant = {"s_aux": torch.randn(heads, generator=generator)}
    width = max(LENGTHS)
    query = torch.randn(len(LENGTHS), heads, 1, dim, generator=generator)
    keys = [torch.randn(1, kv_heads, n, dim, generator=generator) for n in LENGTHS]
    values = [torch.randn(1, kv_heads, n, value_dim, generator=generator) for n in LENGTHS]

    def attend(q, k, v, starts, **kw):
        runs = [(row, row + 1, int(start)) for row, start in enumerate(starts)]
        return row_invariant._rows_attention(None, q, k, v, None, 0.125, row_runs=runs, **kw, **variant)[0]

    def left_pad(tensors):
        return torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in tensors])

    return attend, query, keys, values, left_pad


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dim, value_dim, variant", ATTENTION_VARIANTS)
def test_decode_attention_alone_equals_batched_bitwise_and_the_grouped_path(
    heads, kv_heads, dim, value_dim, variant, threads
):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        attend, query, keys, values, left_pad = attention_case(heads, kv_heads, dim, value_dim, variant)
        lengths, width = LENGTHS, max(LENGTHS)
        starts = torch.tensor([width - n for n in lengths])
        batched = attend(query, left_pad(keys), left_pad(values), starts, row_starts=starts)
        by_groups = attend(query, left_pad(keys), left_pad(values), starts)
        torch.testing.assert_close(batched, by_groups, rtol=1e-5, atol=1e-5)
        for row, n in enumerate(lengths):
            zeros = torch.zeros(2, dtype=torch.long)
            alone = attend(
                query[row : row + 1].repeat(2, 1, 1, 1),
                keys[row].repeat(2, 1, 1, 1),
                values[row].repeat(2, 1, 1, 1),
                zeros,
                row_starts=zeros,
            )
            assert torch.equal(alone[0], batched[row]), f"row of {n} keys differs alone and batched"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("heads, kv_heads, dim, value_dim, variant", ATTENTION_VARIANTS)
def test_accelerator_decode_attention_equals_the_grouped_path(heads, kv_heads, dim, value_dim, variant, monkeypatch):
    # On an accelerator a decode step attends in one product over the unpadded cache: the same masks, window,
    # sink and soft-cap as the batch-invariant layout, to floating-point tolerance.
    attend, query, keys, values, left_pad = attention_case(heads, kv_heads, dim, value_dim, variant)
    starts = torch.tensor([max(LENGTHS) - n for n in LENGTHS])
    by_groups = attend(query, left_pad(keys), left_pad(values), starts)
    monkeypatch.setattr(row_invariant, "invariant_layouts", lambda device: False)
    plain = attend(query, left_pad(keys), left_pad(values), starts, row_starts=starts)
    torch.testing.assert_close(plain, by_groups, rtol=1e-5, atol=1e-5)


def test_accelerator_layouts_leave_linears_unpadded_and_rows_equal(bank, monkeypatch):
    # Without the CPU's layouts (an accelerator's): no F.linear patch, slots of exactly the rows they hold, and the
    # same numbers as the invariant forwards to fp32 tolerance, mixed adapters and the base model included.
    adapters = ["x", "w", "y", None, "x"]
    invariant = prefill_and_steps(bank, PROMPTS, adapters)
    monkeypatch.setattr(row_invariant, "invariant_layouts", lambda device: False)
    linears = []
    with row_invariant.invariant_forward(bank.host.model):
        linears.append(torch.nn.functional.linear)
    assert linears == [row_invariant._original_linear]
    assert mixed_lora._slots(["x"], ("x",), 1, 50, "cpu").rows == 1
    plain = prefill_and_steps(bank, PROMPTS, adapters)
    for row, (a, b) in enumerate(zip(invariant, plain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"row {row}")
