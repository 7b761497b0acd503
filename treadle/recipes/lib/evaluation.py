"""Held-out evaluation: greedy answers from a sampler, graded, as one accuracy number.

Every request is submitted before any result is read, so the worker's sampler batches them all
into one decode loop instead of answering one round trip at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from tqdm import tqdm

from treadle.recipes.lib.math_tasks import Problem, grade
from treadle.recipes.lib.rendering import render_generation_prompt
from treadle.types import ModelInput, SamplingParams


@dataclass
class EvalResult:
    accuracy: float
    responses: list[str]


def prompt_messages(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": question}]


def question_prompt(tokenizer: Any, question: str, system_prompt: str | None) -> list[int]:
    """The tokens of a one-question conversation, up to the assistant's turn: what a sampler continues."""
    return render_generation_prompt(tokenizer, prompt_messages(question, system_prompt))


class AnswerConfig(Protocol):
    """The fields of a recipe's config that say how a question is asked and answered."""

    system_prompt: str | None
    max_tokens: int
    stop: list[str]


def evaluate_problems(
    sampler: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    cfg: AnswerConfig,
    step: int,
    first_line_only: bool = True,
) -> EvalResult:
    """Greedy (`top_k=1`) accuracy of `sampler` (the policy after `step`) on `problems`, asked as `cfg` says."""
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, top_k=1, stop=cfg.stop, seed=0)
    futures = [
        sampler.sample(
            ModelInput.from_ints(question_prompt(tokenizer, p.question, cfg.system_prompt)),
            num_samples=1,
            sampling_params=params,
        )
        for p in problems
    ]
    responses, correct = [], 0.0
    # No bar in a log file (disable=None: only on a terminal), where nested bars come out garbled.
    for problem, future in tqdm(list(zip(problems, futures)), desc=f"eval @ step {step}", leave=False, disable=None):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True)
        responses.append(text)
        correct += grade(text, problem.answer, first_line_only)
    return EvalResult(accuracy=correct / len(problems), responses=responses)
