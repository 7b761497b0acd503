"""Teacher-forced logprobs of target tokens, and the token budget that splits a batch into micro-batches.

One padded forward pass over a group of sequences gives `log p(target_t | tokens_<=t)` for every
position. Large batches are cut into micro-batches whose padded size fits a token budget, so batch
size never decides whether a step fits in memory; since every loss is a sum over tokens, running
the micro-batches one after another and accumulating gradients gives the same result.

Memory of one long micro-batch (docs/scaling.md, "Long sequences"): the logits are never materialised for the
whole micro-batch: the decoder runs without its output projection, and the projection, log-softmax and gather
run over chunks of positions (`HeadLogprobs`), checkpointed so that their backward recomputes one chunk at a
time. Every loss is a function of these per-token logprobs, so every loss gets this, unchanged. The decoder
layers' activations can be checkpointed too (`checkpointed_layers`), trading a second forward of each layer
in the backward pass for keeping only each layer's input.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Literal, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from treadle.gpu_worker.model.host import (
    MicrobatchMemory,
    ModelHost,
    chunk_tokens,
    microbatch_budget,
    microbatch_memory,
)
from treadle.gpu_worker.model.lora_targets import decoder_layers
from treadle.gpu_worker.model.vision import Vision, VisualInput, batch_positions

Checkpointing = Literal["auto", "on", "off"]


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


@dataclass
class MemoryPlan:
    """How the micro-batches of a model hold their memory: their token budget, which of them checkpoint their
    decoder layers, and how many positions of logits are computed at once (docs/scaling.md, "Long sequences")."""

    budget: int  # tokens of one micro-batch (`micro_batches`)
    memory: MicrobatchMemory  # what a micro-batch takes, with and without checkpointing, and the room it has
    layers: Sequence[nn.Module]  # the model's decoder layers
    checkpointing: Checkpointing  # on: every micro-batch with gradients; auto: those that would not fit without
    chunk: int  # positions the output projection computes at once (`chunk_tokens`)

    @classmethod
    def of(cls, host: ModelHost, budget: int | None, checkpointing: Checkpointing) -> "MemoryPlan":
        """The plan of `host`'s model; `budget` None: sized to the device (`microbatch_budget`)."""
        memory = microbatch_memory(host.model, host.dtype, host.device_memory, budget)
        budget = budget or microbatch_budget(memory, host.device_memory)
        return cls(budget, memory, decoder_layers(host.model), checkpointing, chunk_tokens(host.vocab_size))

    def checkpointed(self, tokens: int) -> Sequence[nn.Module]:
        """The layers a micro-batch of `tokens` (padded) checkpoints when it computes gradients."""
        if self.checkpointing == "auto":
            return () if self.memory.fits(tokens) else self.layers
        return self.layers if self.checkpointing == "on" else ()


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
    plan: MemoryPlan | None = None,
) -> list[torch.Tensor]:
    """Per sequence, the float32 logprob of each target token (gradients flow if grad mode is on), in the
    target's shape: `(N,)`, or `(N, K)` for K target tokens a position (one log-softmax, K gathers).

    Sequences are right-padded: with causal attention, padding after a sequence cannot change it.
    `needs_grad` (a bool per position of each sequence) names the positions whose logprobs the loss can
    differentiate; the others' come from the same hidden states without a graph. `plan` (default: chunks of
    `chunk_tokens` of the model's vocabulary, no checkpointing) says how many positions of logits are computed at
    once and whether the decoder layers are checkpointed (`checkpointed_layers`) with gradients.
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
    graded &= attention_mask & torch.is_grad_enabled()
    if torch.is_grad_enabled() and not graded.any():
        graded = attention_mask  # no position can have a gradient: a graph anyway, so the backward leaves zeros
    ungraded = attention_mask & ~graded
    input_ids, target_ids = input_ids.to(device), target_ids.to(device)
    extra = _image_inputs(model, vision, visuals, input_ids, [len(t) for t in tokens], device)
    checkpointed = plan.checkpointed(input_ids.numel()) if plan and torch.is_grad_enabled() else ()
    with checkpointed_layers(checkpointed):
        hidden = final_hidden(model, input_ids, attention_mask.to(device), extra)
    head = HeadLogprobs(model, plan.chunk if plan else chunk_tokens(model.get_input_embeddings().num_embeddings))
    out = torch.zeros((*attention_mask.shape, columns), dtype=torch.float32, device=device)
    # Graded positions first, in the graph; the rest from the same hidden states without one. Half a GRPO datum's
    # positions are its prompt's, whose advantage is 0: their share of the projection's backward (a
    # vocabulary-wide matmul) and of the log-softmax's is work the loss's gradient never uses.
    for mask, grad in ((graded, True), (ungraded, False)):
        if mask.any():
            mask = mask.to(device)
            with torch.set_grad_enabled(grad):
                values = head(hidden[mask], target_ids[mask])
            out = out.masked_scatter(mask[..., None], values)
    return [
        out[row, : len(seq), : tgt.shape[1]] if tgt.ndim == 2 else out[row, : len(seq), 0]
        for row, (seq, tgt) in enumerate(zip(tokens, targets))
    ]


def _image_inputs(
    model: nn.Module,
    vision: Vision | None,
    visuals: list[VisualInput | None] | None,
    input_ids: Tensor,
    lengths: list[int],
    device: torch.device,
) -> dict:
    """The forward's image features and, for M-RoPE, every row's positions (right-padded rows); for a model whose
    image tokens attend both ways within an image, which tokens are the images' (`token_type_ids`, from which
    transformers' forward builds that mask); {} for text."""
    if vision is None or visuals is None or not any(v is not None for v in visuals):
        return {}
    pictures = [p for v in visuals if v is not None for p in v.pictures]
    extra: dict = {"mm_encoder_outputs": vision.encode(model, pictures, device)}
    if any(v is not None and v.positions is not None for v in visuals):
        extra["position_ids"] = batch_positions(visuals, lengths, input_ids.shape[1], left=False).to(device)
    if vision.bidirectional:
        extra["token_type_ids"] = (input_ids == vision.image_token_id).long()
    return extra


def final_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, extra: dict) -> Tensor:
    """`(B, T, hidden)`: what the model's output projection receives, from a forward that skips the projection
    (within it the projection returns `(B, T, 0)` logits, so the model's logit post-processing has nothing to do).
    `extra`: more of the forward's arguments (`_image_inputs`).
    """
    head = model.get_output_embeddings()
    own = head.__dict__.get("forward")  # an instance's own forward (a hook library's), put back afterwards
    captured: list[Tensor] = []

    def skip(hidden: Tensor) -> Tensor:
        captured.append(hidden)
        return hidden[..., :0]

    head.forward = skip
    try:
        model(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False, **extra)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    return captured[0]


class HeadLogprobs:
    """Logprobs of target tokens from final hidden states, `chunk` positions at a time: the output projection,
    the model's own elementwise post-processing of its logits (`logit_transform`), a float32 log-softmax and
    the targets' gather. With gradients and more than one chunk, each chunk is checkpointed: its forward keeps
    only its `(chunk, K)` logprobs, and its backward computes its logits again. At most one chunk's logits exist
    at a time, forward or backward, so memory is bounded by `chunk` whatever the micro-batch's length."""

    def __init__(self, model: nn.Module, chunk: int):
        # A full session's model (`full_weights.SwappedModel`) projects with the session's own weights.
        own = getattr(model, "output_projection", None)
        self.head = own() if own is not None else model.get_output_embeddings()
        self.transform = logit_transform(model.config)
        self.chunk = chunk

    def __call__(self, hidden: Tensor, target_ids: Tensor) -> Tensor:
        """`(N, K)` float32 logprobs of `target_ids` (N, K) given `hidden` (N, hidden size)."""
        count = hidden.shape[0]
        if count <= self.chunk:
            return self._logprobs(hidden, target_ids)
        recompute = torch.is_grad_enabled()
        parts = []
        for start in range(0, count, self.chunk):
            args = (hidden[start : start + self.chunk], target_ids[start : start + self.chunk])
            parts.append(
                checkpoint(self._logprobs, *args, use_reentrant=False, preserve_rng_state=False)
                if recompute
                else self._logprobs(*args)
            )
        return torch.cat(parts)

    def _logprobs(self, hidden: Tensor, target_ids: Tensor) -> Tensor:
        logits = self.transform(self.head(hidden))
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids)


def logit_transform(config: PretrainedConfig) -> Callable[[Tensor], Tensor]:
    """What a model's forward does to its output projection's result, in the same operations: Granite divides by
    `logits_scaling`, Falcon-H1 multiplies by `lm_head_multiplier`, Gemma soft-caps with `final_logit_softcapping`;
    the other families take the projection as it is. Read from the model's top-level config, where those forwards
    read it (a multimodal Gemma 3 keeps the cap in its text config and does not apply it)."""
    scaling = getattr(config, "logits_scaling", None)
    multiplier = getattr(config, "lm_head_multiplier", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if scaling is not None:
        return lambda logits: logits / scaling
    if multiplier is not None:
        return lambda logits: logits * multiplier
    if cap is not None:
        return lambda logits: torch.tanh(logits / cap) * cap
    return lambda logits: logits


@contextmanager
def checkpointed_layers(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block each of `layers` runs under non-reentrant activation checkpointing (with gradients on):
    its forward keeps only its inputs, and the backward pass runs it again to get what its own backward needs.
    The layer's forward is wrapped inside the module, so the module's hooks (PEFT's, FSDP2's unshard and reshard
    around each layer) stay outside the checkpointed region, the placement torch's `checkpoint_wrapper` gives
    under `fully_shard`; its parameters, names and state dict do not change. The recomputation is bitwise the
    first computation (no dropout: the model is in eval mode), so the gradients are those of a run without it.
    """
    owns = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, own in zip(layers, owns):
            if own is None:
                del layer.forward
            else:
                layer.forward = own
