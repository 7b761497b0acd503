"""Code RL: grading in the sandbox, problem layouts, two-turn rendering, and smoke runs on the real local stack.

A random tiny model never writes a code block, so the smoke runs start from a short SFT warm start
on a handful of tiny problems (the problem set's own layout): after it the model writes code blocks,
some right and some garbled, which gives the RL loop real rewards, real tool calls and real gradients.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from treadle import ServiceClient
from treadle.recipes import code_rl, sft
from treadle.recipes.lib.code_tasks import (
    CodeTest,
    extract_code,
    grade,
    load_code_problems,
    problem_from_row,
    problem_prompt,
    split_problems,
)
from treadle.recipes.lib.datums import multi_turn_rl_datum
from treadle.recipes.lib.rendering import render_continuation, tool_message
from treadle.recipes.lib.run_log import RunLog
from treadle.sandbox import Limits, LocalSandbox
from treadle.testing.tiny_model import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_PROBLEMS = [  # (name, statement, solution, inputs); heldout_fraction 0.5 holds out `double` and `echo_word`
    ("echo_input", "Print the input line.", "print(input())", ["1\n", "cat\n", "8 9\n"]),
    ("plus_one", "Print n + 1.", "print(int(input()) + 1)", ["1\n", "5\n", "8\n"]),
    ("triple", "Print 3 * n.", "print(3 * int(input()))", ["2\n", "4\n", "7\n"]),
    ("shout", "Print the word in upper case.", "print(input().upper())", ["cat\n", "dog\n", "red\n"]),
    ("double", "Print 2 * n.", "print(2 * int(input()))", ["3\n", "6\n", "9\n"]),
    ("echo_word", "Print the word.", "print(input())", ["sun\n", "x\n", "y\n"]),
]
# The warm start answers every problem with the echo program three times in four, and without code otherwise:
# two strings a tiny model learns in a few steps (sampled at temperature 0.6: mostly the echo program, sometimes
# no code), so groups get different rewards, echo_input's answers pass and the others' fail check_solution.
ECHO = "```python\nprint(input())\n```"
NO_CODE = "I do not know."


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _expected(solution: str, stdin: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", solution], input=stdin, capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox(Limits(cpu_seconds=1, wall_seconds=2.0, memory_mb=256), pool_size=2)


@pytest.fixture(scope="module")
def tiny_problems(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("code") / "problems.jsonl"
    rows = [
        {
            "name": n,
            "statement": s,
            "solution": sol,
            "tests": [{"input": i, "output": _expected(sol, i)} for i in inputs],
        }
        for n, s, sol, inputs in TINY_PROBLEMS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def warm_start(stack, tiny_problems, tmp_path_factory) -> str:
    """A save_state path of the tiny model after SFT on the echo answer (or none) to the tiny problems' prompts, and
    for two-turn prompts on the echo answer again after a check_solution report: without that second turn the tiny
    model's answers after a report are whatever its random weights make of it, and whether one of them held a code
    block turned on the last bits of the warm start's training."""
    conversations = []
    for problem in load_code_problems(tiny_problems):
        for answer in [ECHO, ECHO, ECHO, NO_CODE]:
            for turns in (1, 2):
                conversation = [
                    {"role": "user", "content": problem_prompt(problem, turns)},
                    {"role": "assistant", "content": answer},
                ]
                if turns == 2 and answer == ECHO:
                    report = "check_solution: 0 of 1 example tests passed.\nTest 1: wrong answer."
                    conversation += [
                        {"role": "tool", "name": "check_solution", "content": report},
                        {"role": "assistant", "content": ECHO},
                    ]
                conversations.append(conversation)
    data = tmp_path_factory.mktemp("code-sft") / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    cfg = sft.Config(
        base_model="tiny",
        log_dir=str(data.parent / "run"),
        data_path=str(data),
        eval_size=1,
        steps=150,
        batch_size=8,
        learning_rate=2e-3,
        lora_rank=32,
        eval_every=0,
        save_every=150,
    )
    return sft.main(cfg, ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)).final_state_path


def _config(log_dir, problems: str, init_state: str, **overrides) -> code_rl.Config:
    settings = dict(
        base_model="tiny",
        log_dir=str(log_dir),
        problems_path=problems,
        heldout_fraction=0.5,
        init_state=init_state,
        steps=2,
        groups_per_batch=2,
        group_size=4,
        max_tokens=40,
        max_context=512,
        public_tests=1,
        temperature=0.6,
        learning_rate=1e-3,
        eval_every=0,
        save_every=2,
        num_rollout_workers=2,
        sandbox_workers=2,
        sandbox_cpu_seconds=1,
        sandbox_wall_seconds=2.0,
    )
    return code_rl.Config(**{**settings, **overrides})


# -------------------------------------------------------------------- grading and problem layouts
def test_grades_correct_wrong_crashing_timing_out_and_codeless_answers(sandbox):
    problem = load_code_problems()[0]  # sum_two: read a and b, print a + b
    answers = {
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```": 1.0,
        "```python\na, b = map(int, input().split())\nprint(a - b)\n```": 0.0,
        "Here:\n```python\nprint(undefined_name)\n```": 0.0,
        "```python\nwhile True:\n    pass\n```": 0.0,
        "The answer is a + b.": -0.1,
    }
    grades = {answer: grade(sandbox, problem, answer) for answer in answers}
    assert {a: g.reward for a, g in grades.items()} == answers
    statuses = [g.results[-1].execution.status if g.results else None for g in grades.values()]
    assert statuses == ["ok", "ok", "runtime_error", "timeout", None]
    assert len(grades[next(iter(answers))].results) == len(problem.tests) >= 4  # a pass runs every test


def test_the_offline_problem_set_is_well_formed_and_its_references_pass(sandbox):
    problems = load_code_problems()
    assert len(problems) >= 60 and len({p.name for p in problems}) == len(problems)
    assert all(len(p.tests) >= 5 or p.name == "hello_world" for p in problems)
    train, heldout = split_problems(problems, 0.25)
    assert not {p.name for p in train} & {p.name for p in heldout} and 8 <= len(heldout) <= 24
    with open(os.path.join(REPO, "treadle/recipes/data/code_problems.jsonl")) as f:
        solutions = {row["name"]: row["solution"] for row in map(json.loads, f)}
    for problem in problems[::16]:  # a sample: every reference solution passing would take a minute here
        assert grade(sandbox, problem, f"```python\n{solutions[problem.name]}\n```").reward == 1.0, problem.name


def test_loads_deepcoder_taco_and_livecodebench_rows_and_grades_function_problems(sandbox):
    deepcoder = problem_from_row(
        {"problem": "Add.", "tests": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}])}
    )
    assert deepcoder.tests == (CodeTest("1 2\n", "3\n"),) and deepcoder.fn_name is None
    taco = problem_from_row(
        {
            "question": "Add them.",
            "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [[3], [10]]}),
        }
    )
    assert taco.fn_name == "add" and taco.tests[0] == CodeTest("[1, 2]", "[3]")
    lcb = problem_from_row(
        {
            "question_content": "Sum a list.",
            "question_id": "abc1",
            "metadata": json.dumps({"func_name": "total"}),
            "starter_code": "class Solution:\n    def total(self, xs):",
            "private_test_cases": "eJzLSM3JyQcABiwCFQ==",
            "public_test_cases": json.dumps([{"input": "[1, 2, 3]", "output": "6", "testtype": "functional"}]),
        }
    )
    assert (lcb.name, lcb.fn_name, lcb.tests) == ("abc1", "total", (CodeTest("[[1, 2, 3]]", "6"),))
    assert "class Solution" in problem_prompt(lcb, 1)
    assert grade(sandbox, taco, "```python\ndef add(a, b):\n    return a + b\n```").reward == 1.0
    assert grade(sandbox, taco, "```python\ndef add(a, b):\n    return a * b\n```").reward == 0.0
    assert (
        grade(sandbox, lcb, "```python\nclass Solution:\n    def total(self, xs):\n        return sum(xs)\n```").reward
        == 1.0
    )
    with pytest.raises(ValueError, match="needs a statement field"):
        problem_from_row({"title": "x", "tests": []}, 7)


def test_extracts_the_last_python_block_not_a_trailing_output_block():
    text = "```python\nprint('a')\n```\nthen\n```python\nprint('b')\n```\nThis prints:\n```\nb\n```"
    assert extract_code(text) == "print('b')\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```python\nprint(1)") is None  # an unclosed block (cut off at max_tokens) is no answer


# -------------------------------------------------------------------- the tool turn's tokens
def test_tool_result_is_rendered_by_the_template_after_the_sampled_tokens_and_carries_no_loss():
    tokenizer = build_tokenizer(0)
    messages = [{"role": "user", "content": "Print 1."}]
    reply = "```python\nprint(2)\n```"
    sampled = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    report = "check_solution: 0 of 1 example tests passed."
    after = render_continuation(tokenizer, messages, reply, True, [tool_message(tokenizer, "check_solution", report)])
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    second_prompt = tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False) + sampled + after)
    assert second_prompt == tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": reply}, {"role": "tool", "content": report}],
        tokenize=False,
        add_generation_prompt=True,
    )
    # a reply cut off by max_tokens gets its end-of-turn from the template
    assert tokenizer.decode(render_continuation(tokenizer, messages, reply, False, [])).startswith("<|im_end|>")

    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    final = tokenizer.encode("```python\nprint(1)\n```", add_special_tokens=False)
    datum = multi_turn_rl_datum(
        [(prompt_ids, None), (sampled, [-0.5] * len(sampled)), (after, None), (final, [-0.25] * len(final))], 2.0
    )
    advantages = datum.loss_fn_inputs["advantages"].to_numpy()
    expected = np.array([0.0] * (len(prompt_ids) - 1) + [2.0] * len(sampled) + [0.0] * len(after) + [2.0] * len(final))
    assert np.array_equal(advantages, expected)
    assert datum.loss_fn_inputs["logprobs"].to_numpy()[advantages == 0].tolist() == [0.0] * int((advantages == 0).sum())


def test_a_template_without_a_tool_role_gets_the_result_as_a_user_message():
    tokenizer = build_tokenizer(0)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert tool_message(tokenizer, "check_solution", "3 passed") == {
        "role": "user",
        "content": "[check_solution result]\n3 passed",
    }
    assert tool_message(build_tokenizer(0), "check_solution", "3 passed")["role"] == "tool"


# -------------------------------------------------------------------- smoke runs on the local stack
def test_two_turn_episode_shows_the_tool_result_in_the_second_prompt(
    service_client, tiny_problems, warm_start, sandbox
):
    training = service_client.create_training_client_from_state(warm_start)
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client()
    seeds = []  # of each sample request, through the real sampler

    class Recording:
        def sample(self, prompt, num_samples, params):
            seeds.append(params.seed)
            return sampler.sample(prompt, num_samples, params)

    problem = next(
        p for p in load_code_problems(tiny_problems) if p.name == "triple"
    )  # echo fails it: a report of failures
    cfg = _config("unused", tiny_problems, warm_start, max_turns=2)
    episodes = code_rl.Episodes(tokenizer, sandbox, cfg)
    params = code_rl.SamplingParams(max_tokens=40, temperature=0.6, seed=3)
    attempts = code_rl.run_episodes(episodes, Recording(), problem, 8, params)
    two_turn = [a for a in attempts if a.tool_report is not None]
    assert two_turn, [a.answer for a in attempts]
    # every second answer has its own seed: episodes with the same first answer must not all draw the same second one
    assert len(seeds) == 1 + len(two_turn) and len(set(seeds)) == len(seeds), seeds
    for a in two_turn:
        (prompt, _), (first, first_lp), (after, no_lp), (second, second_lp) = a.pieces
        assert first_lp is not None and no_lp is None and second_lp is not None
        second_prompt = tokenizer.decode([*prompt, *first, *after])
        assert second_prompt.endswith(f"<|im_start|>tool\n{a.tool_report}<|im_end|>\n<|im_start|>assistant\n")
        assert a.tool_report.startswith("check_solution: ") and "example tests passed" in a.tool_report


@pytest.mark.parametrize("max_turns", [1, 2])
def test_code_rl_sync_runs_trains_and_logs(service_client, tiny_problems, warm_start, tmp_path, max_turns):
    result = code_rl.main(_config(tmp_path, tiny_problems, warm_start, max_turns=max_turns), service_client)
    metrics = _rows(result.metrics_path)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert [r["step"] for r in metrics if "eval/pass_rate" in r] == [0, 2]
    train = metrics[1:]
    assert sum(r["format/has_code"] for r in train) > 0  # the warm start writes code blocks ...
    assert sum(r["tokens"] for r in train) > 0 and any(r["loss:sum"] != 0.0 for r in train)  # ... and some groups train
    assert (sum(r["turns/second_turn"] for r in train) > 0) == (max_turns == 2)
    samples = _rows(tmp_path / "samples.jsonl")
    assert len(samples) == 2 * 2 * 4 and {s["reward"] for s in samples} <= {1.0, 0.0, -0.1}
    if max_turns == 2:
        assert any(s["tool_report"] and s["tool_report"].startswith("check_solution:") for s in samples)
    rollouts = _rows(tmp_path / "rollouts.jsonl")
    assert [r["problem_index"] for r in rollouts] == list(range(4)) and all(r["staleness"] == 0 for r in rollouts)
    assert {r["problem"] for r in rollouts} <= {"echo_input", "plus_one", "triple", "shout"}  # never a held-out problem
    assert {s["problem"] for s in _rows(tmp_path / "eval_samples.jsonl")} == {"double", "echo_word"}
    assert result.final_state_path.endswith("/weights/step-000002") and os.path.getsize(result.png_path) > 10_000


def test_code_rl_async_with_requeue_never_trains_on_staler_groups(service_client, tiny_problems, warm_start, tmp_path):
    cfg = _config(
        tmp_path,
        tiny_problems,
        warm_start,
        mode="async",
        max_turns=2,
        steps=8,
        groups_per_batch=1,
        group_size=2,
        num_rollout_workers=4,
        max_steps_off_policy=1,
        stale_policy="requeue",
    )
    code_rl.main(cfg, service_client)
    rollouts = _rows(tmp_path / "rollouts.jsonl")
    used = [r for r in rollouts if r["action"] == "use"]
    stale = [r for r in rollouts if r["action"] != "use"]
    assert len(used) == 8 and max(r["staleness"] for r in used) == 1  # off-policy groups were used, within the limit
    assert stale and all(r["action"] == "requeue" and r["staleness"] > 1 for r in stale)
    # a requeued problem is sampled again by the current policy and read next: used at once, on-policy
    for i, r in enumerate(rollouts):
        if r["action"] == "requeue" and i + 1 < len(rollouts):
            again = rollouts[i + 1]
            assert (again["problem_index"], again["action"], again["staleness"]) == (r["problem_index"], "use", 0), (
                rollouts
            )
    metrics = [r for r in _rows(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert sum(r["groups/requeued"] for r in metrics) == len(stale)


class Killed(Exception):
    pass


def test_a_kill_right_after_a_checkpoint_record_loses_no_metrics_row(
    service_client, tiny_problems, warm_start, tmp_path, monkeypatch
):
    """The step's metrics row is written before its checkpoint is recorded, so resuming from that checkpoint keeps every row."""
    record = RunLog.record_checkpoint

    def record_then_die(self, *args, **kwargs):
        record(self, *args, **kwargs)
        raise Killed

    monkeypatch.setattr(RunLog, "record_checkpoint", record_then_die)
    cfg = _config(tmp_path, tiny_problems, warm_start, steps=2, save_every=1, groups_per_batch=1, group_size=2)
    with pytest.raises(Killed):
        code_rl.main(cfg, service_client)
    monkeypatch.undo()
    assert [r["step"] for r in _rows(tmp_path / "checkpoints.jsonl")] == [1]
    code_rl.main(cfg.model_copy(update={"resume": True}), service_client)
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_resume_after_kill_continues_the_problem_stream(stack, tiny_problems, warm_start, tmp_path):
    """SIGKILL the recipe after its first checkpoint, rerun with --resume; compare with an uninterrupted run."""
    env = {**stack.env(), "OMP_NUM_THREADS": "1"}
    args = [
        "--base_model",
        "tiny",
        "--problems_path",
        tiny_problems,
        "--heldout_fraction",
        "0.5",
        "--init_state",
        warm_start,
        "--steps",
        "4",
        "--save_every",
        "2",
        "--groups_per_batch",
        "1",
        "--group_size",
        "2",
        "--max_tokens",
        "40",
        "--eval_every",
        "0",
        "--learning_rate",
        "1e-3",
        "--num_rollout_workers",
        "1",
        "--sandbox_workers",
        "2",
    ]

    def run(log_dir, *extra, out=subprocess.PIPE) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "treadle.recipes.code_rl", "--log_dir", str(log_dir), *args, *extra],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )

    killed = tmp_path / "killed"
    proc = run(killed)
    # the uninterrupted reference runs beside it (a row's numbers do not depend on what else the worker serves)
    fresh_log = open(tmp_path / "fresh.log", "w")
    fresh = run(tmp_path / "fresh", out=fresh_log)
    checkpoints = killed / "checkpoints.jsonl"
    while not (checkpoints.exists() and checkpoints.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _rows(killed / "metrics.jsonl")[-1]["step"] < 4

    resumed = run(killed, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resuming from" in out
    rows = _rows(killed / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(5))
    assert [r["problem_index"] for r in _rows(killed / "rollouts.jsonl")] == list(
        range(4)
    )  # each problem once, in order

    assert fresh.wait(timeout=600) == 0, (tmp_path / "fresh.log").read_text()[-3000:]
    fresh_log.close()
    reference = _rows(tmp_path / "fresh" / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows[1:]] == [r["reward/mean"] for r in reference[1:]]
    assert [r["answer"] for r in _rows(killed / "samples.jsonl")] == [
        r["answer"] for r in _rows(tmp_path / "fresh" / "samples.jsonl")
    ]


def test_code_rl_imports_and_shows_help_without_torch():
    """A laptop client has no torch: the recipe, its sandbox and its --help import none of the worker side."""
    code = (
        "import sys, runpy\n"
        "for name in ('torch', 'transformers', 'peft', 'accelerate'): sys.modules[name] = None\n"
        "import treadle.recipes.code_rl\n"
        "assert not any(m.startswith('treadle.gpu_worker') for m in sys.modules)\n"
        "sys.argv = ['code_rl', '--help']\n"
        "runpy.run_module('treadle.recipes.code_rl', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--max_steps_off_policy" in out.stdout and "--stale_policy" in out.stdout and "--max_turns" in out.stdout
