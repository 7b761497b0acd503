"""Chat datasets as lists of messages: files a user already has (JSONL, JSON, parquet), or HF datasets online.

A conversation is `[{"role": ..., "content": ...}, ...]`. Row layouts accepted:
- `{"messages": [...]}`: Tulu 3 (`allenai/tulu-3-sft-mixture`: plus `id`, `source`) and UltraChat 200k
  (`HuggingFaceH4/ultrachat_200k`: plus `prompt`, `prompt_id`); extra fields are ignored;
- `{"data": ["user turn", "assistant turn", ...]}`: the original UltraChat release, turns alternating;
- ShareGPT-style `{"conversations": [{"from": "human", "value": ...}]}`.
Parquet files (how both datasets are published on the hub) are read with `datasets` when it is
installed, else with pyarrow.
"""

from __future__ import annotations

import json
import os

Conversation = list[dict[str, str]]

EXAMPLE_CONVERSATIONS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "example_conversations.jsonl")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def to_messages(row: dict) -> Conversation:
    """One dataset row as a list of {role, content} messages."""
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    if "conversations" in row:
        return [{"role": _SHAREGPT_ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
    if "data" in row:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(row["data"])]
    raise ValueError(
        f"a conversation row needs a 'messages', 'data' or 'conversations' field, got fields {sorted(row)}"
    )


def load_jsonl_conversations(path: str) -> list[Conversation]:
    with open(path) as f:
        return [to_messages(json.loads(line)) for line in f if line.strip()]


def _parquet_rows(path: str) -> list[dict]:
    try:
        from datasets import load_dataset
    except ImportError:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return list(load_dataset("parquet", data_files=path, split="train"))


def load_conversations(path: str) -> list[Conversation]:
    """A local file of conversations: `.parquet`, a `.json` array, or JSONL (any other name)."""
    if path.endswith(".parquet"):
        return [to_messages(row) for row in _parquet_rows(path)]
    if path.endswith(".json"):
        with open(path) as f:
            text = f.read()
        if text.lstrip().startswith("["):
            return [to_messages(row) for row in json.loads(text)]
    return load_jsonl_conversations(path)


def load_hf_conversations(name: str, split: str, limit: int | None = None) -> list[Conversation]:
    """E.g. `allenai/tulu-3-sft-mixture` (split `train`) or `HuggingFaceH4/ultrachat_200k` (`train_sft`)."""
    from datasets import load_dataset  # optional, online only

    dataset = load_dataset(name, split=split, streaming=limit is not None)
    rows = dataset.take(limit) if limit is not None else dataset
    return [to_messages(row) for row in rows]
