"""cross_entropy with `[N, K]` target_tokens and weights (top-k soft targets, as the cookbook's SDFT sends).

The loss is the weighted sum over the K targets of every position. On the engine (tiny model, fp32) its
value and its gradient are checked against a direct torch computation on the same adapter, K = 1 against
the 1-D loss, and micro-batches and mixed batches against one whole batch. Through the gateway the
official SDK's `[N, K]` tensors (sparse CSR on the wire) reach the loss and `[N, K]` logprobs come back.
A cross_entropy datum without weights is refused (docs/gateway.md says why).
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY
from treadle.errors import InvalidRequestError
from treadle.gpu_worker.engine import Engine
from treadle.types import AdamParams, Datum, LoraConfig, ModelInput, TensorData

LORA = LoraConfig(rank=4, alpha=8, seed=0)
K = 3


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    engine = Engine(tiny_model_dir)
    assert engine._host.model.dtype == torch.float32
    return engine


def _topk_data(
    vocab: int, lengths=(9, 14), k: int = K, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(tokens, [N, k] targets, [N, k] weights) per datum: a renormalised "teacher" top-k at every position but
    the first, whose weights are 0 (a prompt token), and one position with a padded slot (weight 0)."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        tokens = rng.integers(3, vocab, size=n)
        targets = np.stack([rng.choice(np.arange(3, vocab), size=k, replace=False) for _ in range(n)])
        weights = rng.dirichlet(np.ones(k), size=n).astype(np.float32)
        weights[0] = 0.0
        if k > 1:
            weights[1, -1] = 0.0
        rows.append((tokens, targets, weights))
    return rows


def _datum(tokens: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens.tolist()),
        loss_fn_inputs={"target_tokens": TensorData.from_numpy(targets), "weights": TensorData.from_numpy(weights)},
    )


def _grads(engine: Engine, session_id: str) -> dict[str, torch.Tensor]:
    grads = engine._sessions[session_id].optimizer.grad_tensors()
    engine._sessions[session_id].optimizer.zero_grad()
    return grads


def _trained_session(engine: Engine, session_id: str) -> None:
    """A session whose LoRA B is no longer zero (one step on 1-D data), so both A and B get gradients."""
    engine.create_session(session_id, LORA)
    ids = list(range(5, 20))
    one = Datum(
        model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 14}
    )
    engine.forward_backward(session_id, [one], "cross_entropy")
    engine.optim_step(session_id, AdamParams(learning_rate=1e-2))


def test_loss_and_gradient_equal_a_direct_computation(engine):
    _trained_session(engine, "direct")
    rows = _topk_data(engine.vocab_size)
    out = engine.forward_backward("direct", [_datum(*r) for r in rows], "cross_entropy")
    served = _grads(engine, "direct")

    # The same loss written directly: one forward per datum through the session's adapter.
    session = engine._sessions["direct"]
    total = torch.zeros(())
    with engine._bank.using(session.adapter, trainable=True) as model:
        for (tokens, targets, weights), o in zip(rows, out.loss_fn_outputs):
            logits = model(input_ids=torch.from_numpy(tokens)[None]).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.from_numpy(targets))
            assert o["logprobs"].shape == list(targets.shape)
            assert np.abs(o["logprobs"].to_numpy() - lp.detach().numpy()).max() < 1e-5
            total = total - (lp * torch.from_numpy(weights)).sum()
    total.backward()
    direct = _grads(engine, "direct")

    # Relative: the loss is ~130 nats, where float32 values lie 1.5e-5 apart.
    assert out.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5)
    assert served.keys() == direct.keys() and served
    assert max((served[k] - direct[k]).abs().max().item() for k in served) < 1e-5
    assert any(direct[k].abs().max().item() > 1e-3 for k in direct if "lora_A" in k)  # A and B both trained
    assert any(direct[k].abs().max().item() > 1e-3 for k in direct if "lora_B" in k)
    engine.drop_session("direct")


def test_k_equal_one_is_the_1d_loss_exactly(engine):
    _trained_session(engine, "k1")
    rows = _topk_data(engine.vocab_size, k=1)
    flat = [
        Datum(
            model_input=ModelInput.from_ints(t.tolist()),
            loss_fn_inputs={"target_tokens": tg[:, 0].tolist(), "weights": w[:, 0].tolist()},
        )
        for t, tg, w in rows
    ]
    one_d = engine.forward_backward("k1", flat, "cross_entropy")
    grads_1d = _grads(engine, "k1")
    columns = engine.forward_backward("k1", [_datum(*r) for r in rows], "cross_entropy")
    grads_k1 = _grads(engine, "k1")
    assert columns.metrics["loss:sum"] == one_d.metrics["loss:sum"]
    for a, b in zip(columns.loss_fn_outputs, one_d.loss_fn_outputs):
        assert np.array_equal(a["logprobs"].to_numpy()[:, 0], b["logprobs"].to_numpy())
    assert all(torch.equal(grads_k1[k], grads_1d[k]) for k in grads_1d)
    engine.drop_session("k1")


def test_micro_batches_and_mixed_batches_equal_one_whole_batch(engine):
    _trained_session(engine, "mixed")
    rows = _topk_data(engine.vocab_size, lengths=(9, 14, 11))
    ids = list(range(30, 42))
    plain = Datum(
        model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [0.5] * 11}
    )
    data = [_datum(*rows[0]), plain, _datum(*rows[1]), _datum(*rows[2])]

    whole = engine.forward_backward("mixed", data, "cross_entropy")
    grads_whole = _grads(engine, "mixed")
    engine.max_tokens_per_microbatch = 16  # each datum is 9-14 tokens: one datum per micro-batch
    try:
        split = engine.forward_backward("mixed", data, "cross_entropy")
    finally:
        engine.max_tokens_per_microbatch = 4096
    grads_split = _grads(engine, "mixed")
    one_by_one = [engine.forward_backward("mixed", [d], "cross_entropy") for d in data]
    grads_one_by_one = _grads(engine, "mixed")

    assert split.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-6)  # ~220 nats, float32
    assert sum(o.metrics["loss:sum"] for o in one_by_one) == pytest.approx(whole.metrics["loss:sum"], rel=1e-6)
    for grads in (grads_split, grads_one_by_one):
        assert max((grads[k] - grads_whole[k]).abs().max().item() for k in grads_whole) < 1e-5
    shapes = [o["logprobs"].shape for o in whole.loss_fn_outputs]
    assert shapes == [[9, K], [11], [14, K], [11, K]]
    for a, b in zip(whole.loss_fn_outputs, split.loss_fn_outputs):
        assert np.allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    engine.drop_session("mixed")


@pytest.mark.parametrize(
    "loss_fn,inputs,expected",
    [
        (
            "cross_entropy",
            {"target_tokens": np.ones((4, 2), np.int64), "weights": np.ones((4, 3), np.float32)},
            "weights: shape [4, 3] != target_tokens shape [4, 2]",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.ones((5, 2), np.int64), "weights": np.ones((5, 2), np.float32)},
            "target_tokens: length 5 != model_input length 4",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.ones((4, 0), np.int64), "weights": np.ones((4, 0), np.float32)},
            "target_tokens: shape [4, 0]; K must be at least 1",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.full((4, 2), 10**6, np.int64), "weights": np.ones((4, 2), np.float32)},
            "target_tokens[0][0]: token id 1000000 outside vocabulary",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.ones(4, np.int64)},
            "weights: missing; cross_entropy needs target_tokens, weights",
        ),
        (
            "importance_sampling",
            {
                "target_tokens": np.ones((4, 2), np.int64),
                "logprobs": np.zeros(4, np.float32),
                "advantages": np.zeros(4, np.float32),
            },
            "target_tokens: shape [4, 2]; [N, K] inputs are taken by cross_entropy's target_tokens and weights only",
        ),
    ],
)
def test_bad_shapes_are_refused_by_field(engine, loss_fn, inputs, expected):
    engine.create_session("bad", LORA)
    try:
        datum = Datum(
            model_input=ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={k: TensorData.from_numpy(v) for k, v in inputs.items()},
        )
        with pytest.raises(InvalidRequestError) as err:
            engine.forward_backward("bad", [datum], loss_fn)
        assert f"data[0].loss_fn_inputs.{expected}" in str(err.value)
    finally:
        engine.drop_session("bad")


# ---------------------------------------------------------------- through the gateway, official SDK


@pytest.fixture(scope="module")
def official(gateway):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_BASE_URL", gateway.url)
        mp.setenv("TINKER_API_KEY", ALICE_KEY)
        service = tinker.ServiceClient()
        yield service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        service.close("success")


def test_sdk_topk_datums_reach_the_loss(official):
    tc = official
    vocab = tc.get_tokenizer().vocab_size
    rows = _topk_data(vocab, lengths=(8, 12))
    topk = [
        tt.Datum(
            model_input=tt.ModelInput.from_ints(t.tolist()),
            loss_fn_inputs={"target_tokens": torch.from_numpy(tg), "weights": torch.from_numpy(w)},
        )
        for t, tg, w in rows
    ]
    # Each of the K columns as a 1-D datum: their losses add up to the [N, K] loss.
    columns = [
        tt.Datum(
            model_input=tt.ModelInput.from_ints(t.tolist()),
            loss_fn_inputs={"target_tokens": tg[:, j].tolist(), "weights": w[:, j].tolist()},
        )
        for t, tg, w in rows
        for j in range(K)
    ]
    out = tc.forward(topk, "cross_entropy").result()
    by_column = tc.forward(columns, "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(by_column.metrics["loss:sum"], abs=1e-4)
    for i, (o, (_, targets, _)) in enumerate(zip(out.loss_fn_outputs, rows)):
        lp = o["logprobs"].to_numpy()
        assert lp.shape == targets.shape
        for j in range(K):
            assert np.allclose(lp[:, j], by_column.loss_fn_outputs[i * K + j]["logprobs"].to_numpy(), atol=1e-5)

    # forward_backward_custom (the SDFT reverse-KL path) hands the loss [N, K] logprobs and sends [N, K] weights back.
    def mass_on_top(data, logprobs_list):
        assert [tuple(lp.shape) for lp in logprobs_list] == [tg.shape for _, tg, _ in rows]
        loss = sum(-(lp.exp() * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
        return loss, {}

    tc.forward_backward_custom(topk, mass_on_top).result()
    assert tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result() is not None


def test_cross_entropy_without_weights_is_refused(official):
    ids = list(range(5, 14))
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    with pytest.raises(Exception) as err:
        official.forward([datum], "cross_entropy").result()
    assert "data[0].loss_fn_inputs.weights: missing" in str(err.value)
