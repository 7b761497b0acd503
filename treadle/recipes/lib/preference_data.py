"""Small offline preference datasets over the arithmetic task, written by code (no model, no download).

The feedback is binary and comes from the task's own grader (`math_tasks.grade`): a response is
desirable (thumbs up) when its answer is right. Right responses are short ("3 + 4 = 7"); wrong ones
are either a wrong number in the same form ("3 + 4 = 8") or the chatty non-answer that small
instruct models tend to give within a short token budget ("To find 3 + 4, we add ..."). Both kinds
are what a grader turns down on real samples.

- DPO pairs, JSONL rows `{"prompt", "chosen", "rejected"}` (TRL's preference layout, prompt = question);
- KTO examples, rows `{"prompt", "completion", "label"}` (TRL's unpaired layout; label true = desirable);
- SFT conversations, rows `{"messages": [...]}` of right answers (e.g. to train a distillation teacher).

Training rows come from `arithmetic_problem_at` (never a held-out question); `heldout=True` draws
from the fixed held-out set instead, for evaluation.

    python -m treadle.recipes.lib.preference_data --out_dir data/arith --pairs 256
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass

from pydantic import BaseModel, Field

from treadle.config import parse_config
from treadle.recipes.lib.math_tasks import Problem, arithmetic_heldout, arithmetic_problem_at, grade

_CHATTY = (
    "To find {expr}, we need to look at the two numbers carefully.",
    "Let's solve {expr} step by step. First, we",
    "Sure! To calculate {expr}, let's break it down:",
)


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class KTOExample:
    prompt: str
    completion: str
    label: bool


def _expression(question: str) -> str:
    """'What is 3 + 4?' -> '3 + 4'."""
    match = re.fullmatch(r"What is (.+)\?", question)
    if match is None:
        raise ValueError(f"not an arithmetic question: {question!r}")
    return match.group(1)


def right_response(problem: Problem) -> str:
    return f"{_expression(problem.question)} = {problem.answer}"


def wrong_response(problem: Problem, rng: random.Random) -> str:
    """A response the grader turns down: a near-miss number, or a chatty start with no answer."""
    expr = _expression(problem.question)
    while True:
        if rng.random() < 0.5:
            response = f"{expr} = {max(0, problem.answer + rng.choice([-2, -1, 1, 2]))}"
        else:
            response = rng.choice(_CHATTY).format(expr=expr)
        if grade(response, problem.answer) == 0.0:
            return response


def _problems(n: int, seed: int, heldout: bool, max_operand: int) -> list[Problem]:
    if heldout:
        return arithmetic_heldout(n, max_operand)
    return [arithmetic_problem_at(seed, i, max_operand) for i in range(n)]


def arithmetic_pairs(n: int, seed: int = 0, heldout: bool = False, max_operand: int = 9) -> list[PreferencePair]:
    """`n` pairs: the right response chosen, a wrong one rejected (labels checked by the grader)."""
    rng = random.Random(f"pairs:{seed}:{heldout}")
    return [
        PreferencePair(p.question, right_response(p), wrong_response(p, rng))
        for p in _problems(n, seed, heldout, max_operand)
    ]


def arithmetic_kto_examples(
    n: int, seed: int = 0, desirable_fraction: float = 0.5, max_operand: int = 9
) -> list[KTOExample]:
    """`n` unpaired examples, each one response to its own problem, labelled by the grader."""
    rng = random.Random(f"kto:{seed}")
    examples = []
    for problem in _problems(n, seed, False, max_operand):
        response = right_response(problem) if rng.random() < desirable_fraction else wrong_response(problem, rng)
        examples.append(KTOExample(problem.question, response, grade(response, problem.answer) == 1.0))
    return examples


def arithmetic_sft_conversations(n: int, seed: int = 0, max_operand: int = 9) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": p.question}, {"role": "assistant", "content": right_response(p)}]}
        for p in _problems(n, seed, False, max_operand)
    ]


def write_jsonl(path: str, rows: list) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row if isinstance(row, dict) else row.__dict__) + "\n" for row in rows)
    return path


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_pairs(path: str) -> list[PreferencePair]:
    return [PreferencePair(r["prompt"], r["chosen"], r["rejected"]) for r in _rows(path)]


def load_kto_examples(path: str) -> list[KTOExample]:
    return [KTOExample(r["prompt"], r["completion"], bool(r["label"])) for r in _rows(path)]


class Config(BaseModel):
    """Write the arithmetic preference, KTO and SFT files."""

    out_dir: str = Field(default="data/arithmetic", description="Directory of the JSONL files.")
    pairs: int = Field(default=256, ge=1, description="DPO training pairs (and KTO examples, and SFT conversations).")
    heldout_pairs: int = Field(default=50, ge=1, description="Held-out DPO pairs (from the fixed held-out questions).")
    seed: int = Field(default=0, description="Seed of the problem stream and of the wrong answers.")


if __name__ == "__main__":
    cfg = parse_config(Config, prog="python -m treadle.recipes.lib.preference_data")
    for name, rows in (
        ("dpo_train.jsonl", arithmetic_pairs(cfg.pairs, cfg.seed)),
        ("dpo_heldout.jsonl", arithmetic_pairs(cfg.heldout_pairs, cfg.seed, heldout=True)),
        ("kto_train.jsonl", arithmetic_kto_examples(cfg.pairs, cfg.seed)),
        ("sft_train.jsonl", arithmetic_sft_conversations(cfg.pairs, cfg.seed)),
    ):
        print(write_jsonl(os.path.join(cfg.out_dir, name), rows))
