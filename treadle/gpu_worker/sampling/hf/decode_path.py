"""Which decode steps the hf sampler runs: static-shape (`slot_batch`) or dynamic (`batch_decode`), and the
deterministic mode's fixed bucket on the static path (the worker's `--sampler_decode` and
`--sampler_deterministic_rows`)."""

from __future__ import annotations

from typing import Literal

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.hf import row_invariant
from treadle.gpu_worker.sampling.hf.batch_decode import DecodeBatch
from treadle.gpu_worker.sampling.hf.prefix_cache import PrefixCache
from treadle.gpu_worker.sampling.hf.slot_batch import SlotBatch

DecodePath = Literal["auto", "static", "dynamic"]


def decode_batch(
    bank: AdapterBank,
    host: ModelHost,
    decode: DecodePath,
    static_decode: str,
    prefixes: PrefixCache | None = None,
    fixed: tuple[int, int] | None = None,
) -> DecodeBatch | SlotBatch:
    """The batch that runs the decode steps: static-shape (`slot_batch`) or dynamic (`batch_decode`). `auto` is
    static on CUDA where the model takes it (`static_decode` is "yes", else why not), dynamic otherwise: on a CPU the
    dynamic path, which attends over the rows' own lengths only, is the faster. `static` asked for a model that does
    not take it is refused, naming why. `prefixes`: the KV kept for prompts to resume from (None: none). `fixed`: the
    deterministic mode's bucket (`slot_batch.fixed_bucket`), on an accelerator the static path's alone (on a CPU
    every path is batch-invariant already)."""
    cuda, takes = host.device.type == "cuda", static_decode.startswith("yes")
    if decode == "static" and not takes:
        raise ValueError(f"sampler_decode static: {host.name} ({host.model_type}): {static_decode}")
    static = decode == "static" or (decode == "auto" and cuda and takes)
    if fixed is not None and not static and not row_invariant.invariant_layouts(host.device):
        raise ValueError(
            f"sampler_deterministic_rows: {host.name} ({host.model_type}) decodes on the dynamic path on "
            f"{host.device.type}, which is not batch-invariant there (sampler_decode {decode}; static: {static_decode})"
        )
    if static:
        return SlotBatch(bank, host, compile="graphs" if cuda else None, prefixes=prefixes, fixed=fixed)
    return DecodeBatch(bank, host, prefixes)
