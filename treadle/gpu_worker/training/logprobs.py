"""Teacher-forced logprobs of target tokens, and the token budget that splits a batch into micro-batches.

One padded forward pass over a group of sequences gives `log p(target_t | tokens_<=t)` for every
position. Large batches are cut into micro-batches whose padded size fits a token budget, so batch
size never decides whether a step fits in memory; since every loss is a sum over tokens, running
the micro-batches one after another and accumulating gradients gives the same result.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from treadle.gpu_worker.model.vision import Vision, VisualInput, batch_positions


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


def on_host(flat: Tensor, logprobs: list[Tensor]) -> list[np.ndarray]:
    """`logprobs` as numpy arrays of their shapes, from `flat` (their concatenation, flattened) in one copy off
    the device rather than one a sequence: each copy from a GPU waits for it."""
    values = flat.detach().cpu().numpy()
    parts = np.split(values, np.cumsum([lp.numel() for lp in logprobs])[:-1])
    return [part.reshape(lp.shape) for lp, part in zip(logprobs, parts)]


def target_logprobs(
    model: nn.Module,
    tokens: list[np.ndarray],
    targets: list[np.ndarray],
    *,
    device: torch.device,
    pad_token_id: int,
    needs_grad: list[np.ndarray] | None = None,
    vision: Vision | None = None,
    visuals: list[VisualInput | None] | None = None,
) -> list[torch.Tensor]:
    """Per sequence, the float32 logprob of each target token (gradients flow if grad mode is on), in the
    target's shape: `(N,)`, or `(N, K)` for K target tokens a position (one log-softmax, K gathers).

    Sequences are right-padded: with causal attention, padding after a sequence cannot change it.
    `needs_grad` (a bool per position of each sequence) names the positions whose logprobs the loss can
    differentiate; the others' come from the same forward without a graph (see `_split_head`).
    `visuals`: each sequence's images (None: text), whose features `vision` computes with the active adapter.
    """
    width = max(len(t) for t in tokens)
    columns = max(t.shape[1] if t.ndim == 2 else 1 for t in targets)
    input_ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    target_ids = torch.zeros((len(tokens), width, columns), dtype=torch.long)
    attention_mask = torch.zeros((len(tokens), width), dtype=torch.bool)
    graded = torch.zeros((len(tokens), width), dtype=torch.bool)
    for row, (seq, tgt) in enumerate(zip(tokens, targets)):
        input_ids[row, : len(seq)] = torch.from_numpy(seq)
        target_ids[row, : len(tgt), : (tgt.shape[1] if tgt.ndim == 2 else 1)] = torch.from_numpy(
            tgt.reshape(len(tgt), -1)
        )
        attention_mask[row, : len(seq)] = True
        graded[row, : len(seq)] = torch.from_numpy(needs_grad[row]) if needs_grad is not None else True
    input_ids, target_ids, attention_mask = input_ids.to(device), target_ids.to(device), attention_mask.to(device)
    graded = graded.to(device)
    extra = _image_inputs(model, vision, visuals, [len(t) for t in tokens], width, device)
    if torch.is_grad_enabled() and graded.any() and not graded[attention_mask].all():
        logprobs = _split_logprobs(model, input_ids, attention_mask, target_ids, graded, extra)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False, **extra).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids)
    return [
        logprobs[row, : len(seq), : tgt.shape[1]] if tgt.ndim == 2 else logprobs[row, : len(seq), 0]
        for row, (seq, tgt) in enumerate(zip(tokens, targets))
    ]


def _image_inputs(
    model: nn.Module,
    vision: Vision | None,
    visuals: list[VisualInput | None] | None,
    lengths: list[int],
    width: int,
    device: torch.device,
) -> dict:
    """The forward's image features and, for M-RoPE, every row's positions (right-padded rows); {} for text."""
    if vision is None or visuals is None or not any(v is not None for v in visuals):
        return {}
    pictures = [p for v in visuals if v is not None for p in v.pictures]
    extra: dict = {"mm_encoder_outputs": vision.encode(model, pictures, device)}
    if any(v is not None and v.positions is not None for v in visuals):
        extra["position_ids"] = batch_positions(visuals, lengths, width, left=False).to(device)
    return extra


def _split_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, target_ids: Tensor, graded: Tensor, extra: dict
) -> Tensor:
    """`(B, T, K)` logprobs where only the `graded` positions carry a graph: the output projection, the
    log-softmax and their backward run at those positions alone with gradients, the rest without."""
    graded = graded & attention_mask
    ungraded = attention_mask & ~graded
    with _split_head(model.get_output_embeddings(), graded, ungraded):
        logits = model(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False, **extra).logits
    if logits.dim() == 3:  # a model whose forward does not call its output embeddings module: every position's
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids)
    count = int(graded.sum())
    with_grad = torch.log_softmax(logits[:count].float(), dim=-1).gather(-1, target_ids[graded])
    with torch.no_grad():
        without = torch.log_softmax(logits[count:].float(), dim=-1).gather(-1, target_ids[ungraded])
    shape = (*attention_mask.shape, target_ids.shape[-1])
    out = torch.zeros(shape, dtype=torch.float32, device=logits.device)
    return out.masked_scatter(graded[..., None], with_grad).masked_scatter(ungraded[..., None], without)


@contextmanager
def _split_head(head: nn.Module, graded: Tensor, ungraded: Tensor) -> Iterator[None]:
    """Within the block the model's output projection returns `(graded + ungraded positions, vocab)` logits: the
    graded positions' first, in the graph, then the others' computed without one. A model's own logit
    post-processing (soft-capping, scaling) still applies to both, since it runs on the projection's output.
    Half a GRPO datum's positions are its prompt's, whose advantage is 0: their share of the projection's
    backward (a vocabulary-wide matmul) and of the log-softmax's is work the loss's gradient never uses."""
    hidden: list[Tensor] = []

    def before(module: nn.Module, args: tuple) -> tuple:
        hidden.append(args[0])
        return (args[0][graded],)

    def after(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        with torch.no_grad():
            rest = module.forward(hidden.pop()[ungraded])
        return torch.cat([output, rest])

    handles = [head.register_forward_pre_hook(before), head.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
