"""Packing short conversations into one sequence up to a token budget, with per-conversation loss masks.

Short chats (a question, a one-line answer) waste most of a padded batch; packing several into one
datum trains on the same tokens in fewer, fuller sequences. Each conversation keeps its own mask,
and the first token of each one gets weight 0, so no loss is put on predicting a conversation's
opening token from the end of the previous one.

What packing does not do: the worker runs a packed sequence as one causal sequence, so a
conversation's tokens can attend to the conversations before it in the same pack (there is no
per-document attention mask). With chat templates that open every conversation with the same
header this changes the loss little; compare against `pack_tokens=None` on your data.
"""

from __future__ import annotations

from typing import Sequence

from treadle.recipes.lib.rendering import RenderedConversation


def pack_conversations(conversations: Sequence[RenderedConversation], max_tokens: int) -> list[RenderedConversation]:
    """Consecutive conversations joined, in order, into packs of at most `max_tokens` tokens.

    A conversation longer than `max_tokens` is truncated and packed alone; order is kept, so a pack
    is a contiguous run of the input (deterministic for a deterministic input order).
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    packs: list[RenderedConversation] = []
    tokens: list[int] = []
    mask: list[float] = []
    for conversation in conversations:
        piece_tokens, piece_mask = conversation.tokens[:max_tokens], [0.0, *conversation.mask[1:max_tokens]]
        if tokens and len(tokens) + len(piece_tokens) > max_tokens:
            packs.append(RenderedConversation(tokens, mask))
            tokens, mask = [], []
        tokens, mask = tokens + piece_tokens, mask + piece_mask
    if tokens:
        packs.append(RenderedConversation(tokens, mask))
    return packs
