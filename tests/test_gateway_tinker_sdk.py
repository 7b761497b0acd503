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
TEXTS = [
    "the cat is red and the dog is blue",
    "one two three four five six",
    "hello world yes no please thanks",
    "sun moon tree river stone",
    "what is the answer to the question",
]
ADAM = dict(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def _pairs(tokenizer, texts):
    return [tokenizer.encode(t) for t in texts]


def _ce(cls, ids_list):
    """Cross-entropy datums (pre-shifted) built with either SDK's types."""
    return [
        cls.Datum(
            model_input=cls.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        for ids in ids_list
    ]


def _ppo(cls, ids_list, old_logprobs):
    return [
        cls.Datum(
            model_input=cls.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": ids[1:],
                "logprobs": [float(x) - 0.05 for x in lp],
                "advantages": [1.0 if i % 2 == 0 else -0.5] * (len(ids) - 1),
            },
        )
        for i, (ids, lp) in enumerate(zip(ids_list, old_logprobs))
    ]


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
    f_off, f_tr = (
        tc.forward_backward(_ppo(tt, ids, old), "ppo", ppo_config),
        rc.forward_backward(_ppo(rt, ids, old), "ppo", ppo_config),
    )
    tc.optim_step(tt.AdamParams(**ADAM)).result(), rc.optim_step(rt.AdamParams(**ADAM)).result()
    _assert_same_output(f_off.result(), f_tr.result())

    # a frozen sampler: same seeded tokens and logprobs as the treadle SDK's snapshot
    sampler = tc.save_weights_and_get_sampling_client().result()
    treadle_sampler = rc.save_weights_and_get_sampling_client()
    prompt = tokenizer.encode("the cat is")
    got = sampler.sample(
        tt.ModelInput.from_ints(prompt), 2, tt.SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    ).result()
    want = treadle_sampler.sample(
        rt.ModelInput.from_ints(prompt), 2, rt.SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    ).result()
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
    after = [
        client.forward(_ce(types_, ids), "cross_entropy").result()
        for client, types_ in ((tc, tt), (restored, tt), (treadle_restored, rt))
    ]
    _assert_same_output(after[1], after[0])  # Adam moments came back exactly, or this step would differ
    _assert_same_output(after[1], after[2])


def test_official_sdk_rank_0_is_a_full_fine_tuning_session(clients):
    official, treadle_sdk = clients
    tc = official.create_lora_training_client(base_model="tiny", rank=0).result()
    rc = treadle_sdk.create_full_training_client("tiny")
    info = tc.get_info()
    assert (info.is_lora, info.lora_rank) == (False, 0)
    ids = _pairs(tc.get_tokenizer(), TEXTS[:2])
    for client, types_ in ((tc, tt), (rc, rt)):
        client.forward_backward(_ce(types_, ids), "cross_entropy")
        client.optim_step(types_.AdamParams(**ADAM))
    _assert_same_output(
        tc.forward(_ce(tt, ids), "cross_entropy").result(), rc.forward(_ce(rt, ids), "cross_entropy").result()
    )
    got = tc.save_weights_and_get_sampling_client().result().compute_logprobs(tt.ModelInput.from_ints(ids[0]))
    want = rc.save_weights_and_get_sampling_client().compute_logprobs(rt.ModelInput.from_ints(ids[0]))
    np.testing.assert_allclose(got.result()[1:], want.result()[1:], rtol=1e-5, atol=1e-6)


def test_chunked_forward_backward_equals_one_batch(clients):
    """Five datums go as three concurrent requests (2+2+1, first chunk last); the worker runs them in seq order."""
    official, treadle_sdk = clients
    tc = official.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    rc = treadle_sdk.create_lora_training_client("tiny", rank=RANK, seed=SEED)
    ids = _pairs(tc.get_tokenizer(), TEXTS)
    chunked, whole = (
        tc.forward_backward(_ce(tt, ids), "cross_entropy").result(),
        rc.forward_backward(_ce(rt, ids), "cross_entropy").result(),
    )
    assert len(chunked.loss_fn_outputs) == 5
    _assert_same_output(chunked, whole)
    tc.optim_step(tt.AdamParams(**ADAM)).result(), rc.optim_step(rt.AdamParams(**ADAM)).result()
    _assert_same_output(
        tc.forward(_ce(tt, ids), "cross_entropy").result(), rc.forward(_ce(rt, ids), "cross_entropy").result()
    )


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


def _sampler_and_prompt(official):
    """A trained adapter's sampler (so the LoRA delta is in every number) and a prompt of its tokenizer."""
    tc = official.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    tokenizer = tc.get_tokenizer()
    tc.forward_backward(_ce(tt, _pairs(tokenizer, TEXTS[:2])), "cross_entropy")
    tc.optim_step(tt.AdamParams(learning_rate=2e-2)).result()
    return tc, tc.save_weights_and_get_sampling_client().result(), tokenizer.encode("the cat is red and the dog is")


def test_official_sdk_target_prompt_logprobs_equal_compute_logprobs_and_the_forward(clients):
    official, _ = clients
    tc, sampler, prompt = _sampler_and_prompt(official)
    n, once = len(prompt), tt.SamplingParams(max_tokens=1, seed=0)
    ids = torch.full((n - 1, 3), -1, dtype=torch.int64)
    ids[:, 0] = torch.tensor(prompt[1:])  # row i scores prompt position i + 1: its own token there
    ids[-1, 1:] = torch.tensor(prompt[:2])
    dense = sampler.sample(
        tt.ModelInput.from_ints(prompt), 1, once, target_prompt_logprobs=tt.TensorData.from_torch(ids)
    ).result()
    scored = dense.target_prompt_logprobs.to_numpy()
    assert dense.target_prompt_logprobs.dtype == "float32" and scored.shape == (n - 1, 3)
    own = sampler.compute_logprobs(tt.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(scored[:, 0], own[1:], atol=1e-4)
    forward = _logprobs(tc.forward(_ce(tt, [prompt]), "cross_entropy").result())[0]
    np.testing.assert_allclose(scored[:, 0], forward, atol=1e-4)
    assert (scored[ids.numpy() < 0] == 0.0).all()
    # Sparse, as the cookbook's decisions recipe sends it: the answer lists the same cells.
    sparse_ids = torch.full((n - 1, 3), -1, dtype=torch.int64)
    sparse_ids[-1] = ids[-1]
    sparse = sampler.sample(
        tt.ModelInput.from_ints(prompt),
        1,
        once,
        target_prompt_logprobs=tt.TensorData.from_torch_sparse(sparse_ids, pad_value=-1),
    ).result()
    got = sparse.target_prompt_logprobs
    assert got.sparse_crow_indices is not None and got.shape == [n - 1, 3]
    np.testing.assert_allclose(got.to_numpy()[-1], scored[-1], atol=1e-6)
    assert (got.to_numpy()[:-1] == 0.0).all()
    with pytest.raises(
        Exception, match=r"target_prompt_logprobs: int64 of shape \[3, 1\]; must be int64 \[len\(prompt\) - 1 = "
    ):
        sampler.sample(
            tt.ModelInput.from_ints(prompt),
            1,
            once,
            target_prompt_logprobs=tt.TensorData.from_torch(torch.zeros((3, 1), dtype=torch.int64)),
        ).result()


def test_official_sdk_topk_sample_logprobs_and_prompt_alt_tokens(clients):
    official, _ = clients
    _, sampler, prompt = _sampler_and_prompt(official)
    n, k = len(prompt), 4
    params = tt.SamplingParams(max_tokens=5, seed=9, temperature=1.0)

    def ask():
        return sampler.sample(tt.ModelInput.from_ints(prompt), 2, params, topk_sample_logprobs=k, prompt_alt_tokens_k=3)

    alone = ask().result()
    for seq in alone.sequences:  # T=1: the distribution sampled from is the model's, the top-k of the prompt's logprobs
        full = tt.ModelInput.from_ints(prompt + seq.tokens)
        ref = sampler.sample(
            full, 1, tt.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=k
        ).result()
        assert len(seq.topk_logprobs) == len(seq.tokens) and all(len(row) == k for row in seq.topk_logprobs)
        for t, row in enumerate(seq.topk_logprobs):
            want = ref.topk_prompt_logprobs[n + t]
            assert [tok for tok, _ in row] == [tok for tok, _ in want]
            np.testing.assert_allclose([lp for _, lp in row], [lp for _, lp in want], atol=1e-4)
            assert seq.logprobs[t] == pytest.approx(ref.prompt_logprobs[n + t], abs=1e-4)
    drawn = alone.prompt_alt_tokens.tokens.to_numpy()
    drawn_lp = alone.prompt_alt_tokens.logprobs.to_numpy()
    assert drawn.shape == drawn_lp.shape == (n - 1, 3)
    # Each draw's logprob is the one target_prompt_logprobs gives that id at that position.
    scored = sampler.sample(
        tt.ModelInput.from_ints(prompt),
        1,
        tt.SamplingParams(max_tokens=1),
        target_prompt_logprobs=tt.TensorData.from_numpy(drawn),
    ).result()
    np.testing.assert_allclose(drawn_lp, scored.target_prompt_logprobs.to_numpy(), atol=1e-5)
    # Submitted alongside other requests (so they may share the prefill and decode steps): the same answer.
    others = [
        sampler.sample(tt.ModelInput.from_ints(prompt[: 3 + i]), 2, tt.SamplingParams(max_tokens=8, seed=i))
        for i in range(3)
    ]
    together = ask().result()
    [f.result() for f in others]
    assert [s.tokens for s in together.sequences] == [s.tokens for s in alone.sequences]
    for a, b in zip(alone.sequences, together.sequences):
        np.testing.assert_allclose(np.array(b.topk_logprobs)[..., 1], np.array(a.topk_logprobs)[..., 1], atol=1e-6)
    assert (together.prompt_alt_tokens.tokens.to_numpy() == drawn).all()
    with pytest.raises(Exception, match=r"topk_sample_logprobs: .*less than or equal to 20 \(got 21\)"):
        sampler.sample(tt.ModelInput.from_ints(prompt), 1, params, topk_sample_logprobs=21).result()


def test_official_sdk_stability_info_sampler_gives_distinct_sequence_ids(clients):
    official, _ = clients
    tc, _, prompt = _sampler_and_prompt(official)
    path = tc.save_weights_for_sampler("stability").result().path
    sampler = official.create_sampling_client(model_path=path, record_stability_info=True)
    first = sampler.sample(tt.ModelInput.from_ints(prompt), 3, tt.SamplingParams(max_tokens=3, seed=1)).result()
    second = sampler.sample(tt.ModelInput.from_ints(prompt), 2, tt.SamplingParams(max_tokens=3, seed=2)).result()
    ids = [s.sequence_id for s in [*first.sequences, *second.sequences]]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)


def _neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def test_official_sdk_custom_loss_handle_runs_client_side(clients):
    """create_custom_loss traces the loss; the gateway's session says custom_loss_server_side: false, so the
    handle stays client-side, and forward_backward_custom with it equals cross_entropy on the same batch."""
    official, _ = clients
    tc = official.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    data = _ce(tt, _pairs(tc.get_tokenizer(), TEXTS[:2]))
    handle = official.create_custom_loss(_neg_ll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is None
    got = tc.forward_backward_custom(data, handle).result()
    want = tc.forward(data, "cross_entropy").result()
    assert got.metrics["custom/neg_ll:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
