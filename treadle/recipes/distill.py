"""On-policy distillation: the student samples, the teacher scores the student's tokens, the student
trains on the per-token reverse KL as its advantage (as the Tinker cookbook does).

Each step snapshots the student, samples `samples_per_prompt` completions of `prompts_per_batch`
prompts, and asks the teacher for the logprob of every sampled token (`compute_logprobs` on
prompt + completion). The per-token reverse KL estimate is log p_student - log p_teacher at the
sampled token; its negative (times `kl_coef`) is that token's advantage under `importance_sampling`,
so the student is pushed towards the teacher exactly where it went wrong, on its own samples.

The teacher is a sampler on any checkpoint (`--teacher_path`, e.g. an SFT run's state) or on a base
model served by any worker (`--teacher_model`); it must share the student's tokenizer. Held-out
metric: the same per-token KL on samples of fixed held-out prompts, and greedy arithmetic accuracy.

    python -m treadle.recipes.distill --teacher_path treadle://<run>/weights/step-000020 --log_dir runs/distill
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
from pydantic import Field

from treadle import Datum, ModelInput, SamplingParams, ServiceClient
from treadle.config import parse_config
from treadle.recipes.lib.datums import rl_datum
from treadle.recipes.lib.evaluation import evaluate_problems, question_prompt
from treadle.recipes.lib.loop import Run, adam, end_step, eval_before_training, start_run, steps
from treadle.recipes.lib.math_tasks import Problem, arithmetic_heldout, arithmetic_problem_at
from treadle.recipes.lib.preference import RunResult, finish_run
from treadle.recipes.lib.run_log import RunConfig


class Config(RunConfig):
    """On-policy distillation of a teacher into a LoRA student, through the treadle SDK."""

    base_model: str = Field(default="SmolLM2-135M-Instruct", description="The student's base model.")
    teacher_path: str | None = Field(default=None, description="Checkpoint the teacher samples from (treadle://...).")
    teacher_model: str | None = Field(
        default=None, description="Base model of the teacher when no teacher_path (None: base_model)."
    )
    log_dir: str = Field(default="runs/distill", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    prompts_path: str | None = Field(
        default=None, description="JSONL of {prompt}; the last eval_prompts rows are held out. None: arithmetic."
    )
    max_operand: int = Field(default=9, ge=1, description="Arithmetic: operands are drawn from [0, max_operand].")
    system_prompt: str | None = Field(default=None, description="System message (None: the chat template's default).")
    prompts_per_batch: int = Field(default=8, ge=1, description="Prompts per step.")
    samples_per_prompt: int = Field(default=4, ge=1, description="Student completions per prompt.")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens per completion.")
    temperature: float = Field(default=1.0, gt=0.0, description="Sampling temperature of the student.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Stop strings of samples and eval.")
    kl_coef: float = Field(
        default=1.0, gt=0.0, description="Advantage of a token = -kl_coef * (log p_student - log p_teacher)."
    )
    # On-policy, a constant subtracted from every token's advantage leaves the expected gradient as it is and
    # cuts its variance: a student far from its teacher samples tokens that all carry about the same large KL.
    kl_baseline: bool = Field(
        default=True, description="Subtract the batch's mean per-token KL from each token's (a baseline)."
    )
    eval_prompts: int = Field(default=50, ge=1, description="Held-out prompts of the KL (and accuracy) eval.")
    eval_samples: int = Field(default=2, ge=1, description="Student samples per held-out prompt in the KL eval.")
    arithmetic_eval: bool = Field(default=True, description="Arithmetic: also measure greedy held-out accuracy.")


@dataclass
class Scored:
    """One student completion with the teacher's logprobs of its tokens."""

    prompt: list[int]
    tokens: list[int]
    student: np.ndarray
    teacher: np.ndarray


def sample_and_score(
    student: Any, teacher: Any, prompts: Sequence[list[int]], params: list[SamplingParams], n: int
) -> list[Scored]:
    """`n` student samples of each prompt, each scored by the teacher; every request is in flight at once."""
    samples = [student.sample(ModelInput.from_ints(p), n, sp) for p, sp in zip(prompts, params)]
    pending = []
    for prompt, future in zip(prompts, samples):
        for seq in future.result().sequences:
            if seq.tokens:  # an empty completion has no token to score
                pending.append((prompt, seq, teacher.compute_logprobs(ModelInput.from_ints([*prompt, *seq.tokens]))))
    return [
        Scored(
            prompt,
            list(seq.tokens),
            np.asarray(seq.logprobs, np.float64),
            np.asarray(f.result()[len(prompt) :], np.float64),
        )
        for prompt, seq, f in pending
    ]


def reverse_kl_datum(s: Scored, kl_coef: float, baseline: float = 0.0) -> Datum:
    """An importance_sampling datum whose completion tokens carry -kl_coef * (log p_student - log p_teacher - baseline)."""
    datum = rl_datum(s.prompt, s.tokens, s.student.tolist(), 0.0)
    advantages = np.concatenate([np.zeros(len(s.prompt) - 1), -kl_coef * (s.student - s.teacher - baseline)]).astype(
        np.float32
    )
    return Datum(model_input=datum.model_input, loss_fn_inputs={**datum.loss_fn_inputs, "advantages": advantages})


def mean_token_kl(scored: Sequence[Scored]) -> float:
    """Per-token reverse KL estimate over all sampled tokens (log p_student - log p_teacher, averaged)."""
    return float(np.concatenate([s.student - s.teacher for s in scored]).mean())


def prompt_source(cfg: Config) -> tuple[Callable[[int], str], list[str], list[Problem]]:
    """Training prompt by index (random access, so a resumed run continues the stream), held-out prompts, their problems."""
    if cfg.prompts_path:
        with open(cfg.prompts_path) as f:
            questions = [json.loads(line)["prompt"] for line in f if line.strip()]
        if len(questions) <= cfg.eval_prompts:
            raise ValueError(
                f"eval_prompts={cfg.eval_prompts} leaves no training prompt out of {len(questions)} in {cfg.prompts_path}"
            )
        train = questions[: -cfg.eval_prompts]
        return (lambda i: train[i % len(train)]), questions[-cfg.eval_prompts :], []
    problems = arithmetic_heldout(cfg.eval_prompts, cfg.max_operand)
    return (
        (lambda i: arithmetic_problem_at(cfg.seed, i, cfg.max_operand).question),
        [p.question for p in problems],
        problems,
    )


@dataclass(frozen=True)
class Heldout:
    """The held-out prompts (rendered), and their arithmetic problems when the prompts are arithmetic's."""

    prompts: list[list[int]]
    problems: list[Problem]


def evaluate(run: Run, teacher: Any, tokenizer: Any, heldout: Heldout, cfg: Config, step: int) -> dict[str, float]:
    """The student's per-token KL to the teacher on samples of the held-out prompts, and its greedy accuracy on
    their problems, from a named sampler snapshot of `step`."""
    path = run.training.save_weights_for_sampler(f"step-{step:06d}").result().path
    run.log.record_sampler(path, step)
    student = run.training.create_sampling_client(path)
    # The same seeds at every eval, so the estimates differ by the student, not by the draw.
    params = [
        SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, stop=cfg.stop, seed=i)
        for i in range(len(heldout.prompts))
    ]
    scored = sample_and_score(student, teacher, heldout.prompts, params, cfg.eval_samples)
    metrics = {"eval/kl_student_teacher": mean_token_kl(scored)}
    if heldout.problems and cfg.arithmetic_eval:
        metrics["eval/accuracy"] = evaluate_problems(student, tokenizer, heldout.problems, cfg, step).accuracy
    return metrics


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    service = service or ServiceClient()
    run = start_run(service, cfg)  # its log, and a fresh session or the last checkpoint's
    training, tokenizer = run.training, run.training.get_tokenizer()
    teacher = (
        service.create_sampling_client(model_path=cfg.teacher_path)
        if cfg.teacher_path
        else service.create_sampling_client(base_model=cfg.teacher_model or cfg.base_model)
    )

    # ---------------------------------------------------------------- prompts: a stream by index, and a fixed held-out set
    question_at, heldout_questions, problems = prompt_source(cfg)
    heldout = Heldout([question_prompt(tokenizer, q, cfg.system_prompt) for q in heldout_questions], problems)
    evaluate_now = partial(evaluate, run, teacher, tokenizer, heldout, cfg)
    eval_before_training(run, evaluate_now)

    for step in (progress := steps(run, cfg.steps, "distill")):
        started = time.monotonic()
        # ------------------------------------------------------------ the student samples, the teacher scores
        student = training.save_weights_and_get_sampling_client()
        first = (step - 1) * cfg.prompts_per_batch  # a step's prompts are a pure function of it: --resume continues
        questions = [question_at(i) for i in range(first, first + cfg.prompts_per_batch)]
        prompts = [question_prompt(tokenizer, q, cfg.system_prompt) for q in questions]
        params = [
            SamplingParams(
                max_tokens=cfg.max_tokens,
                temperature=cfg.temperature,
                stop=cfg.stop,
                seed=cfg.seed * 1_000_003 + first + k,
            )
            for k in range(len(prompts))
        ]
        scored = sample_and_score(student, teacher, prompts, params, cfg.samples_per_prompt)
        sampled = time.monotonic()

        # ------------------------------------------------------------ train on the per-token reverse KL
        baseline = mean_token_kl(scored) if cfg.kl_baseline else 0.0
        fwd_bwd = training.forward_backward(
            [reverse_kl_datum(s, cfg.kl_coef, baseline) for s in scored], "importance_sampling"
        )
        optim = training.optim_step(adam(cfg))
        fwd_bwd.result(), optim.result()
        metrics = {
            "kl/student_teacher": mean_token_kl(scored),
            "tokens": sum(len(s.tokens) for s in scored),
            "time/sample_and_score": sampled - started,
            "time/step": time.monotonic() - started,
        }
        end_step(run, step, metrics, evaluate_now)
        progress.set_postfix(kl=f"{metrics['kl/student_teacher']:.3f}")

    # ---------------------------------------------------------------- curve and summary
    return finish_run(
        run,
        "distillation",
        ["kl/student_teacher", "eval/kl_student_teacher", "eval/accuracy"],
        "eval/kl_student_teacher",
    )


if __name__ == "__main__":
    print(main(parse_config(Config, prog="python -m treadle.recipes.distill")).summary())
