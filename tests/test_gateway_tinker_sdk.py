"""Acceptance: the official `tinker` SDK, configured only by TINKER_BASE_URL and TINKER_API_KEY, runs a
training loop against the gateway, and its numbers equal the treadle SDK's for the same inputs.

Both clients drive the same worker on the tiny model with the same LoRA seed, so every logprob, loss,
sample and checkpoint must agree. Batches of <= 2 datums are sent unchunked (the gateway fixture sets
2 datums a chunk), so the two paths run identical ops; the chunked path is checked on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types as tt

from treadle import types as rt
from treadle.gateway.paths import to_treadle

RANK, SEED = 8, 11
TEXTS = ["the cat is red and the dog is blue", "one two three four five six", "hello world yes no please thanks",
         "sun moon tree river stone", "what is the answer to the question"]
ADAM = dict(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def _pairs(tokenizer, texts):
    return [tokenizer.encode(t) for t in texts]


def _ce(cls, ids_list):
    """Cross-entropy datums (pre-shifted) built with either SDK's types."""
    return [cls.Datum(model_input=cls.ModelInput.from_ints(ids[:-1]),
                      loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}) for ids in ids_list]


def _ppo(cls, ids_list, old_logprobs):
    return [cls.Datum(model_input=cls.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ids[1:], "logprobs": [float(x) - 0.05 for x in lp],
        "advantages": [1.0 if i % 2 == 0 else -0.5] * (len(ids) - 1),
    }) for i, (ids, lp) in enumerate(zip(ids_list, old_logprobs))]


def _logprobs(out):
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float32) for o in out.loss_fn_outputs]


def _assert_same_output(official, treadle_out):
    assert official.metrics["loss:sum"] == pytest.approx(treadle_out.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    for a, b in zip(_logprobs(official), _logprobs(treadle_out), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture()
def clients(tinker_env, service_client):
    official = tinker.ServiceClient()
    yield official, service_client
    official.close("success")


def test_official_sdk_training_loop_equals_treadle_sdk(clients):
    official, treadle_sdk = clients
    tc = official.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    rc = treadle_sdk.create_lora_training_client("tiny", rank=RANK, seed=SEED)
    assert tc.model_id.startswith(tc.holder.get_session_id() + ":train:")
    tokenizer = tc.get_tokenizer()
    ids = _pairs(tokenizer, TEXTS[:2])

    # cross_entropy, then optim_step, submitted before the first result is read
    f_off, o_off = tc.forward_backward(_ce(tt, ids), "cross_entropy"), tc.optim_step(tt.AdamParams(**ADAM))
    f_tr, o_tr = rc.forward_backward(_ce(rt, ids), "cross_entropy"), rc.optim_step(rt.AdamParams(**ADAM))
    first_off, first_tr = f_off.result(), f_tr.result()
    _assert_same_output(first_off, first_tr)
    assert o_off.result().metrics == pytest.approx(o_tr.result().metrics)

    # ppo on the logprobs the first step returned
    old = _logprobs(first_off)
    ppo_config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    f_off, f_tr = tc.forward_backward(_ppo(tt, ids, old), "ppo", ppo_config), rc.forward_backward(_ppo(rt, ids, old), "ppo", ppo_config)
    tc.optim_step(tt.AdamParams(**ADAM)).result(), rc.optim_step(rt.AdamParams(**ADAM)).result()
    _assert_same_output(f_off.result(), f_tr.result())

    # a frozen sampler: same seeded tokens and logprobs as the treadle SDK's snapshot
    sampler = tc.save_weights_and_get_sampling_client().result()
    treadle_sampler = rc.save_weights_and_get_sampling_client()
    prompt = tokenizer.encode("the cat is")
    got = sampler.sample(tt.ModelInput.from_ints(prompt), 2, tt.SamplingParams(max_tokens=6, seed=5, temperature=1.0)).result()
    want = treadle_sampler.sample(rt.ModelInput.from_ints(prompt), 2, rt.SamplingParams(max_tokens=6, seed=5, temperature=1.0)).result()
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    for g, w in zip(got.sequences, want.sequences):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-6)
        assert g.stop_reason == w.stop_reason == "length"
    assert all(s.sequence_id for s in got.sequences)  # the SDK stamped the ids the gateway promised

    lp_got = sampler.compute_logprobs(tt.ModelInput.from_ints(ids[0])).result()
    lp_want = treadle_sampler.compute_logprobs(rt.ModelInput.from_ints(ids[0])).result()
    assert lp_got[0] is None and lp_want[0] is None
    np.testing.assert_allclose(lp_got[1:], lp_want[1:], rtol=1e-5, atol=1e-6)

    # save_state -> a new training client with the optimizer -> more steps equal the original's
    saved = tc.save_state("two-steps").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/two-steps"
    restored = official.create_training_client_from_state_with_optimizer(saved.path).result()
    assert restored.model_id != tc.model_id
    treadle_restored = treadle_sdk.create_training_client_from_state_with_optimizer(to_treadle(saved.path))
    for client, types_ in ((tc, tt), (restored, tt), (treadle_restored, rt)):
        client.forward_backward(_ce(types_, ids), "cross_entropy")
        client.optim_step(types_.AdamParams(**ADAM))
    after = [client.forward(_ce(types_, ids), "cross_entropy").result()
             for client, types_ in ((tc, tt), (restored, tt), (treadle_restored, rt))]
    _assert_same_output(after[1], after[0])  # Adam moments came back exactly, or this step would differ
    _assert_same_output(after[1], after[2])


def test_chunked_forward_backward_equals_one_batch(clients):
    """Five datums go as three concurrent requests (2+2+1, first chunk last); the worker runs them in seq order."""
    official, treadle_sdk = clients
    tc = official.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    rc = treadle_sdk.create_lora_training_client("tiny", rank=RANK, seed=SEED)
    ids = _pairs(tc.get_tokenizer(), TEXTS)
    chunked, whole = tc.forward_backward(_ce(tt, ids), "cross_entropy").result(), rc.forward_backward(_ce(rt, ids), "cross_entropy").result()
    assert len(chunked.loss_fn_outputs) == 5
    _assert_same_output(chunked, whole)
    tc.optim_step(tt.AdamParams(**ADAM)).result(), rc.optim_step(rt.AdamParams(**ADAM)).result()
    _assert_same_output(tc.forward(_ce(tt, ids), "cross_entropy").result(), rc.forward(_ce(rt, ids), "cross_entropy").result())


def _dpo_loss(data, logprobs, beta=0.5):
    """DPO against a zero reference: pairs are (chosen, rejected) in order."""
    seq = torch.stack([lp.sum() for lp in logprobs])
    margin = beta * (seq[0::2] - seq[1::2])
    loss = -torch.nn.functional.logsigmoid(margin).sum()
    return loss, {"margin:mean": float(margin.mean().detach())}


def test_forward_backward_custom_dpo(clients):
    official, treadle_sdk = clients
    tc = official.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    rc = treadle_sdk.create_lora_training_client("tiny", rank=RANK, seed=SEED)
    ids = _pairs(tc.get_tokenizer(), ["the answer is yes", "the answer is no"])
    got = tc.forward_backward_custom(_ce(tt, ids), _dpo_loss).result()
    want = rc.forward_backward_custom(_ce(rt, ids), _dpo_loss).result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["margin:mean"] == pytest.approx(want.metrics["margin:mean"], rel=1e-5, abs=1e-7)
    for _ in range(3):
        tc.optim_step(tt.AdamParams(learning_rate=2e-2)).result()
        tc.forward_backward_custom(_ce(tt, ids), _dpo_loss).result()
    later = tc.forward_backward_custom(_ce(tt, ids), _dpo_loss).result()
    assert later.metrics["margin:mean"] > got.metrics["margin:mean"] + 0.05  # the preference was learned
