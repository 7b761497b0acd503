"""Programming problems graded by running the model's code on unit tests in a sandbox.

A problem is a statement plus stdin/stdout tests, or, for function-style problems (`fn_name`), tests
whose input is a JSON list of arguments and whose output is the JSON of the return value. The
offline set (`data/code_problems.jsonl`, written by `scripts/make_code_problems.py`) is small and
easy; `load_code_problems` also reads the row layouts of DeepCoder (`problem`, `tests`,
`metadata.func_name`), TACO (`question`, `input_output`) and LiveCodeBench (`question_content`,
`public_test_cases`; its compressed private tests are pickles, which are never loaded).

Grading follows the DeepCoder recipe: the response's last ```python block must pass every test
(reward 1), otherwise 0; a response with no code block gets -0.1, so that answering in the right
shape is worth something. The `check_solution` tool runs a program on the first `public_tests`
tests only and reports the results in words, so a final answer cannot just echo what it was shown.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from treadle.sandbox import Execution, Sandbox

CODE_PROBLEMS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "code_problems.jsonl")
NO_CODE_REWARD = -0.1
_CODE_BLOCK = re.compile(r"```([A-Za-z0-9]*)[ \t]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")
_STATEMENT_FIELDS = ("statement", "problem", "question", "question_content")
_TESTS_FIELDS = ("tests", "input_output", "public_test_cases")
_SHOWN_CHARS = 200  # per field of the tool's report: enough to see the mistake, short enough for a small context


@dataclass(frozen=True)
class CodeTest:
    input: str
    output: str


@dataclass(frozen=True)
class CodeProblem:
    name: str
    statement: str
    tests: tuple[CodeTest, ...]
    fn_name: str | None = None
    starter_code: str | None = None


@dataclass
class TestResult:
    test: CodeTest
    passed: bool
    execution: Execution


@dataclass
class Grade:
    reward: float
    passed: bool
    has_code: bool
    results: list[TestResult]


# ---------------------------------------------------------------- loading
def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _function_input(value: Any) -> str:
    """Arguments as one JSON list: TACO gives a list already, LiveCodeBench one JSON value per line."""
    if isinstance(value, str):
        return json.dumps([json.loads(line) for line in value.splitlines() if line.strip()])
    return json.dumps(value)


def problem_from_row(row: dict, index: int = 0) -> CodeProblem:
    """One problem from a row of any supported layout (see the module docstring)."""
    statement = next((row[k] for k in _STATEMENT_FIELDS if row.get(k)), None)
    raw_tests = next((_json(row[k]) for k in _TESTS_FIELDS if row.get(k)), None)
    if statement is None or raw_tests is None:
        raise ValueError(
            f"problem row {index}: needs a statement field (one of {_STATEMENT_FIELDS}) and a tests field "
            f"(one of {_TESTS_FIELDS}); it has fields {sorted(row)}"
        )
    fn_name = row.get("fn_name") or (_json(row.get("metadata") or {}) or {}).get("func_name")
    if isinstance(raw_tests, dict):  # TACO: {"inputs": [...], "outputs": [...], "fn_name"?}
        fn_name = fn_name or raw_tests.get("fn_name")
        pairs = list(zip(raw_tests["inputs"], raw_tests["outputs"]))
    else:
        pairs = [(t["input"], t["output"]) for t in raw_tests]
    if not pairs:
        raise ValueError(f"problem row {index}: has no tests")
    if fn_name:
        tests = tuple(CodeTest(_function_input(i), json.dumps(_json(o))) for i, o in pairs)
    else:
        tests = tuple(
            CodeTest("\n".join(i) if isinstance(i, list) else i, "\n".join(o) if isinstance(o, list) else o)
            for i, o in pairs
        )
    name = str(row.get("name") or row.get("question_id") or row.get("question_title") or f"problem-{index}")
    return CodeProblem(name, statement, tests, fn_name, row.get("starter_code") or None)


def load_code_problems(path: str | None = None) -> list[CodeProblem]:
    """Problems from a JSONL file (or a JSON list), default the offline set."""
    path = path or CODE_PROBLEMS
    with open(path) as f:
        text = f.read()
    rows = (
        json.loads(text)
        if text.lstrip().startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    return [problem_from_row(row, i) for i, row in enumerate(rows)]


def split_problems(
    problems: Sequence[CodeProblem], heldout_fraction: float
) -> tuple[list[CodeProblem], list[CodeProblem]]:
    """(train, held-out) by a hash of each problem's name: the same split on every run and machine."""
    heldout = [p for p in problems if hashlib.sha256(p.name.encode()).digest()[0] < 256 * heldout_fraction]
    train = [p for p in problems if p not in heldout]
    if not train or not heldout:
        raise ValueError(
            f"heldout_fraction={heldout_fraction} leaves {len(train)} train and {len(heldout)} held-out "
            f"problems of {len(problems)}; both need at least one"
        )
    return train, heldout


def problem_at(train: Sequence[CodeProblem], seed: int, index: int) -> CodeProblem:
    """Problem `index` of the stream: each pass over the set in its own seeded order (random access, for --resume)."""
    order = list(range(len(train)))
    random.Random(f"{seed}:{index // len(train)}").shuffle(order)
    return train[order[index % len(train)]]


# ---------------------------------------------------------------- prompts
def problem_prompt(problem: CodeProblem, max_turns: int) -> str:
    """The user message: the statement, what to write, and (two turns) how the check_solution tool works."""
    if problem.fn_name:
        task = f"Write a Python function `{problem.fn_name}` that solves it"
        if problem.starter_code:
            task += f", starting from:\n```python\n{problem.starter_code}\n```\n"
    else:
        task = "Write a Python program that reads the input with input() and prints only the answer, nothing else"
    text = f"{problem.statement.strip()}\n\n{task}. Put the code in one ```python code block."
    if max_turns == 2:
        text += " The check_solution tool runs your first code block on the examples and reports back; then give your final code block."
    return text


# ---------------------------------------------------------------- running and grading
def extract_code(response: str) -> str | None:
    """The last ```python (or ```py) block of a response, else its last untagged ``` block, else None.

    Tagged blocks win because small models often follow their code with a bare block of the output
    it would print ("This will output: ```Hello```").
    """
    blocks = _CODE_BLOCK.findall(response)
    tagged = [code for tag, code in blocks if tag.lower() in _PYTHON_TAGS]
    bare = [code for tag, code in blocks if not tag]
    return (tagged or bare or [None])[-1]


def program_for(problem: CodeProblem, code: str) -> str:
    """What the sandbox runs: the code itself, or for a function-style problem the code plus a call of it."""
    if not problem.fn_name:
        return code
    return (
        f"{code}\n\nimport json as _json, sys as _sys\n_args = _json.loads(_sys.stdin.read())\n"
        f"_fn = globals().get({problem.fn_name!r}) or getattr(Solution(), {problem.fn_name!r})\n"
        f"print(_json.dumps(_fn(*_args)))\n"
    )


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def output_matches(problem: CodeProblem, got: str, expected: str) -> bool:
    """Stdout equal up to trailing whitespace; a function's JSON result equal (TACO wraps some in a list)."""
    if not problem.fn_name:
        return _lines(got) == _lines(expected)
    try:
        value = json.loads(got)
    except json.JSONDecodeError:
        return False
    wanted = json.loads(expected)
    return value == wanted or [value] == wanted


def run_tests(
    sandbox: Sandbox, problem: CodeProblem, code: str, tests: Sequence[CodeTest], stop_at_failure: bool = True
) -> list[TestResult]:
    """Run `code` on each test in turn (a fresh sandboxed process each), stopping at the first failure if asked."""
    program, results = program_for(problem, code), []
    for test in tests:
        execution = sandbox.run(program, test.input)
        passed = execution.status == "ok" and output_matches(problem, execution.stdout, test.output)
        results.append(TestResult(test, passed, execution))
        if stop_at_failure and not passed:
            break
    return results


def grade(sandbox: Sandbox, problem: CodeProblem, response: str, no_code_reward: float = NO_CODE_REWARD) -> Grade:
    """1.0 if the response's code passes every test, 0.0 if not, `no_code_reward` if it has no code block."""
    code = extract_code(response)
    if code is None:
        return Grade(no_code_reward, False, False, [])
    results = run_tests(sandbox, problem, code, problem.tests)
    passed = len(results) == len(problem.tests) and all(r.passed for r in results)
    return Grade(1.0 if passed else 0.0, passed, True, results)


def _shown(text: str) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + " ..."


def check_solution_report(results: Sequence[TestResult]) -> str:
    """The check_solution tool's answer: per example test, passed or what went wrong."""
    passed = sum(r.passed for r in results)
    lines = [f"check_solution: {passed} of {len(results)} example tests passed."]
    for i, r in enumerate(results, 1):
        if r.passed:
            lines.append(f"Test {i}: passed.")
            continue
        status = r.execution.status
        why = {
            "ok": "wrong answer",
            "runtime_error": "error",
            "timeout": "time limit exceeded",
            "memory_limit": "memory limit exceeded",
            "output_limit": "output too long",
        }.get(status, status)
        lines += [
            f"Test {i}: {why}.",
            f"Input:\n{_shown(r.test.input) or '(none)'}",
            f"Expected output:\n{_shown(r.test.output)}",
            f"Your output:\n{_shown(r.execution.stdout) or '(nothing)'}",
        ]
        if status != "ok" and r.execution.stderr.strip():
            lines.append(f"Error:\n{_shown(r.execution.stderr.strip().splitlines()[-1])}")
    return "\n".join(lines)
