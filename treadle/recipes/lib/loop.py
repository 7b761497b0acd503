"""The skeleton every recipe's training loop shares, so that a recipe's `main` holds only what is its own.

A recipe reads top to bottom as:

    run = start_run(service, cfg)               # its log, and a fresh session or the last checkpoint's
    ...data, the held-out eval...
    eval_before_training(run, evaluate)         # step 0's row
    for step in steps(run, cfg.steps, "GRPO"):
        ...the recipe's own step: sample, grade, forward_backward, optim_step...
        end_step(run, step, metrics, evaluate, position=...)
    return close_run(run, "GRPO", curve, eval_key)

`end_step` runs the held-out eval when it is due, and writes the step's metrics row, with a checkpoint
when one is due, in the one order that a kill at any moment cannot corrupt (see its docstring).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from pydantic import Field
from tqdm import tqdm

from treadle import AdamParams
from treadle.recipes.lib.off_policy import StalePolicy
from treadle.recipes.lib.plot import plot_metrics
from treadle.recipes.lib.run_log import RunConfig, RunLog


class LoopConfig(Protocol):
    """The fields of a recipe's config that the loop reads."""

    base_model: str
    lora_rank: int
    full: bool
    seed: int
    resume: bool
    steps: int
    eval_every: int
    save_every: int
    learning_rate: float


class GroupRLConfig(RunConfig):
    """The fields the GRPO recipes share (math_rl, code_rl): groups of samples per problem, the prompt and its
    sampling, and the async mode's staleness rules. Each recipe adds its task and its policy loss."""

    system_prompt: str | None = Field(default=None, description="System message (None: the chat template's default).")
    groups_per_batch: int = Field(default=8, ge=1, description="Problems (groups) per step.")
    group_size: int = Field(default=8, ge=2, description="Completions sampled per problem (K).")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens per completion.")
    temperature: float = Field(default=1.0, gt=0.0, description="Sampling temperature of rollouts.")
    normalize_std: bool = Field(default=False, description="Divide group advantages by the group's reward std.")
    save_every: int = Field(default=5, ge=1, description="save_state every N steps (and at the end).")
    mode: Literal["sync", "async"] = Field(
        default="sync", description="On-policy steps, or rollouts kept in flight while training (off-policy)."
    )
    max_steps_off_policy: int = Field(default=1, ge=0, description="Async: staleness limit of a group, in steps.")
    stale_policy: StalePolicy = Field(default="requeue", description="Async: what happens to a staler group.")


@dataclass
class Run:
    """A run's training client, its log and config, the first step it runs, and its last checkpoint (resumed
    from, or saved by `end_step`), with the loop position saved beside it (e.g. a data cursor)."""

    training: Any
    log: RunLog
    cfg: LoopConfig
    step: int
    state_path: str = ""
    position: dict[str, Any] = field(default_factory=dict)


def start_run(service: Any, cfg: LoopConfig, init_state: str | None = None) -> Run:
    """The run's log (`RunLog.for_config`) and session: from the last checkpoint with `cfg.resume` (weights and
    optimizer, and the logged steps after it dropped), else a fresh LoRA (`cfg.full`: a full fine-tuning session),
    or the weights of the `init_state` checkpoint."""
    log = RunLog.for_config(cfg)
    last = log.last_checkpoint() if cfg.resume else None
    if last is None:
        log.rewind_to(-1)  # --resume before the first checkpoint: start over
        if init_state:
            training = service.create_training_client_from_state(init_state)
        elif cfg.full:
            training = service.create_full_training_client(cfg.base_model)
        else:
            training = service.create_lora_training_client(
                cfg.base_model, rank=cfg.lora_rank, alpha=2 * cfg.lora_rank, seed=cfg.seed
            )
        return Run(training, log, cfg, 1)
    log.rewind_to(last.step)
    print(f"resuming from {last.state_path} after step {last.step}")
    training = service.create_training_client_from_state_with_optimizer(last.state_path)
    return Run(training, log, cfg, last.step + 1, last.state_path, last.extra)


def eval_before_training(run: Run, evaluate: Callable[[int], dict[str, float]]) -> dict[str, float] | None:
    """A fresh run's held-out eval before any training, logged as step 0 (a resumed run has its row already)."""
    if run.step > 1:
        return None
    metrics = evaluate(0)
    run.log.log_metrics(0, metrics)
    return metrics


def steps(run: Run, last_step: int, desc: str) -> tqdm:
    """The steps still to run, with a progress bar that counts the ones a resumed run has done."""
    return tqdm(range(run.step, last_step + 1), desc=desc, initial=run.step - 1, total=last_step)


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """Example indices of `step` (1-based): epochs in a fresh seeded order, a pure function of step (so a
    resumed run continues the order)."""
    indices = []
    for position in range((step - 1) * batch_size, step * batch_size):
        epoch, offset = divmod(position, n)
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[offset])
    return indices


def adam(cfg: LoopConfig) -> AdamParams:
    return AdamParams(learning_rate=cfg.learning_rate, eps=1e-8)


def end_step(
    run: Run,
    step: int,
    metrics: dict[str, float],
    evaluate: Callable[[int], dict[str, float]],
    *,
    position: dict[str, Any] | None = None,
    started: float | None = None,
) -> None:
    """End `step`: the held-out eval when due, then its metrics row, with a checkpoint when due (then the run's
    `state_path`). `position`: what the loop needs to continue from the checkpoint; `started`: the step's start
    (`time.monotonic()`), for `time/step`.

    A checkpoint's save_state comes first, then the step's row, then the resume point: a kill between the
    row and the resume point resumes from the previous checkpoint (the row is dropped, the step runs again),
    where the other order would resume past a row never written."""
    cfg, log = run.cfg, run.log
    if is_due(step, cfg.eval_every, cfg.steps):
        metrics.update(evaluate(step))
    saving = is_due(step, cfg.save_every, cfg.steps)
    if saving:
        saved = time.monotonic()
        run.state_path = run.training.save_state(f"step-{step:06d}").result().path
        metrics["time/save"] = time.monotonic() - saved
    if started is not None:
        metrics["time/step"] = time.monotonic() - started
    log.log_metrics(step, metrics)
    if saving:
        log.record_checkpoint(f"step-{step:06d}", step, run.state_path, position)


def is_due(step: int, every: int, last_step: int) -> bool:
    """Whether a periodic action (eval, save) runs after `step`: every `every` steps (0: never) and after the last."""
    return step == last_step or bool(every and step % every == 0)


@dataclass
class RunResult:
    """What a run returns: its first and last held-out score, and where its last state, metrics and curve are."""

    eval_before: float
    eval_after: float
    final_state_path: str
    metrics_path: str
    png_path: str


def close_run(run: Run, name: str, curve: list[str], eval_key: str) -> RunResult:
    """Plot `curve` (titled `name` and the base model), close the log (and its MLflow run), and sum the run up
    by `eval_key` in its eval rows."""
    log = run.log
    title = f"{name} ({run.cfg.base_model})"
    png_path = plot_metrics(log.metrics_path, f"{log.log_dir}/curve.png", curve, title=title)
    log.close()
    evals = [row[eval_key] for row in log.metrics() if eval_key in row]
    return RunResult(evals[0], evals[-1], run.state_path, log.metrics_path, png_path)
