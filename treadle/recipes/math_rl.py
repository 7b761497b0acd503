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
from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from tqdm import tqdm

from treadle import AdamParams, ModelInput, SamplingParams, ServiceClient
from treadle.recipes.advantages import group_advantages, is_informative, kl_penalized_reward, kl_sample_ref
from treadle.recipes.cli import parse_config
from treadle.recipes.datums import rl_datum
from treadle.recipes.evaluation import evaluate_problems, prompt_messages
from treadle.recipes.math_tasks import Problem, arithmetic_heldout, arithmetic_problem_at, load_gsm8k, reward
from treadle.recipes.off_policy import Group, SampledCompletion, StalePolicy, staleness, staleness_action
from treadle.recipes.plot import plot_metrics
from treadle.recipes.rendering import render_generation_prompt
from treadle.recipes.run_log import RunConfig, RunLog


class Config(RunConfig):
    """GRPO on arithmetic word problems or GSM8K, through the treadle SDK."""

    base_model: str = Field(default="SmolLM2-135M-Instruct", description="Base model served by the workers.")
    log_dir: str = Field(default="runs/math_rl", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    task: Literal["arithmetic", "gsm8k"] = Field(default="arithmetic", description="Synthetic arithmetic or GSM8K.")
    max_operand: int = Field(default=9, ge=1, description="Arithmetic: operands are drawn from [0, max_operand].")
    gsm8k_train_path: str | None = Field(default=None, description="GSM8K train JSONL (question/answer); None: HF datasets.")
    gsm8k_eval_path: str | None = Field(default=None, description="GSM8K test JSONL; None: HF datasets.")
    system_prompt: str | None = Field(default=None, description="System message (None: the chat template's default).")
    seed: int = Field(default=0, description="Seed of the problem stream, the sampler and the LoRA init.")
    steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    groups_per_batch: int = Field(default=8, ge=1, description="Problems (groups) per step.")
    group_size: int = Field(default=8, ge=2, description="Completions sampled per problem (K).")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens per completion.")
    temperature: float = Field(default=1.0, gt=0.0, description="Sampling temperature of rollouts.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Stop strings of rollouts and eval.")
    lora_rank: int = Field(default=16, ge=1, description="LoRA rank (alpha is 2 x rank).")
    learning_rate: float = Field(default=3e-4, gt=0.0, description="AdamW learning rate.")
    loss_fn: Literal["importance_sampling", "ppo", "cispo"] = Field(default="importance_sampling", description="Policy loss.")
    normalize_std: bool = Field(default=False, description="Divide group advantages by the group's reward std.")
    format_reward: float = Field(default=0.0, ge=0.0, lt=1.0, description="Reward of a wrong answer that is still an integer.")
    kl_penalty_coef: float = Field(default=0.0, ge=0.0, description="Subtract coef * KL(policy || base) from each reward.")
    eval_every: int = Field(default=5, ge=0, description="Held-out eval every N steps (0: only before and after).")
    eval_problems: int = Field(default=50, ge=1, description="Size of the fixed held-out set.")
    save_every: int = Field(default=5, ge=1, description="save_state every N steps (and at the end).")
    mode: Literal["sync", "async"] = Field(default="sync", description="On-policy steps, or off-policy with rollouts in flight.")
    async_groups_in_flight: int = Field(default=16, ge=1, description="Async: groups being sampled at any time.")
    max_steps_off_policy: int = Field(default=1, ge=0, description="Async: staleness limit of a group, in steps.")
    stale_policy: StalePolicy = Field(default="requeue", description="Async: what happens to a staler group.")


@dataclass
class RunResult:
    eval_before: float
    eval_after: float
    final_state_path: str
    metrics_path: str
    png_path: str
    eval_seconds: list[float]


def problem_source(cfg: Config):
    """Training problem by index (random access, so a resumed run continues the stream) and the eval set."""
    if cfg.task == "arithmetic":
        return (lambda i: arithmetic_problem_at(cfg.seed, i, cfg.max_operand)), arithmetic_heldout(cfg.eval_problems, cfg.max_operand)
    train = load_gsm8k(cfg.gsm8k_train_path, "train")
    order = list(range(len(train)))
    random.Random(cfg.seed).shuffle(order)
    return (lambda i: train[order[i % len(train)]]), load_gsm8k(cfg.gsm8k_eval_path, "test")[: cfg.eval_problems]


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    service = service or ServiceClient()
    log = RunLog.for_config(cfg)
    problem_at, heldout = problem_source(cfg)
    first_line_only = cfg.task == "arithmetic"  # GSM8K answers come after a chain of thought

    # ---------------------------------------------------------------- session (fresh or resumed)
    last = log.last_checkpoint() if cfg.resume else None
    if last is not None:
        training = service.create_training_client_from_state_with_optimizer(last.state_path)
        start_step, cursor, pending = last.step + 1, last.extra["cursor"], deque(last.extra["pending"])
        log.rewind_to(last.step)
        print(f"resuming from {last.state_path} after step {last.step}")
    else:
        training = service.create_lora_training_client(cfg.base_model, rank=cfg.lora_rank, alpha=2 * cfg.lora_rank, seed=cfg.seed)
        start_step, cursor, pending = 1, 0, deque()
        log.rewind_to(-1)  # --resume before the first checkpoint: start over
    tokenizer = training.get_tokenizer()
    reference = service.create_sampling_client(base_model=cfg.base_model) if cfg.kl_penalty_coef > 0 else None
    sampler, version = training.save_weights_and_get_sampling_client(), start_step - 1
    eval_times: list[float] = []

    def evaluate(step: int) -> dict[str, float]:
        started = time.monotonic()
        result = evaluate_problems(sampler, tokenizer, heldout, system_prompt=cfg.system_prompt, max_tokens=cfg.max_tokens,
                                   stop=cfg.stop, first_line_only=first_line_only, desc=f"eval @ step {step}")
        eval_times.append(time.monotonic() - started)
        for problem, response in zip(heldout, result.responses):
            log.append("eval_samples.jsonl", step, {"question": problem.question, "answer": problem.answer, "response": response})
        return {"eval/accuracy": result.accuracy, "time/eval": eval_times[-1]}

    def submit_group(index: int):
        """Sample K completions of problem `index` from the current snapshot: a future, not a wait."""
        problem = problem_at(index)
        prompt = render_generation_prompt(tokenizer, prompt_messages(problem.question, cfg.system_prompt))
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=cfg.stop,
                                seed=cfg.seed * 1_000_003 + index * 7919 + version)
        return index, problem, prompt, version, sampler.sample(ModelInput.from_ints(prompt), cfg.group_size, params)

    def grade_group(index: int, problem: Problem, prompt: list[int], sampled_by: int, future) -> Group:
        completions = []
        for seq in future.result().sequences:
            text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
            score = reward(text, problem.answer, cfg.format_reward, first_line_only)
            completions.append(SampledCompletion(seq.tokens, seq.logprobs, score, text))
        return Group(index, prompt, completions, sampled_by)

    def kl_against_reference(group: Group) -> list[float]:
        futures = [reference.compute_logprobs(ModelInput.from_ints(group.prompt + c.tokens)) for c in group.completions]
        return [kl_sample_ref(c.logprobs, f.result()[len(group.prompt):]) for c, f in zip(group.completions, futures)]

    in_flight: deque = deque()

    def top_up(target: int, cursor: int) -> int:
        """Keep `target` groups being sampled: requeued problems first, then new ones. Returns the new cursor."""
        while len(in_flight) < target:
            if pending:
                in_flight.append(submit_group(pending.popleft()))
            else:
                in_flight.append(submit_group(cursor))
                cursor += 1
        return cursor

    last_eval: float | None = None  # shown beside the reward once an eval has run
    if start_step == 1:
        first = evaluate(0)
        log.log_metrics(0, first)
        last_eval = first["eval/accuracy"]
    final_state_path = last.state_path if last is not None else ""
    progress = tqdm(range(start_step, cfg.steps + 1), desc="GRPO", initial=start_step - 1, total=cfg.steps)
    for step in progress:
        step_started = time.monotonic()
        # ------------------------------------------------------------ rollouts: sync samples one batch per step
        if cfg.mode == "sync":
            cursor = top_up(cfg.groups_per_batch, cursor)
        # ------------------------------------------------------------ stream groups into forward_backward
        fwd_futures, datums_by_call, rewards, used = [], [], [], 0
        counts = {"use": 0, "requeue": 0, "discard": 0, "skipped": 0}
        stalenesses, sample_wait, tokens, kls = [], 0.0, 0, []
        while used < cfg.groups_per_batch:
            if cfg.mode == "async":
                cursor = top_up(cfg.async_groups_in_flight, cursor)
            waited = time.monotonic()
            group = grade_group(*in_flight.popleft())
            sample_wait += time.monotonic() - waited
            action = staleness_action(group.policy_version, version, cfg.max_steps_off_policy, cfg.stale_policy)
            counts[action] += 1
            log.append("rollouts.jsonl", step, {
                "problem_index": group.problem_index, "policy_version": group.policy_version, "trained_at_version": version,
                "staleness": staleness(group.policy_version, version), "action": action,
                "reward_mean": sum(c.reward for c in group.completions) / len(group.completions)})
            if action == "requeue":
                pending.append(group.problem_index)
            if action != "use":
                continue
            used += 1
            stalenesses.append(staleness(group.policy_version, version))
            group_rewards = [c.reward for c in group.completions]
            rewards += group_rewards
            if reference is not None:
                group_kls = kl_against_reference(group)
                kls += group_kls
                group_rewards = [kl_penalized_reward(r, kl, cfg.kl_penalty_coef) for r, kl in zip(group_rewards, group_kls)]
            advantages = group_advantages(group_rewards, cfg.normalize_std)
            if not is_informative(advantages):
                counts["skipped"] += 1
                continue
            datums = [rl_datum(group.prompt, c.tokens, c.logprobs, a) for c, a in zip(group.completions, advantages) if c.tokens]
            tokens += sum(d.model_input.length for d in datums)
            fwd_futures.append(training.forward_backward(datums, cfg.loss_fn))
            datums_by_call.append(datums)
        # Every step ends in an optimizer step, even one with nothing to train on (AdamW leaves the weights
        # as they are then): the session's step count is the loop's, so a run can be checked by it.
        optim_future = training.optim_step(AdamParams(learning_rate=cfg.learning_rate, eps=1e-8))

        # ------------------------------------------------------------ results, new snapshot
        waited = time.monotonic()
        loss, diffs = 0.0, []
        for future, datums in zip(fwd_futures, datums_by_call):
            output = future.result()
            loss += output.metrics.get("loss:sum", 0.0)
            for datum, out in zip(datums, output.loss_fn_outputs):
                advantages = datum.loss_fn_inputs["advantages"].to_numpy()
                sampled = datum.loss_fn_inputs["logprobs"].to_numpy()[advantages != 0]
                diffs += (sampled - out["logprobs"].to_numpy()[advantages != 0]).tolist()
        optim_future.result()
        sampler, version = training.save_weights_and_get_sampling_client(), step
        train_wait = time.monotonic() - waited

        metrics = {
            "reward/mean": sum(rewards) / len(rewards), "accuracy/train": sum(r == 1.0 for r in rewards) / len(rewards),
            "loss:sum": loss, "tokens": tokens, "groups/used": used, "groups/skipped_uniform": counts["skipped"],
            "groups/requeued": counts["requeue"], "groups/discarded": counts["discard"],
            "async/staleness_max": max(stalenesses), "async/staleness_mean": sum(stalenesses) / len(stalenesses),
            "optim/kl_sample_train_v1": sum(diffs) / len(diffs) if diffs else 0.0,
            "optim/kl_sample_train_v2": 0.5 * sum(d * d for d in diffs) / len(diffs) if diffs else 0.0,
            **({"kl/policy_base": sum(kls) / len(kls)} if kls else {}),
            "time/sample_wait": sample_wait, "time/train_wait": train_wait,
        }
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            metrics.update(evaluate(step))
        # ------------------------------------------------------------ checkpoint with the loop position
        checkpoint = None
        if step % cfg.save_every == 0 or step == cfg.steps:
            saved = time.monotonic()
            final_state_path = training.save_state(f"step-{step:06d}").result().path
            # In-flight groups are not part of the state: on resume their problems are sampled again.
            checkpoint = {"cursor": cursor, "pending": [*pending, *(g[0] for g in in_flight)]}
            metrics["time/save"] = time.monotonic() - saved
        metrics["time/step"] = time.monotonic() - step_started
        # The step's row before its checkpoint's: a kill between the two resumes from the previous
        # checkpoint (dropping this row), where the other order would resume past a row never written.
        log.log_metrics(step, metrics)
        if checkpoint is not None:
            log.record_checkpoint(f"step-{step:06d}", step, final_state_path, checkpoint)
        last_eval = metrics.get("eval/accuracy", last_eval)
        progress.set_postfix(reward=f"{metrics['reward/mean']:.2f}", **({} if last_eval is None else {"eval_acc": f"{last_eval:.2f}"}))

    # -------------------------------------------------------------------- curve and summary
    png_path = plot_metrics(log.metrics_path, f"{log.log_dir}/curve.png", ["reward/mean", "eval/accuracy"],
                            title=f"GRPO on {cfg.task} ({cfg.base_model})")
    log.close()
    evals = [row["eval/accuracy"] for row in log.metrics() if "eval/accuracy" in row]
    return RunResult(eval_before=evals[0], eval_after=evals[-1], final_state_path=final_state_path,
                     metrics_path=log.metrics_path, png_path=png_path, eval_seconds=eval_times)


if __name__ == "__main__":
    result = main(parse_config(Config, prog="python -m treadle.recipes.math_rl"))
    print(f"held-out accuracy {result.eval_before:.3f} -> {result.eval_after:.3f}\n"
          f"metrics: {result.metrics_path}\ncurve:   {result.png_path}\nstate:   {result.final_state_path}")
