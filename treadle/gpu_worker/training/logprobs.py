"""Teacher-forced logprobs of target tokens, and the token budget that splits a batch into micro-batches.

One padded forward pass over a group of sequences gives `log p(target_t | tokens_<=t)` for every
position. Large batches are cut into micro-batches whose padded size fits a token budget, so batch
size never decides whether a step fits in memory; since every loss is a sum over tokens, running
the micro-batches one after another and accumulating gradients gives the same result.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices whose padded size (count x longest) stays within `budget` tokens.

    A sequence longer than the budget forms a group of its own (it has to run anyway).
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def target_logprobs(
    model: nn.Module,
    tokens: list[np.ndarray],
    targets: list[np.ndarray],
    *,
    device: torch.device,
    pad_token_id: int,
) -> list[torch.Tensor]:
    """Per sequence, the float32 logprob of each target token (gradients flow if grad mode is on), in the
    target's shape: `(N,)`, or `(N, K)` for K target tokens a position (one log-softmax, K gathers).

    Sequences are right-padded: with causal attention, padding after a sequence cannot change it.
    """
    width = max(len(t) for t in tokens)
    columns = max(t.shape[1] if t.ndim == 2 else 1 for t in targets)
    input_ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    target_ids = torch.zeros((len(tokens), width, columns), dtype=torch.long)
    attention_mask = torch.zeros((len(tokens), width), dtype=torch.long)
    for row, (seq, tgt) in enumerate(zip(tokens, targets)):
        input_ids[row, : len(seq)] = torch.from_numpy(seq)
        target_ids[row, : len(tgt), : (tgt.shape[1] if tgt.ndim == 2 else 1)] = torch.from_numpy(
            tgt.reshape(len(tgt), -1)
        )
        attention_mask[row, : len(seq)] = 1
    input_ids, target_ids, attention_mask = input_ids.to(device), target_ids.to(device), attention_mask.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids)
    return [
        logprobs[row, : len(seq), : tgt.shape[1]] if tgt.ndim == 2 else logprobs[row, : len(seq), 0]
        for row, (seq, tgt) in enumerate(zip(tokens, targets))
    ]
