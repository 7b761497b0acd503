"""DPO and KTO: the losses checked by hand on fixed logprobs, the data generators, and smoke runs of both
recipes on the tiny model through the real local stack (and DPO through the gateway with the official SDK)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from treadle.recipes import dpo, kto
from treadle.recipes.lib.math_tasks import grade, is_heldout
from treadle.recipes.lib.preference_data import arithmetic_kto_examples, arithmetic_pairs, write_jsonl
from treadle.recipes.lib.preference import completion_datum, reference_logprobs, reference_scorer
from treadle.recipes.lib.preference_losses import (
    dpo_loss,
    dpo_on_pairs,
    forward_backward_with_loss,
    kto_loss,
    kto_reference_point,
)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for i in range(len(x)):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        grad[i] = (f(up) - f(down)) / (2 * eps)
    return grad


# ---------------------------------------------------------------- DPO by hand
def test_dpo_loss_value_and_gradient_sign_by_hand():
    # policy gains 1 nat on the chosen and loses 1 on the rejected, relative to the reference; beta 0.5 -> margin 1
    out = dpo_loss(np.array([-3.0]), np.array([-5.0]), np.array([-4.0]), np.array([-4.0]), beta=0.5)
    assert out.loss == pytest.approx(math.log(1 + math.exp(-1.0)), abs=1e-12)  # -log sigmoid(1) = 0.31326
    assert out.metrics["dpo/margin"] == pytest.approx(1.0)
    assert out.metrics["dpo/chosen_reward"] == pytest.approx(0.5) and out.metrics[
        "dpo/rejected_reward"
    ] == pytest.approx(-0.5)
    assert out.metrics["dpo/accuracy"] == 1.0 and out.metrics["dpo/kl_ref"] == pytest.approx(0.0)
    sig_minus_1 = 1 / (1 + math.e)  # sigmoid(-1) = 0.26894
    assert out.grad == pytest.approx([-0.5 * sig_minus_1, 0.5 * sig_minus_1], abs=1e-12)
    assert out.grad[0] < 0 < out.grad[1]  # raising the chosen (lowering the rejected) logprob lowers the loss


def test_dpo_label_smoothing_and_batch_mean_by_hand():
    chosen, rejected = np.array([-3.0, -4.0]), np.array([-5.0, -4.0])
    ref = np.array([-4.0, -4.0])
    out = dpo_loss(chosen, rejected, ref, ref, beta=0.5, label_smoothing=0.1)
    pair1 = 0.9 * math.log(1 + math.exp(-1.0)) + 0.1 * math.log(1 + math.exp(1.0))  # margin 1
    pair2 = math.log(2.0)  # margin 0: either smoothing term is log 2
    assert out.loss == pytest.approx((pair1 + pair2) / 2, abs=1e-12)
    assert out.metrics["dpo/accuracy"] == 0.5  # a tie is not a win
    both = np.concatenate([chosen, rejected])
    numeric = _numeric_grad(lambda x: dpo_loss(x[:2], x[2:], ref, ref, 0.5, 0.1).loss, both)
    np.testing.assert_allclose(out.grad, numeric, atol=1e-8)


# ---------------------------------------------------------------- KTO by hand
def test_kto_reference_point_is_the_mismatched_kl_floored_at_zero():
    assert kto_reference_point(np.array([-4.0, -4.0]), np.array([-4.5, -4.5])) == pytest.approx(0.5)
    assert kto_reference_point(np.array([-5.0, -4.0]), np.array([-4.0, -4.0])) == 0.0


def test_kto_loss_value_and_gradient_sign_by_hand():
    policy, ref, desirable = np.array([-2.0, -6.0]), np.array([-3.0, -5.0]), np.array([True, False])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    out = kto_loss(policy, ref, desirable, z0=0.5, beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    # desirable: r = 1, 1 - sigmoid(1 - 0.5); undesirable (weight 2): r = -1, 2 * (1 - sigmoid(0.5 - (-1)))
    assert out.loss == pytest.approx(((1 - sig(0.5)) + 2 * (1 - sig(1.5))) / 2, abs=1e-12)
    assert out.grad == pytest.approx([-sig(0.5) * sig(-0.5) / 2, 2 * sig(1.5) * sig(-1.5) / 2], abs=1e-12)
    assert out.grad[0] < 0 < out.grad[1]  # push the desirable completion up and the undesirable one down
    assert out.metrics["kto/reward_desirable"] == pytest.approx(1.0) and out.metrics[
        "kto/reward_undesirable"
    ] == pytest.approx(-1.0)
    numeric = _numeric_grad(lambda x: kto_loss(x, ref, desirable, 0.5, 1.0, 1.0, 2.0).loss, policy)
    np.testing.assert_allclose(out.grad, numeric, atol=1e-8)


# ---------------------------------------------------------------- data
def test_arithmetic_preference_data_is_labelled_by_the_grader():
    pairs = arithmetic_pairs(64, seed=3)
    for pair in pairs:
        answer = int(pair.chosen.split("=")[-1])
        assert grade(pair.chosen, answer) == 1.0 and grade(pair.rejected, answer) == 0.0
        assert not is_heldout(pair.prompt)
    assert any("=" not in p.rejected for p in pairs) and any("=" in p.rejected for p in pairs)  # both kinds of wrong
    assert all(is_heldout(p.prompt) for p in arithmetic_pairs(20, heldout=True))
    examples = arithmetic_kto_examples(64, seed=3)
    assert 0 < sum(e.label for e in examples) < 64
    assert arithmetic_pairs(8, seed=3) == pairs[:8]  # a pure function of the seed


# ---------------------------------------------------------------- recipes on the tiny model
def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_forward_reference_equals_the_base_models_sampler(service_client):
    tokenizer = service_client.create_lora_training_client("tiny", rank=1).get_tokenizer()
    pairs = arithmetic_pairs(3, max_operand=3)
    datums = [completion_datum(tokenizer, p.prompt, c, None) for p in pairs for c in (p.chosen, p.rejected)]
    from_sampler = reference_scorer(service_client, "tiny", "sampler")(datums)
    from_forward = reference_scorer(service_client, "tiny", "forward")(datums)
    assert np.all(from_sampler < 0)
    np.testing.assert_allclose(from_forward, from_sampler, rtol=1e-5, atol=1e-4)


def test_dpo_recipe_learns_the_preference_on_the_tiny_model(service_client, tmp_path):
    """Full batches of the same 8 pairs, also used as the 'held-out' file: a random tiny model cannot generalise
    across questions, so this checks the mechanics (reference, loss, gradient, eval) on pairs it can learn."""
    heldout = write_jsonl(str(tmp_path / "pairs.jsonl"), arithmetic_pairs(8, seed=0, max_operand=3))
    cfg = dpo.Config(
        base_model="tiny",
        log_dir=str(tmp_path / "run"),
        pairs=8,
        heldout_path=heldout,
        heldout_pairs=4,
        max_operand=3,
        steps=6,
        batch_size=8,
        beta=0.5,
        learning_rate=5e-3,
        lora_rank=4,
        max_tokens=4,
        eval_every=3,
        save_every=3,
    )
    result = dpo.main(cfg, service_client)
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == list(range(7))
    assert rows[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)  # the fresh adapter is the reference: margin 0
    assert rows[1]["dpo/kl_ref"] == pytest.approx(0.0, abs=1e-4)
    assert result.eval_before["eval/margin"] == pytest.approx(0, abs=1e-4)  # (its accuracy is a coin toss of rounding)
    losses = [r["dpo/loss"] for r in rows[1:]]
    assert losses[-1] < losses[0] - 0.2, losses
    assert result.eval_after["eval/margin"] > 0.5 and result.eval_after["eval/reward_accuracy"] >= 0.75
    # the eval after step 3 and step 4's forward see the same weights and the same 8 pairs
    assert rows[3]["eval/margin"] == pytest.approx(rows[4]["dpo/margin"], abs=1e-4)
    assert "eval/accuracy" in result.eval_after  # greedy accuracy on 4 held-out arithmetic problems was measured
    assert [c["step"] for c in _rows(tmp_path / "run" / "checkpoints.jsonl")] == [3, 6]


def test_kto_recipe_learns_from_binary_labels_on_the_tiny_model(service_client, tmp_path):
    """8 labelled examples in full batches; the held-out file holds pairs of the same 8 questions (mechanics, as above)."""
    data = write_jsonl(str(tmp_path / "kto.jsonl"), arithmetic_kto_examples(8, seed=0, max_operand=3))
    heldout = write_jsonl(str(tmp_path / "pairs.jsonl"), arithmetic_pairs(8, seed=0, max_operand=3))
    cfg = kto.Config(
        base_model="tiny",
        log_dir=str(tmp_path / "run"),
        data_path=data,
        heldout_path=heldout,
        arithmetic_eval=False,
        steps=6,
        batch_size=8,
        beta=0.5,
        learning_rate=5e-3,
        lora_rank=4,
        eval_every=0,
        save_every=6,
    )
    result = kto.main(cfg, service_client)
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == list(range(7))
    assert rows[1]["kto/loss"] == pytest.approx(
        0.5, abs=1e-4
    )  # r = z0 = 0 at the start: 1 - sigmoid(0) for every example
    assert all(r["kto/kl"] >= 0.0 for r in rows[1:])  # the reference point is floored at 0
    # ... from the estimate, which moves once the policy leaves the reference (up or down: on some CPUs the
    # mismatched pairs' logprobs fall and the floor keeps z0 at 0 on every step).
    assert all(r["kto/kl"] == pytest.approx(max(0.0, r["kto/kl_estimate"])) for r in rows[1:])
    assert rows[1]["kto/kl_estimate"] == pytest.approx(0.0, abs=1e-4)
    assert any(abs(r["kto/kl_estimate"]) > 1e-4 for r in rows[2:])
    losses = [r["kto/loss"] for r in rows[1:]]
    assert losses[-1] < losses[0] - 0.05, losses
    assert result.eval_after["eval/margin"] > result.eval_before["eval/margin"] + 0.2
    assert "eval/accuracy" not in result.eval_after


def test_dpo_through_the_gateway_with_the_official_tinker_sdk(tinker_env):
    """The recipe's pieces, unchanged, on clients of the official `tinker` SDK: its datum and ModelInput types,
    its sampler for the reference logprobs, and forward + forward_backward for the client-side loss."""
    import tinker
    from tinker import types as tt

    official = tinker.ServiceClient()
    training = official.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    reference = official.create_sampling_client(base_model="tiny").result()
    tokenizer = training.get_tokenizer()

    def official_datum(prompt: str, completion: str):
        d = completion_datum(tokenizer, prompt, completion, None)
        return tt.Datum(
            model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
            loss_fn_inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
        )

    pairs = arithmetic_pairs(4, max_operand=3)
    batch = [official_datum(p.prompt, p.chosen) for p in pairs] + [official_datum(p.prompt, p.rejected) for p in pairs]
    assert isinstance(batch[0], tt.Datum)
    ref = reference_logprobs(reference, batch)
    loss_fn = dpo_on_pairs(ref[:4], ref[4:], beta=0.5)
    results = []
    for _ in range(5):
        backward, result = forward_backward_with_loss(training, batch, loss_fn)
        optim = training.optim_step(tt.AdamParams(learning_rate=5e-3))
        backward.result(), optim.result()
        results.append(result)
    official.close("success")
    assert results[0].loss == pytest.approx(math.log(2), abs=1e-4)  # the official SDK's sampler is the reference
    assert results[-1].metrics["dpo/margin"] > results[0].metrics["dpo/margin"] + 0.3
    assert results[-1].loss < results[0].loss - 0.1


def test_recipes_import_and_show_help_without_torch():
    """Torch, transformers and peft blocked: each recipe imports and its generated --help lists its knobs."""
    for module in ("treadle.recipes.dpo", "treadle.recipes.kto", "treadle.recipes.distill"):
        code = (
            "import sys, runpy\n"
            "for name in ('torch', 'transformers', 'peft', 'accelerate'): sys.modules[name] = None\n"
            f"sys.argv = ['{module}', '--help']\n"
            f"runpy.run_module('{module}', run_name='__main__')\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0, (module, out.stderr)
        assert "--learning_rate" in out.stdout and "--registered_model_name" in out.stdout and "--resume" in out.stdout
