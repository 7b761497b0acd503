"""Forwards whose rows use different LoRA adapters, adapter by adapter over runs of consecutive rows.

PEFT's own mixed-adapter batches (`adapter_names=[...]`) gather each adapter's rows with a Python list
of indices and scatter its delta back, in every LoRA layer: for 4 sessions of 8 rows on SmolLM2 that
indexing was 38 % of the time in PEFT's mixed-batch LoRA forward (py-spy), and with it a 4-session step
took 1.5-1.8x the time of the same rows under one adapter. The sampler keeps a request's rows next to each other, so an adapter's rows form a
few runs: here each LoRA layer runs its base layer on the whole batch (adapters disabled), and a
forward hook adds each run's delta on a slice, `out[a:b] += B(A(x[a:b])) * scaling`, with no gather
or scatter. That is the same arithmetic as PEFT's single-adapter forward (`result + B(A(x)) *
scaling`) on those rows, so a row's numbers do not depend on which adapters share its batch
(`row_invariant` pads every linear, so a run's row count does not matter either).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from peft.tuners.lora import Linear as LoraLinear

from treadle.gpu_worker.model.adapters import AdapterBank


def adapter_runs(adapters: list[str | None]) -> list[tuple[int, int, str]]:
    """(first row, end row, adapter) of each run of consecutive rows with the same adapter; base rows
    (None) need no delta and are left out."""
    runs: list[tuple[int, int, str]] = []
    for row, name in enumerate(adapters):
        if runs and runs[-1][2] == name and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1, name)
        elif name is not None:
            runs.append((row, row + 1, name))
    return runs


def plain_linear_adapters(bank: AdapterBank, adapters: set[str | None]) -> bool:
    """Whether every adapter named lives only in plain LoRA linears (no DoRA or other variant, no LoRA
    embedding): what `mixed_adapters` computes. A PEFT adapter loaded from a user's directory may not."""
    for layer in bank.lora_layers():
        if not isinstance(layer, LoraLinear):
            if any(name in layer.lora_embedding_A or name in layer.lora_A for name in adapters):
                return False
        elif any(name in layer.lora_variant for name in adapters):
            return False
    return True


@contextmanager
def mixed_adapters(bank: AdapterBank, adapters: list[str | None]) -> Iterator[torch.nn.Module]:
    """The model to call for a batch whose row i runs with adapter `adapters[i]` (None: base). Callers
    hold the device lock (the hooks sit on the shared model while the block runs) and disable grad."""
    runs = adapter_runs(adapters)

    def add_deltas(module: LoraLinear, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        for begin, end, name in runs:
            if name not in module.lora_A:  # this adapter does not target this layer
                continue
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            delta = lora_b(lora_a(module.lora_dropout[name](x[begin:end].to(lora_a.weight.dtype))))
            output[begin:end] += (delta * module.scaling[name]).to(output.dtype)
        return output

    handles = [layer.register_forward_hook(add_deltas) for layer in bank.lora_layers() if isinstance(layer, LoraLinear)]
    try:
        with bank.adapters_off():  # each layer runs its base layer alone; the hooks add the deltas
            yield bank.peft_model
    finally:
        for handle in handles:
            handle.remove()
