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
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Literal

from pydantic import Field

from treadle import Datum, ModelInput, SamplingParams, ServiceClient
from treadle.config import parse_config
from treadle.recipes.lib import grpo, loop
from treadle.recipes.lib.advantages import kl_penalized_reward, kl_sample_ref
from treadle.recipes.lib.datums import rl_datum
from treadle.recipes.lib.evaluation import evaluate_problems, question_prompt
from treadle.recipes.lib.grpo import GroupTally, read_groups
from treadle.recipes.lib.loop import GroupRLConfig, adam, close_run, end_step, eval_before_training, start_run, steps
from treadle.recipes.lib.math_tasks import Problem, arithmetic_heldout, arithmetic_problem_at, load_gsm8k, reward
from treadle.recipes.lib.off_policy import Group, SampledCompletion
from treadle.recipes.lib.run_log import RunLog


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


@dataclass(kw_only=True)
class Rollouts(grpo.Rollouts[InFlight, Group]):
    """The loop's sampling side (`grpo.Rollouts`): a group is one `sample` request of `group_size` completions,
    graded when it is read; a requeued problem goes back to the stream, sampled again when it comes up."""

    problem_at: Callable[[int], Problem]
    tokenizer: Any
    cfg: Config

    def submit(self, index: int) -> InFlight:
        cfg, problem = self.cfg, self.problem_at(index)
        prompt = question_prompt(self.tokenizer, problem.question, cfg.system_prompt)
        seed = cfg.seed * 1_000_003 + index * 7919 + self.version
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=cfg.stop, seed=seed)
        samples = self.sampler.sample(ModelInput.from_ints(prompt), cfg.group_size, params)
        return InFlight(index, problem, prompt, self.version, samples)

    def next_group(self) -> Group:
        """Wait for the oldest group's completions and reward each: 1 for the right answer (`format_reward` for
        another integer)."""
        group, completions = self.in_flight.popleft(), []
        for seq in group.samples.result().sequences:
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
            score = reward(text, group.problem.answer, self.cfg.format_reward, first_line_only(self.cfg))
            completions.append(SampledCompletion(seq.tokens, seq.logprobs, score, text))
        return Group(group.index, group.prompt, completions, group.policy_version)

    def requeue(self, group: Group) -> None:
        self.stream.pending.append(group.problem_index)


@dataclass
class StepBatch:
    """What one step streamed into forward_backward: each call's future and datums, and the rewards (and KL
    estimates) of the groups it used."""

    calls: list[tuple[Any, list[Datum]]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)


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


def kl_against_reference(reference: Any, group: Group) -> list[float]:
    """Each completion's sampled KL(policy || base), from the base model's logprobs of its tokens."""
    futures = [reference.compute_logprobs(ModelInput.from_ints(group.prompt + c.tokens)) for c in group.completions]
    return [kl_sample_ref(c.logprobs, f.result()[len(group.prompt) :]) for c, f in zip(group.completions, futures)]


def read_results(batch: StepBatch) -> tuple[float, list[float]]:
    """The step's summed loss, and sampler-minus-trainer logprob differences of the trained tokens."""
    loss, diffs = 0.0, []
    for future, datums in batch.calls:
        output = future.result()
        loss += output.metrics.get("loss:sum", 0.0)
        for datum, out in zip(datums, output.loss_fn_outputs):
            advantages = datum.loss_fn_inputs["advantages"].to_numpy()
            sampled = datum.loss_fn_inputs["logprobs"].to_numpy()[advantages != 0]
            diffs += (sampled - out["logprobs"].to_numpy()[advantages != 0]).tolist()
    return loss, diffs


def step_metrics(batch: StepBatch, loss: float, diffs: list[float]) -> dict[str, float]:
    """Rewards and accuracy of the groups used, the loss, and how far the sampler's logprobs were from the trainer's."""
    rewards = batch.rewards
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "accuracy/train": sum(r == 1.0 for r in rewards) / len(rewards),
        "loss:sum": loss,
        "optim/kl_sample_train_v1": sum(diffs) / len(diffs) if diffs else 0.0,
        "optim/kl_sample_train_v2": 0.5 * sum(d * d for d in diffs) / len(diffs) if diffs else 0.0,
        **({"kl/policy_base": sum(batch.kls) / len(batch.kls)} if batch.kls else {}),
    }


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    service = service or ServiceClient()
    problem_at, heldout = problem_source(cfg)

    # ---------------------------------------------------------------- session (fresh or resumed), and what samples
    run = start_run(service, cfg)
    training, tokenizer, log = run.training, run.training.get_tokenizer(), run.log
    reference = service.create_sampling_client(base_model=cfg.base_model) if cfg.kl_penalty_coef > 0 else None
    rollouts = Rollouts.of_run(run, cfg.async_groups_in_flight, problem_at=problem_at, tokenizer=tokenizer, cfg=cfg)
    before = eval_before_training(run, partial(evaluate, rollouts.sampler, tokenizer, heldout, cfg, log))
    eval_seconds = [before["time/eval"]] if before else []
    last_eval = before["eval/accuracy"] if before else None  # shown beside the reward once an eval has run

    for step in (progress := steps(run, cfg.steps, "GRPO")):
        step_started = time.monotonic()
        # ------------------------------------------------------------ graded groups, each into forward_backward at once
        tally, batch = GroupTally(), StepBatch()
        for group in read_groups(rollouts, tally, cfg, log=log, step=step):
            rewards = [c.reward for c in group.completions]
            batch.rewards += rewards
            if reference is not None:
                kls = kl_against_reference(reference, group)
                batch.kls += kls
                rewards = [kl_penalized_reward(r, kl, cfg.kl_penalty_coef) for r, kl in zip(rewards, kls)]
            advantages = tally.advantages(rewards, cfg.normalize_std)
            if advantages is None:
                continue
            completions = [(c, a) for c, a in zip(group.completions, advantages) if c.tokens]
            datums = [rl_datum(group.prompt, c.tokens, c.logprobs, a) for c, a in completions]
            tally.tokens += sum(d.model_input.length for d in datums)
            batch.calls.append((training.forward_backward(datums, cfg.loss_fn), datums))
        # Every step ends in an optimizer step, even one with nothing to train on (AdamW leaves the weights
        # as they are then): the session's step count is the loop's, so a run can be checked by it.
        optim_future = training.optim_step(adam(cfg))

        # ------------------------------------------------------------ results, new snapshot
        waited = time.monotonic()
        loss, diffs = read_results(batch)
        optim_future.result()
        rollouts.sampler, rollouts.version = training.save_weights_and_get_sampling_client(), step
        metrics = {**step_metrics(batch, loss, diffs), **tally.metrics(), "time/train_wait": time.monotonic() - waited}

        # ------------------------------------------------------------ eval and checkpoint, with the stream's position
        evaluate_now = partial(evaluate, rollouts.sampler, tokenizer, heldout, cfg, log)
        end_step(run, step, metrics, evaluate_now, position=rollouts.position(), started=step_started)
        eval_seconds += [metrics["time/eval"]] if "time/eval" in metrics else []
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
