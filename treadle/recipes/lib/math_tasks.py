"""Math problems with checkable integer answers: synthetic arithmetic (offline, from a seed) and GSM8K.

Synthetic problems are drawn from a small space, so the held-out set is carved out of it by a hash
of the question text: the held-out questions are never drawn for training, whatever the seeds.
Short answers are graded from the first line of the response: its last integer must equal the
answer, which accepts both "12" and "7 + 5 = 12". Chain-of-thought answers (GSM8K) are graded from
the last integer of the whole response.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass

HELDOUT_FRACTION = 0.3


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def is_heldout(question: str) -> bool:
    """Whether a question belongs to the fixed held-out split (stable across runs and machines)."""
    digest = hashlib.sha256(question.encode()).digest()
    return digest[0] < 256 * HELDOUT_FRACTION


def arithmetic_problem(rng: random.Random, max_operand: int = 9) -> Problem:
    """`a + b` or `a - b` (never negative) with operands in [0, max_operand]."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return Problem(f"What is {a} + {b}?", a + b)
    a, b = max(a, b), min(a, b)
    return Problem(f"What is {a} - {b}?", a - b)


def arithmetic_problem_at(seed: int, index: int, max_operand: int = 9) -> Problem:
    """Training problem number `index` of the stream of `seed` (held-out questions never appear).

    Random access by index, not an iterator, so a resumed run continues the stream exactly.
    """
    rng = random.Random(f"{seed}:{index}")
    while True:
        problem = arithmetic_problem(rng, max_operand)
        if not is_heldout(problem.question):
            return problem


def arithmetic_heldout(n: int, max_operand: int = 9) -> list[Problem]:
    """The first `n` distinct held-out problems of a fixed stream: the same set on every run."""
    rng = random.Random(0)
    seen: dict[str, Problem] = {}
    for _ in range(100_000):
        problem = arithmetic_problem(rng, max_operand)
        if is_heldout(problem.question):
            seen.setdefault(problem.question, problem)
            if len(seen) == n:
                return list(seen.values())
    raise ValueError(
        f"only {len(seen)} distinct held-out problems exist with max_operand={max_operand}; asked for n={n}"
    )


_INT = re.compile(r"-?\d[\d,]*")


def parse_answer(response: str, first_line_only: bool = True) -> int | None:
    """The last integer of the response's first line (or of all of it), thousands separators allowed."""
    lines = response.strip().splitlines()
    text = (lines[0] if lines else "") if first_line_only else response
    found = _INT.findall(text)
    if not found:
        return None
    return int(found[-1].replace(",", ""))


def grade(response: str, answer: int, first_line_only: bool = True) -> float:
    """1.0 if the response's answer is right, else 0.0."""
    return 1.0 if parse_answer(response, first_line_only) == answer else 0.0


def reward(response: str, answer: int, format_reward: float = 0.0, first_line_only: bool = True) -> float:
    """1.0 for a right answer; `format_reward` for a wrong one that still gives an integer; else 0.0.

    A small format reward gives a model that rarely answers at all something to climb first.
    """
    parsed = parse_answer(response, first_line_only)
    if parsed == answer:
        return 1.0
    return format_reward if parsed is not None else 0.0


def gsm8k_answer(solution: str) -> int:
    """GSM8K's final answer: the number after `#### ` at the end of the reference solution."""
    match = re.search(r"####\s*(-?[\d,]+)", solution)
    if match is None:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return int(match.group(1).replace(",", ""))


def load_gsm8k(path: str | None = None, split: str = "train") -> list[Problem]:
    """GSM8K from a local JSONL (`question`, `answer` fields) or, online, from HF datasets."""
    if path is not None:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        from datasets import load_dataset  # optional, online only

        rows = list(load_dataset("openai/gsm8k", "main", split=split))
    return [Problem(row["question"], gsm8k_answer(row["answer"])) for row in rows]
