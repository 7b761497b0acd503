"""GRPO on math problems with checkable answers: synthetic arithmetic (offline) or GSM8K.

Each step samples `group_size` completions for each of `groups_per_batch` problems from a frozen
snapshot of the policy, rewards each completion 1 if its answer is right, centres the rewards within
the group (GRPO), and trains on the completions with `importance_sampling`, `ppo` or `cispo`.
A group's forward_backward is submitted as soon as its samples are graded (streaming), and
optim_step right after the last one, so the worker never waits for this loop.

`--mode async` keeps `async_groups_in_flight` groups being sampled while steps train, so a group
may have been sampled by a policy some steps old. Groups up to `max_steps_off_policy` stale are used
(the importance ratio corrects for the gap); staler ones are requeued (their problem sampled again
by the current policy) or discarded (`--stale_policy`). Every group's fate is logged to
rollouts.jsonl with the policy version that sampled it.

    python -m treadle.recipes.math_rl --base_model SmolLM2-135M-Instruct --steps 20 --log_dir runs/rl
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Literal

from pydantic import Field

from treadle import Datum, ModelInput, SamplingParams, ServiceClient
from treadle.recipes import loop
from treadle.recipes.advantages import group_advantages, is_informative, kl_penalized_reward, kl_sample_ref
from treadle.recipes.cli import parse_config
from treadle.recipes.datums import rl_datum
from treadle.recipes.evaluation import evaluate_problems, prompt_messages
from treadle.recipes.loop import GroupRLConfig, adam, close_run, end_step, eval_before_training, start_run, steps
from treadle.recipes.math_tasks import Problem, arithmetic_heldout, arithmetic_problem_at, load_gsm8k, reward
from treadle.recipes.off_policy import Group, ProblemStream, SampledCompletion, staleness, staleness_action
from treadle.recipes.rendering import render_generation_prompt
from treadle.recipes.run_log import RunLog


class Config(GroupRLConfig):
    """GRPO on arithmetic word problems or GSM8K, through the treadle SDK."""

    log_dir: str = Field(default="runs/math_rl", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    task: Literal["arithmetic", "gsm8k"] = Field(default="arithmetic", description="Synthetic arithmetic or GSM8K.")
    max_operand: int = Field(default=9, ge=1, description="Arithmetic: operands are drawn from [0, max_operand].")
    gsm8k_train_path: str | None = Field(
        default=None, description="GSM8K train JSONL (question/answer); None: HF datasets."
    )
    gsm8k_eval_path: str | None = Field(default=None, description="GSM8K test JSONL; None: HF datasets.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Stop strings of rollouts and eval.")
    learning_rate: float = Field(default=3e-4, gt=0.0, description="AdamW learning rate.")
    loss_fn: Literal["importance_sampling", "ppo", "cispo"] = Field(
        default="importance_sampling", description="Policy loss."
    )
    format_reward: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Reward of a wrong answer that is still an integer."
    )
    kl_penalty_coef: float = Field(
        default=0.0, ge=0.0, description="Subtract coef * KL(policy || base) from each reward."
    )
    eval_problems: int = Field(default=50, ge=1, description="Size of the fixed held-out set.")
    async_groups_in_flight: int = Field(default=16, ge=1, description="Async: groups being sampled at any time.")


@dataclass
class RunResult(loop.RunResult):
    eval_seconds: list[float]  # how long each held-out eval of this process took


@dataclass
class InFlight:
    """A group being sampled: K completions of problem `index` from the snapshot of `policy_version`."""

    index: int
    problem: Problem
    prompt: list[int]
    policy_version: int
    samples: Any  # the future of its SampleResponse


@dataclass
class Rollouts:
    """The sampling side of the loop: the snapshot being sampled and its version (the step that made it), the
    problems to sample next, and the groups being sampled now, oldest first."""

    sampler: Any
    version: int
    stream: ProblemStream
    in_flight: deque[InFlight] = field(default_factory=deque)


@dataclass
class StepBatch:
    """What one step streamed into forward_backward, and the bookkeeping of the groups it read."""

    fwd_futures: list[Any] = field(default_factory=list)
    datums_by_call: list[list[Datum]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    stalenesses: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"use": 0, "requeue": 0, "discard": 0, "skipped": 0})
    tokens: int = 0
    sample_wait: float = 0.0


def problem_source(cfg: Config):
    """Training problem by index (random access, so a resumed run continues the stream) and the eval set."""
    if cfg.task == "arithmetic":
        return (lambda i: arithmetic_problem_at(cfg.seed, i, cfg.max_operand)), arithmetic_heldout(
            cfg.eval_problems, cfg.max_operand
        )
    train = load_gsm8k(cfg.gsm8k_train_path, "train")
    order = list(range(len(train)))
    random.Random(cfg.seed).shuffle(order)
    return (lambda i: train[order[i % len(train)]]), load_gsm8k(cfg.gsm8k_eval_path, "test")[: cfg.eval_problems]


def first_line_only(cfg: Config) -> bool:
    return cfg.task == "arithmetic"  # GSM8K answers come after a chain of thought


def evaluate(
    sampler: Any, tokenizer: Any, heldout: list[Problem], cfg: Config, log: RunLog, step: int
) -> dict[str, float]:
    """Greedy held-out accuracy of the snapshot `sampler`; each answer goes to eval_samples.jsonl."""
    started = time.monotonic()
    result = evaluate_problems(sampler, tokenizer, heldout, cfg, step, first_line_only(cfg))
    for problem, response in zip(heldout, result.responses):
        log.append(
            "eval_samples.jsonl", step, {"question": problem.question, "answer": problem.answer, "response": response}
        )
    return {"eval/accuracy": result.accuracy, "time/eval": time.monotonic() - started}


def top_up(rollouts: Rollouts, target: int, problem_at: Callable[[int], Problem], tokenizer: Any, cfg: Config) -> None:
    """Keep `target` groups being sampled from the current snapshot (requeued problems first): futures, not waits."""
    while len(rollouts.in_flight) < target:
        index = rollouts.stream.next_index()
        problem = problem_at(index)
        prompt = render_generation_prompt(tokenizer, prompt_messages(problem.question, cfg.system_prompt))
        params = SamplingParams(
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            stop=cfg.stop,
            seed=cfg.seed * 1_000_003 + index * 7919 + rollouts.version,
        )
        samples = rollouts.sampler.sample(ModelInput.from_ints(prompt), cfg.group_size, params)
        rollouts.in_flight.append(InFlight(index, problem, prompt, rollouts.version, samples))


def grade_group(group: InFlight, tokenizer: Any, cfg: Config) -> Group:
    """Wait for a group's completions and reward each: 1 for the right answer (`format_reward` for another integer)."""
    completions = []
    for seq in group.samples.result().sequences:
        text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        completions.append(
            SampledCompletion(
                seq.tokens,
                seq.logprobs,
                reward(text, group.problem.answer, cfg.format_reward, first_line_only(cfg)),
                text,
            )
        )
    return Group(group.index, group.prompt, completions, group.policy_version)


def kl_against_reference(reference: Any, group: Group) -> list[float]:
    """Each completion's sampled KL(policy || base), from the base model's logprobs of its tokens."""
    futures = [reference.compute_logprobs(ModelInput.from_ints(group.prompt + c.tokens)) for c in group.completions]
    return [kl_sample_ref(c.logprobs, f.result()[len(group.prompt) :]) for c, f in zip(group.completions, futures)]


def stream_groups(
    training: Any,
    rollouts: Rollouts,
    reference: Any,
    problem_at: Callable[[int], Problem],
    tokenizer: Any,
    log: RunLog,
    step: int,
    cfg: Config,
) -> StepBatch:
    """Read graded groups, oldest first, until `groups_per_batch` are used, submitting each one's forward_backward
    as soon as it is graded. A staler group than `max_steps_off_policy` is requeued or discarded; a group whose
    advantages are all zero (every reward equal) has nothing to teach and is skipped."""
    batch, used = StepBatch(), 0
    while used < cfg.groups_per_batch:
        if cfg.mode == "async":
            top_up(rollouts, cfg.async_groups_in_flight, problem_at, tokenizer, cfg)
        waited = time.monotonic()
        group = grade_group(rollouts.in_flight.popleft(), tokenizer, cfg)
        batch.sample_wait += time.monotonic() - waited
        action = staleness_action(group.policy_version, rollouts.version, cfg.max_steps_off_policy, cfg.stale_policy)
        batch.counts[action] += 1
        log.append(
            "rollouts.jsonl",
            step,
            {
                "problem_index": group.problem_index,
                "policy_version": group.policy_version,
                "trained_at_version": rollouts.version,
                "staleness": staleness(group.policy_version, rollouts.version),
                "action": action,
                "reward_mean": sum(c.reward for c in group.completions) / len(group.completions),
            },
        )
        if action == "requeue":
            rollouts.stream.pending.append(group.problem_index)
        if action != "use":
            continue
        used += 1
        batch.stalenesses.append(staleness(group.policy_version, rollouts.version))
        rewards = [c.reward for c in group.completions]
        batch.rewards += rewards
        if reference is not None:
            kls = kl_against_reference(reference, group)
            batch.kls += kls
            rewards = [kl_penalized_reward(r, kl, cfg.kl_penalty_coef) for r, kl in zip(rewards, kls)]
        advantages = group_advantages(rewards, cfg.normalize_std)
        if not is_informative(advantages):
            batch.counts["skipped"] += 1
            continue
        datums = [
            rl_datum(group.prompt, c.tokens, c.logprobs, a) for c, a in zip(group.completions, advantages) if c.tokens
        ]
        batch.tokens += sum(d.model_input.length for d in datums)
        batch.fwd_futures.append(training.forward_backward(datums, cfg.loss_fn))
        batch.datums_by_call.append(datums)
    return batch


def read_results(batch: StepBatch) -> tuple[float, list[float]]:
    """The step's summed loss, and sampler-minus-trainer logprob differences of the trained tokens."""
    loss, diffs = 0.0, []
    for future, datums in zip(batch.fwd_futures, batch.datums_by_call):
        output = future.result()
        loss += output.metrics.get("loss:sum", 0.0)
        for datum, out in zip(datums, output.loss_fn_outputs):
            advantages = datum.loss_fn_inputs["advantages"].to_numpy()
            sampled = datum.loss_fn_inputs["logprobs"].to_numpy()[advantages != 0]
            diffs += (sampled - out["logprobs"].to_numpy()[advantages != 0]).tolist()
    return loss, diffs


def step_metrics(batch: StepBatch, loss: float, diffs: list[float], train_wait: float) -> dict[str, float]:
    rewards, stalenesses, counts = batch.rewards, batch.stalenesses, batch.counts
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "accuracy/train": sum(r == 1.0 for r in rewards) / len(rewards),
        "loss:sum": loss,
        "tokens": batch.tokens,
        "groups/used": counts["use"],
        "groups/skipped_uniform": counts["skipped"],
        "groups/requeued": counts["requeue"],
        "groups/discarded": counts["discard"],
        "async/staleness_max": max(stalenesses),
        "async/staleness_mean": sum(stalenesses) / len(stalenesses),
        "optim/kl_sample_train_v1": sum(diffs) / len(diffs) if diffs else 0.0,
        "optim/kl_sample_train_v2": 0.5 * sum(d * d for d in diffs) / len(diffs) if diffs else 0.0,
        **({"kl/policy_base": sum(batch.kls) / len(batch.kls)} if batch.kls else {}),
        "time/sample_wait": batch.sample_wait,
        "time/train_wait": train_wait,
    }


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    service = service or ServiceClient()
    log = RunLog.for_config(cfg)
    problem_at, heldout = problem_source(cfg)

    # ---------------------------------------------------------------- session (fresh or resumed), and what samples
    run = start_run(service, log, cfg)
    training, tokenizer = run.training, run.training.get_tokenizer()
    reference = service.create_sampling_client(base_model=cfg.base_model) if cfg.kl_penalty_coef > 0 else None
    rollouts = Rollouts(training.save_weights_and_get_sampling_client(), run.step - 1, ProblemStream.at(run.position))
    before = eval_before_training(run, partial(evaluate, rollouts.sampler, tokenizer, heldout, cfg, log))
    eval_seconds = [before["time/eval"]] if before else []
    last_eval = before["eval/accuracy"] if before else None  # shown beside the reward once an eval has run

    for step in (progress := steps(run, cfg.steps, "GRPO")):
        step_started = time.monotonic()
        # ------------------------------------------------------------ rollouts: sync samples one batch per step
        if cfg.mode == "sync":
            top_up(rollouts, cfg.groups_per_batch, problem_at, tokenizer, cfg)
        # ------------------------------------------------------------ stream groups into forward_backward
        batch = stream_groups(training, rollouts, reference, problem_at, tokenizer, log, step, cfg)
        # Every step ends in an optimizer step, even one with nothing to train on (AdamW leaves the weights
        # as they are then): the session's step count is the loop's, so a run can be checked by it.
        optim_future = training.optim_step(adam(cfg))

        # ------------------------------------------------------------ results, new snapshot
        waited = time.monotonic()
        loss, diffs = read_results(batch)
        optim_future.result()
        rollouts.sampler, rollouts.version = training.save_weights_and_get_sampling_client(), step
        metrics = step_metrics(batch, loss, diffs, train_wait=time.monotonic() - waited)

        # ------------------------------------------------------------ eval and checkpoint, with the stream's position
        end_step(
            run,
            step,
            metrics,
            partial(evaluate, rollouts.sampler, tokenizer, heldout, cfg, log),
            position=rollouts.stream.position([g.index for g in rollouts.in_flight]),
            started=step_started,
        )
        if "time/eval" in metrics:
            eval_seconds.append(metrics["time/eval"])
        last_eval = metrics.get("eval/accuracy", last_eval)
        progress.set_postfix(
            reward=f"{metrics['reward/mean']:.2f}", **({} if last_eval is None else {"eval_acc": f"{last_eval:.2f}"})
        )

    # -------------------------------------------------------------------- curve and summary
    result = close_run(run, f"GRPO on {cfg.task}", ["reward/mean", "eval/accuracy"], "eval/accuracy")
    return RunResult(**asdict(result), eval_seconds=eval_seconds)


if __name__ == "__main__":
    result = main(parse_config(Config, prog="python -m treadle.recipes.math_rl"))
    print(
        f"held-out accuracy {result.eval_before:.3f} -> {result.eval_after:.3f}\n"
        f"metrics: {result.metrics_path}\ncurve:   {result.png_path}\nstate:   {result.final_state_path}"
    )
