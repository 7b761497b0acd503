"""The sampler/trainer logprob audit (treadle.gpu_worker.sampling.logprob_audit) on two model families in-process:
the gap is float noise on a correct sampler, and large once the sampler's logits are made wrong."""

from __future__ import annotations

import threading

import pytest
import torch

from treadle.gpu_worker.sampling import logprob_audit
from treadle.gpu_worker.sampling.hf import batch_decode
from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.scheduling.device_lock import DeviceLock
from treadle.gpu_worker.model.host import ModelHost
from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
from treadle.types import LoraConfig, SampledSequence
from tests.test_batch_sampling import PROMPTS, WAIT, job


@pytest.fixture(params=["tiny_model_dir", "tiny_qwen2_dir"])
def family_bank(request) -> AdapterBank:
    model_dir = request.getfixturevalue(request.param)
    bank = AdapterBank(ModelHost(model_dir))
    bank.add("one", bank.lora_config(LoraConfig(rank=4, alpha=8)), seed=0)
    with torch.no_grad():  # a B matrix that is not zero, so the adapter changes the logprobs
        for key, param in bank.parameters("one").items():
            if "lora_B" in key:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    return bank


def _audited_gaps(bank: AdapterBank, rows: int) -> list[float]:
    """Sample `rows` sequences (half on the adapter, half on the base model) with every one audited."""
    gaps, all_in = [], threading.Event()

    def observe(model: str, gap: float) -> None:
        gaps.append(gap)
        if len(gaps) == rows:
            all_in.set()

    logprob_audit.configure(fraction=1.0, observe=observe)
    scheduler = SampleScheduler(bank, bank.host, DeviceLock())
    try:
        futures = [
            scheduler.sample(
                job(bank, PROMPTS[i % len(PROMPTS)], adapter, num_samples=rows // 2, max_tokens=12, seed=i)
            )
            for i, adapter in enumerate(["one", None])
        ]
        for future in futures:
            future.result(timeout=WAIT)
        assert all_in.wait(WAIT), f"{len(gaps)} of {rows} audits came back"
    finally:
        logprob_audit.configure(fraction=0.0, observe=None)
        scheduler.close()
    return gaps


def test_the_gap_is_float_noise_on_a_correct_sampler_and_large_on_a_wrong_one(family_bank, monkeypatch):
    assert max(_audited_gaps(family_bank, rows=4)) < 1e-4
    # A sampler whose logits are off (as a wrong cache or mask would make them): every audited sequence shows it.
    original = batch_decode.forward_rows

    def skewed(bank, adapters, **inputs):
        out = original(bank, adapters, **inputs)
        out.logits = out.logits * 1.5
        return out

    monkeypatch.setattr(batch_decode, "forward_rows", skewed)
    assert min(_audited_gaps(family_bank, rows=4)) > 1e-2


def test_only_sequences_of_the_models_own_distribution_are_audited(family_bank):
    audit = logprob_audit.LogprobAudit(
        family_bank, family_bank.host, DeviceLock(), logprob_audit._Settings(fraction=1.0)
    )
    drawn = [SampledSequence(tokens=[7, 8], logprobs=[-1.0, -2.0], stop_reason="length")]
    for params in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}):
        tempered = job(family_bank, PROMPTS[0], "one", num_samples=1, max_tokens=4, seed=0, **params)
        tempered.sequences = drawn
        audit.consider(tempered)
    assert audit._pending.empty()
    own = job(family_bank, PROMPTS[0], "one", num_samples=1, max_tokens=4, seed=0)
    own.sequences = drawn
    audit.consider(own)
    assert audit._thread is not None  # its sequence was taken for an audit
