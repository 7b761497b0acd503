"""Chat datasets as lists of messages: JSONL files offline, HF datasets (Tulu 3, UltraChat) online.

A conversation is `[{"role": ..., "content": ...}, ...]`. JSONL lines hold `{"messages": [...]}`;
ShareGPT-style `{"conversations": [{"from": "human", "value": ...}]}` is accepted too.
"""

from __future__ import annotations

import json
import os

Conversation = list[dict[str, str]]

EXAMPLE_CONVERSATIONS = os.path.join(os.path.dirname(__file__), "data", "example_conversations.jsonl")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def to_messages(row: dict) -> Conversation:
    """One dataset row as a list of {role, content} messages."""
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    if "conversations" in row:
        return [{"role": _SHAREGPT_ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
    raise ValueError(f"a conversation row needs a 'messages' or 'conversations' field, got fields {sorted(row)}")


def load_jsonl_conversations(path: str) -> list[Conversation]:
    with open(path) as f:
        return [to_messages(json.loads(line)) for line in f if line.strip()]


def load_hf_conversations(name: str, split: str, limit: int | None = None) -> list[Conversation]:
    """E.g. `allenai/tulu-3-sft-mixture` (split `train`) or `HuggingFaceH4/ultrachat_200k` (`train_sft`)."""
    from datasets import load_dataset  # optional, online only

    dataset = load_dataset(name, split=split, streaming=limit is not None)
    rows = dataset.take(limit) if limit is not None else dataset
    return [to_messages(row) for row in rows]
