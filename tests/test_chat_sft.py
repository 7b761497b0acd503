"""Chat SFT on real dataset layouts (Tulu 3 and UltraChat 200k rows as JSONL and parquet, original UltraChat
turns) and conversation packing with per-conversation masks, down to a tiny-model run on the local stack."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treadle.recipes import sft
from treadle.recipes.lib.conversations import load_conversations
from treadle.recipes.lib.packing import pack_conversations
from treadle.recipes.lib.rendering import RenderedConversation, render_conversation

TULU = {
    "id": "oasst1_1",
    "source": "ai2-adapt-dev/oasst1",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ],
}
ULTRACHAT_200K = {
    "prompt": "Name a colour.",
    "prompt_id": "ab12",
    "messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Red."},
    ],
}
ULTRACHAT_ORIGINAL = {"id": "7", "data": ["Name a colour.", "Blue.", "Another?", "Red."]}


def test_tulu3_and_ultrachat_layouts_from_jsonl_json_and_parquet(tmp_path):
    (tmp_path / "tulu.jsonl").write_text(json.dumps(TULU) + "\n")
    (tmp_path / "ultra.json").write_text(json.dumps([ULTRACHAT_ORIGINAL]))
    pq.write_table(pa.Table.from_pylist([ULTRACHAT_200K, TULU]), tmp_path / "mix.parquet")
    assert load_conversations(str(tmp_path / "tulu.jsonl")) == [TULU["messages"]]
    assert load_conversations(str(tmp_path / "ultra.json")) == [ULTRACHAT_200K["messages"]]  # same turns, other layout
    assert load_conversations(str(tmp_path / "mix.parquet")) == [ULTRACHAT_200K["messages"], TULU["messages"]]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match="'messages', 'data' or 'conversations'.*'text'"):
        load_conversations(str(tmp_path / "bad.jsonl"))


def test_packing_keeps_each_conversations_mask_and_zeroes_the_boundary():
    a = RenderedConversation([1, 2, 3, 4], [0.0, 0.0, 1.0, 1.0])
    b = RenderedConversation([5, 6, 7], [1.0, 1.0, 0.0])  # a mask that starts at 1: the boundary must still be 0
    c = RenderedConversation([8, 9, 10, 11, 12, 13], [0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    packs = pack_conversations([a, b, c], max_tokens=7)
    assert [p.tokens for p in packs] == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]]
    assert packs[0].mask == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert packs[1].mask == c.mask
    assert pack_conversations([c], max_tokens=4)[0].tokens == [8, 9, 10, 11]  # too long alone: truncated
    with pytest.raises(ValueError, match="max_tokens must be at least 2, got 1"):
        pack_conversations([a], max_tokens=1)


def test_packed_chat_sft_from_parquet_lowers_heldout_loss(service_client, tmp_path):
    rows = [
        {
            "id": str(i),
            "source": "synthetic",
            "messages": [
                {"role": "user", "content": f"Say the word number {i % 5}."},
                {"role": "assistant", "content": f"word{i % 5} done"},
            ],
        }
        for i in range(40)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = sft.Config(
        base_model="tiny",
        log_dir=str(tmp_path / "run"),
        data_path=str(tmp_path / "train.parquet"),
        eval_size=6,
        pack_tokens=256,
        steps=5,
        batch_size=2,
        learning_rate=1e-2,
        lora_rank=4,
        eval_every=0,
        save_every=5,
    )
    result = sft.main(cfg, service_client)
    tokenizer = service_client.create_lora_training_client("tiny", rank=4).get_tokenizer()
    one = render_conversation(tokenizer, rows[0]["messages"], "all_assistant")
    assert len(one.tokens) * 2 <= 256  # so packs really hold several conversations
    step = [json.loads(line) for line in open(result.metrics_path)][1]
    assert step["tokens"] > 2 * 2 * sum(one.mask)  # a step of 2 packs trains on more than 2 conversations' tokens
    assert result.eval_loss_after < result.eval_loss_before - 0.3
