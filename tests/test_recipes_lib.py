"""The recipes' pure parts: advantages, datum builders, rendering masks, tasks, run logs, staleness, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from treadle.recipes.lib.advantages import group_advantages, is_informative, kl_penalized_reward, kl_sample_ref
from treadle.recipes.lib.datums import rl_datum, supervised_datum
from treadle.recipes.lib.math_tasks import (
    arithmetic_heldout,
    arithmetic_problem_at,
    gsm8k_answer,
    is_heldout,
    load_gsm8k,
    parse_answer,
    reward,
)
from treadle.recipes.lib.off_policy import staleness_action
from treadle.recipes.lib.rendering import render_conversation, render_generation_prompt
from treadle.recipes.lib.run_log import RunLog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- advantages


def test_group_advantages_are_centred_and_optionally_unit_std():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0])
    assert adv == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    normed = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    assert np.mean(normed) == pytest.approx(0.0)
    assert np.std(normed) == pytest.approx(1.0, abs=1e-4)


def test_uniform_group_is_not_informative():
    assert not is_informative(group_advantages([1.0, 1.0, 1.0]))
    assert is_informative(group_advantages([1.0, 0.0]))


def test_kl_penalty_lowers_reward_by_coef_times_kl():
    kl = kl_sample_ref([-0.5, -1.0], [-1.0, -1.5])
    assert kl == pytest.approx(1.0)
    assert kl_penalized_reward(1.0, kl, 0.1) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="2 sampler logprobs but 1"):
        kl_sample_ref([-0.5, -1.0], [-1.0])


# ---------------------------------------------------------------- datums


def test_rl_datum_is_shifted_and_masks_the_prompt():
    d = rl_datum(prompt=[10, 11, 12], completion=[20, 21], sampler_logprobs=[-0.1, -0.2], advantage=0.5)
    assert d.model_input.to_ints() == [10, 11, 12, 20]
    inputs = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [11, 12, 20, 21]
    # target 20 is predicted from position 2 (token 12): the first completion token.
    assert inputs["advantages"] == pytest.approx([0.0, 0.0, 0.5, 0.5])
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2])
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"


def test_rl_datum_rejects_mismatched_logprobs():
    with pytest.raises(ValueError, match="2 tokens but 1 sampler logprobs"):
        rl_datum([1, 2], [3, 4], [-0.1], 1.0)


def test_supervised_datum_shifts_weights_and_normalizes():
    d = supervised_datum([1, 2, 3, 4, 5], [0, 0, 1, 1, 1])
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5]
    assert d.loss_fn_inputs["weights"].tolist() == [0, 1, 1, 1]
    normed = supervised_datum([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], normalize=True)
    assert sum(normed.loss_fn_inputs["weights"].tolist()) == pytest.approx(1.0)


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def chatml_tokenizer():
    from treadle.testing.tiny_model import build_tokenizer

    return build_tokenizer(0)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]


def test_assistant_mask_matches_the_templates_generation_markers(chatml_tokenizer):
    """The tiny tokenizer's template marks assistant turns with {% generation %}: HF's own mask is the oracle."""
    rendered = render_conversation(chatml_tokenizer, CONVERSATION)
    oracle = chatml_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert rendered.tokens == list(oracle["input_ids"])
    assert rendered.mask == [float(m) for m in oracle["assistant_masks"]]
    assert (
        chatml_tokenizer.decode([t for t, m in zip(rendered.tokens, rendered.mask) if m])
        == "5<|im_end|>It is 8.<|im_end|>"
    )


def test_last_assistant_only_and_prompt_prefix(chatml_tokenizer):
    rendered = render_conversation(chatml_tokenizer, CONVERSATION, train_on="last_assistant")
    assert chatml_tokenizer.decode([t for t, m in zip(rendered.tokens, rendered.mask) if m]) == "It is 8.<|im_end|>"
    prompt = render_generation_prompt(chatml_tokenizer, CONVERSATION[:-1])
    assert rendered.tokens[: len(prompt)] == prompt
    assert rendered.mask[: len(prompt)] == [0.0] * len(prompt)


def test_non_incremental_template_is_refused(chatml_tokenizer):
    reversing = "{% for m in messages|reverse %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="not incremental"):
        _render_with_template(chatml_tokenizer, reversing)


def _render_with_template(tokenizer, template):
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        return render_conversation(tokenizer, CONVERSATION[1:3])
    finally:
        tokenizer.chat_template = original


def test_conversation_without_assistant_is_refused(chatml_tokenizer):
    with pytest.raises(ValueError, match="no assistant message"):
        render_conversation(chatml_tokenizer, CONVERSATION[:2])


# ---------------------------------------------------------------- tasks


def test_heldout_split_is_disjoint_from_training_and_fixed():
    heldout = arithmetic_heldout(40)
    assert len({p.question for p in heldout}) == 40
    assert all(is_heldout(p.question) for p in heldout)
    assert arithmetic_heldout(40) == heldout
    training = [arithmetic_problem_at(seed, i) for seed in range(3) for i in range(300)]
    assert not {p.question for p in training} & {p.question for p in heldout}
    assert arithmetic_problem_at(7, 12) == arithmetic_problem_at(7, 12)
    assert all(eval(p.question[len("What is ") : -1]) == p.answer for p in training[:50])


def test_heldout_size_beyond_the_space_is_an_error():
    with pytest.raises(ValueError, match="max_operand=2; asked for n=50"):
        arithmetic_heldout(50, max_operand=2)


@pytest.mark.parametrize(
    "response, first_line_only, expected",
    [
        ("12", True, 12),
        ("7 + 5 = 12", True, 12),
        ("7 - 9 = -2.", True, -2),
        ("The answer is 1,234\nor 5", True, 1234),
        ("The answer is 3\nor 5", False, 5),
        ("no idea", True, None),
        ("", True, None),
    ],
)
def test_parse_answer(response, first_line_only, expected):
    assert parse_answer(response, first_line_only) == expected


def test_reward_gives_format_credit_only_to_integer_answers():
    assert reward("7 + 5 = 12", 12, format_reward=0.1) == 1.0
    assert reward("7 + 5 = 13", 12, format_reward=0.1) == 0.1
    assert reward("twelve", 12, format_reward=0.1) == 0.0


def test_gsm8k_answer_and_local_jsonl(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Q1?", "answer": "2 + 2 = 4\n#### 4"}, {"question": "Q2?", "answer": "so\n#### 1,200"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_gsm8k(str(path))
    assert [(p.question, p.answer) for p in problems] == [("Q1?", 4), ("Q2?", 1200)]
    with pytest.raises(ValueError, match="no '#### <answer>'"):
        gsm8k_answer("just text")


# ---------------------------------------------------------------- staleness


@pytest.mark.parametrize(
    "group_version, current, limit, policy, expected",
    [
        (5, 5, 0, "requeue", "use"),
        (4, 5, 0, "requeue", "requeue"),
        (4, 5, 1, "discard", "use"),
        (3, 5, 1, "discard", "discard"),
        (3, 5, 2, "requeue", "use"),
    ],
)
def test_staleness_action(group_version, current, limit, policy, expected):
    assert staleness_action(group_version, current, limit, policy) == expected


# ---------------------------------------------------------------- run log


def _config():
    from treadle.recipes.math_rl import Config

    return Config(steps=3)


def test_run_log_rewind_drops_later_steps_in_every_step_keyed_file(tmp_path):
    log = RunLog(str(tmp_path), _config())
    for step in range(5):
        log.log_metrics(step, {"reward/mean": step / 10})
        log.append("rollouts.jsonl", step, {"policy_version": step})
    log.record_checkpoint("step-2", 2, "treadle://r/weights/step-2", {"cursor": 16, "pending": [3]})
    resumed = RunLog(str(tmp_path), _config(), resume=True)
    last = resumed.last_checkpoint()
    assert (last.step, last.state_path, last.extra) == (2, "treadle://r/weights/step-2", {"cursor": 16, "pending": [3]})
    resumed.rewind_to(last.step)
    assert [row["step"] for row in resumed.metrics()] == [0, 1, 2]
    with open(tmp_path / "rollouts.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 3


def test_run_log_ignores_a_torn_last_line_and_fresh_runs_start_clean(tmp_path):
    log = RunLog(str(tmp_path), _config())
    log.record_checkpoint("a", 1, "treadle://r/weights/a")
    with open(log.checkpoints_path, "a") as f:
        f.write('{"name": "b", "st')  # killed mid-write
    assert RunLog(str(tmp_path), _config(), resume=True).last_checkpoint().name == "a"
    assert RunLog(str(tmp_path), _config(), resume=False).last_checkpoint() is None


def test_mlflow_requested_without_mlflow_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(RuntimeError, match="needs the mlflow package"):
        RunLog(str(tmp_path), _config(), mlflow_experiment="exp")


def test_plot_writes_a_real_png(tmp_path):
    import matplotlib.image

    from treadle.recipes.lib.plot import plot_metrics

    log = RunLog(str(tmp_path), _config())
    for step in range(6):
        log.log_metrics(
            step, {"reward/mean": step / 5, **({"eval/accuracy": 0.2 + step / 10} if step % 2 == 0 else {})}
        )
    png = plot_metrics(log.metrics_path, str(tmp_path / "curve.png"), ["reward/mean", "eval/accuracy"])
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 600
    coloured = (np.abs(pixels[..., 0] - pixels[..., 2]) > 0.3).sum()  # the lines are blue and orange, not grey
    assert coloured > 200


# ---------------------------------------------------------------- CLI and import boundary


def test_cli_parses_config_flags():
    from treadle.config import parse_config
    from treadle.recipes.math_rl import Config

    cfg = parse_config(
        Config,
        ["--steps", "7", "--mode", "async", "--stale_policy", "discard", "--resume", "--stop", ".", "--stop", "!"],
    )
    assert (cfg.steps, cfg.mode, cfg.stale_policy, cfg.resume, cfg.stop) == (7, "async", "discard", True, [".", "!"])


@pytest.mark.parametrize("module", ["treadle.recipes.math_rl", "treadle.recipes.sft"])
def test_recipes_import_and_show_help_without_torch(module):
    """A laptop client has no torch: block torch/transformers/peft and import the recipe and its --help."""
    code = (
        "import sys, runpy\n"
        "for name in ('torch', 'transformers', 'peft', 'accelerate'): sys.modules[name] = None\n"
        f"import {module}\n"
        "assert not any(m.startswith('treadle.gpu_worker') for m in sys.modules)\n"
        f"sys.argv = ['{module}', '--help']\n"
        f"runpy.run_module('{module}', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--learning_rate" in out.stdout and "--log_dir" in out.stdout


def test_recipes_never_mention_the_worker_package():
    recipes = os.path.join(REPO, "treadle", "recipes")
    for root, _, files in os.walk(recipes):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    assert "gpu_worker" not in f.read(), name
