"""RL on programming problems: the model writes Python, a sandbox runs it on unit tests, GRPO trains.

Each group samples `group_size` answers to one problem; an answer's reward is 1 if the code in its
last ```python block passes every test, 0 if not, -0.1 if it has no code block. With `--max_turns 2`
the first answer's code is a call to the `check_solution` tool: it runs on the problem's first
`public_tests` tests, the report comes back as a tool message rendered by the tokenizer's own chat
template (role `tool`; a template without one gets a user message), and the model answers again;
the second answer is graded. The datum is the whole episode, with loss weight only on the tokens
the model sampled. Rewards are centred per group and trained with `cispo` (default), `ppo` or
`importance_sampling`; a group's forward_backward is submitted as soon as it is graded.

`num_rollout_workers` threads run episodes (sampling and sandboxing). `--mode async` keeps them busy
while the trainer steps, so a group may come from a policy some steps old: up to
`max_steps_off_policy` it is used (the importance ratio corrects the gap); a staler one is discarded,
or requeued: sampled again by the current policy and read next. Held-out problems are answered
greedily every `eval_every` steps; `--resume` continues the problem stream from the last checkpoint.

    python -m treadle.recipes.code_rl --base_model SmolLM2-135M-Instruct --max_turns 2 --log_dir runs/code_rl
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from pydantic import Field
from tqdm import tqdm

from treadle import ModelInput, SamplingParams, ServiceClient
from treadle.config import parse_config
from treadle.recipes.lib.code_tasks import (
    CodeProblem,
    Grade,
    check_solution_report,
    extract_code,
    grade,
    load_code_problems,
    problem_at,
    problem_prompt,
    run_tests,
    split_problems,
)
from treadle.recipes.lib.datums import multi_turn_rl_datum
from treadle.recipes.lib.evaluation import prompt_messages
from treadle.recipes.lib import grpo
from treadle.recipes.lib.grpo import GroupTally, read_groups
from treadle.recipes.lib.loop import (
    GroupRLConfig,
    RunResult,
    adam,
    close_run,
    end_step,
    eval_before_training,
    start_run,
    steps,
)
from treadle.recipes.lib.rendering import render_continuation, render_generation_prompt, tool_message
from treadle.recipes.lib.run_log import RunLog
from treadle.sandbox import Limits, LocalSandbox, Sandbox


class Config(GroupRLConfig):
    """GRPO on programming problems graded in a sandbox, with an optional check_solution tool turn."""

    log_dir: str = Field(
        default="runs/code_rl", description="Where metrics.jsonl, rollouts.jsonl, samples and the PNG go."
    )
    problems_path: str | None = Field(
        default=None,
        description="JSONL/JSON of problems (offline set, DeepCoder, TACO or LiveCodeBench rows); None: the offline set.",
    )
    heldout_fraction: float = Field(
        default=0.25, gt=0.0, lt=1.0, description="Share of problems held out (by a hash of the name)."
    )
    eval_problems: int = Field(default=100, ge=1, description="Most held-out problems evaluated.")
    max_tokens: int = Field(default=256, ge=1, description="Most tokens per answer (per turn).")
    max_context: int = Field(
        default=2048,
        ge=2,
        description="Most tokens of a second-turn prompt plus its answer; longer episodes end after the first answer.",
    )
    max_turns: int = Field(
        default=1, ge=1, le=2, description="1: answer once; 2: check_solution on the first answer, then answer again."
    )
    public_tests: int = Field(
        default=2, ge=1, description="Tests that check_solution runs (the first ones; grading runs all)."
    )
    loss_fn: Literal["cispo", "ppo", "importance_sampling"] = Field(default="cispo", description="Policy loss.")
    no_code_reward: float = Field(default=-0.1, le=0.0, description="Reward of an answer without a code block.")
    init_state: str | None = Field(
        default=None, description="Start from this save_state checkpoint's weights (e.g. after SFT)."
    )
    num_rollout_workers: int = Field(default=8, ge=1, description="Episodes (groups) being sampled and graded at once.")
    sandbox_workers: int = Field(default=4, ge=1, le=64, description="Sandboxed programs running at once.")
    sandbox_cpu_seconds: int = Field(default=2, ge=1, le=600, description="CPU-time limit of one test run.")
    sandbox_wall_seconds: float = Field(default=5.0, gt=0.0, le=600.0, description="Wall-time limit of one test run.")


@dataclass
class Attempt:
    """One sampled episode: its token pieces (sampled or context) and the grade of its final answer."""

    pieces: list[tuple[list[int], list[float] | None]]
    answer: str
    grade: Grade
    first_answer: str | None = None
    tool_report: str | None = None

    def record(self, problem: CodeProblem) -> dict[str, Any]:
        """Its row of samples.jsonl (and eval_samples.jsonl)."""
        return {
            "problem": problem.name,
            "reward": self.grade.reward,
            "answer": self.answer,
            "first_answer": self.first_answer,
            "tool_report": self.tool_report,
        }


@dataclass(frozen=True)
class CodeGroup:
    """The episodes of one problem (a group), and the policy version that sampled them: a record, never changed."""

    problem_index: int
    problem: CodeProblem
    attempts: list[Attempt]
    policy_version: int

    def details(self) -> dict[str, Any]:
        """Its rollouts.jsonl details: the problem, each episode's reward, how many took a second turn."""
        return {
            "problem": self.problem.name,
            "rewards": [a.grade.reward for a in self.attempts],
            "second_turns": sum(a.tool_report is not None for a in self.attempts),
        }


@dataclass(frozen=True)
class Episodes:
    """What every episode of a run shares: the tokenizer that renders and decodes, the sandbox that grades, the config."""

    tokenizer: Any
    sandbox: Sandbox
    cfg: Config


def run_episodes(
    episodes: Episodes, sampler: Any, problem: CodeProblem, n: int, params: SamplingParams
) -> list[Attempt]:
    """`n` episodes of one problem: sample, (2 turns) check_solution and sample again, grade."""
    tokenizer, sandbox, cfg = episodes.tokenizer, episodes.sandbox, episodes.cfg
    messages = prompt_messages(problem_prompt(problem, cfg.max_turns), cfg.system_prompt)
    prompt = render_generation_prompt(tokenizer, messages)
    first = sampler.sample(ModelInput.from_ints(prompt), n, params).result().sequences
    parts, second = [], []  # (pieces, final answer, first answer, tool report) of each episode; its second turn
    for seq in first:
        text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        pieces = [(prompt, None), (list(seq.tokens), list(seq.logprobs))]
        code = extract_code(text) if cfg.max_turns == 2 else None
        if code is not None:
            report = check_solution_report(
                run_tests(sandbox, problem, code, problem.tests[: cfg.public_tests], stop_at_failure=False)
            )
            ended = seq.stop_reason == "stop" and bool(seq.tokens) and seq.tokens[-1] == tokenizer.eos_token_id
            after = render_continuation(
                tokenizer, messages, text, ended, [tool_message(tokenizer, "check_solution", report)]
            )
            if len(prompt) + len(seq.tokens) + len(after) + cfg.max_tokens <= cfg.max_context:
                pieces.append((after, None))
                parts.append((pieces, None, text, report))
                # A seed per episode: with the group's, episodes with equal first answers draw equal second ones.
                own = (
                    params
                    if params.seed is None
                    else params.model_copy(update={"seed": (params.seed + len(parts)) % 2**63})
                )
                second.append(sampler.sample(ModelInput.from_ints([*prompt, *seq.tokens, *after]), 1, own))
                continue
        parts.append((pieces, text, None, None))  # one turn, no code to check, or no room for a second answer: final
        second.append(None)
    attempts = []
    for (pieces, text, first_text, report), future in zip(parts, second):
        if future is not None:
            seq = future.result().sequences[0]
            pieces.append((list(seq.tokens), list(seq.logprobs)))
            text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        attempts.append(Attempt(pieces, text, grade(sandbox, problem, text, cfg.no_code_reward), first_text, report))
    return attempts


@dataclass
class InFlight:
    """A group being sampled and graded on a rollout worker, by the snapshot of `policy_version`."""

    index: int
    problem: CodeProblem
    policy_version: int
    attempts: Future[list[Attempt]]


@dataclass(kw_only=True)
class Rollouts(grpo.Rollouts[InFlight, CodeGroup]):
    """The loop's sampling side (`grpo.Rollouts`): rollout workers run each group's episodes, sampled by the
    current snapshot and graded in the sandbox, and `async_in_flight` is one group per worker."""

    episodes: Episodes
    problems: list[CodeProblem]
    workers: ThreadPoolExecutor

    def submit(self, index: int) -> InFlight:
        """Start the episode group of training problem `index` on a rollout worker, sampled by the current snapshot."""
        cfg = self.episodes.cfg
        problem = problem_at(self.problems, cfg.seed, index)
        seed = cfg.seed * 1_000_003 + index * 7919 + self.version
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=seed)
        episodes = partial(run_episodes, self.episodes, self.sampler, problem, cfg.group_size, params)
        return InFlight(index, problem, self.version, self.workers.submit(episodes))

    def next_group(self) -> CodeGroup:
        group = self.in_flight.popleft()
        return CodeGroup(group.index, group.problem, group.attempts.result(), group.policy_version)

    def requeue(self, group: CodeGroup) -> None:
        # Sampled again by the current policy and read next, so it cannot go stale again.
        self.in_flight.appendleft(self.submit(group.problem_index))


def evaluate(sampler: Any, episodes: Episodes, heldout: list[CodeProblem], log: RunLog, step: int) -> dict[str, float]:
    """Greedy held-out pass rate (one episode per problem, the same number of turns as training)."""
    started = time.monotonic()
    greedy = SamplingParams(max_tokens=episodes.cfg.max_tokens, temperature=1.0, top_k=1, seed=0)
    # Every held-out episode at once (a thread each: they mostly wait), so the worker batches them all.
    with ThreadPoolExecutor(max_workers=max(1, len(heldout))) as pool:
        futures = [pool.submit(run_episodes, episodes, sampler, p, 1, greedy) for p in heldout]
        attempts = [f.result()[0] for f in tqdm(futures, desc=f"eval @ step {step}", leave=False)]
    for problem, a in zip(heldout, attempts):
        log.append("eval_samples.jsonl", step, a.record(problem))
    return {
        "eval/pass_rate": sum(a.grade.passed for a in attempts) / len(attempts),
        "eval/reward_mean": sum(a.grade.reward for a in attempts) / len(attempts),
        "eval/has_code": sum(a.grade.has_code for a in attempts) / len(attempts),
        "time/eval": time.monotonic() - started,
    }


def attempt_metrics(attempts: list[Attempt]) -> dict[str, float]:
    """Rewards and pass rate of the attempts a step trained on, and how many had a code block and a second turn."""
    n = len(attempts)
    return {
        "reward/mean": sum(a.grade.reward for a in attempts) / n,
        "accuracy/train": sum(a.grade.passed for a in attempts) / n,
        "format/has_code": sum(a.grade.has_code for a in attempts) / n,
        "turns/second_turn": sum(a.tool_report is not None for a in attempts) / n,
    }


def training_and_heldout(cfg: Config) -> tuple[list[CodeProblem], list[CodeProblem]]:
    """The problems to train on, and the held-out ones evaluated (at most `eval_problems`)."""
    train, heldout = split_problems(load_code_problems(cfg.problems_path), cfg.heldout_fraction)
    return train, heldout[: cfg.eval_problems]


def main(cfg: Config, service: ServiceClient | None = None, sandbox: Sandbox | None = None) -> RunResult:
    service = service or ServiceClient()
    sandbox = sandbox or LocalSandbox(
        Limits(cpu_seconds=cfg.sandbox_cpu_seconds, wall_seconds=cfg.sandbox_wall_seconds),
        pool_size=cfg.sandbox_workers,
    )
    train, heldout = training_and_heldout(cfg)

    # ---------------------------------------------------------------- session (fresh, from init_state, or resumed)
    run = start_run(service, cfg, init_state=cfg.init_state)
    training, log = run.training, run.log
    episodes = Episodes(training.get_tokenizer(), sandbox, cfg)
    if cfg.max_turns == 2:
        role = tool_message(episodes.tokenizer, "check_solution", "")["role"]
        print(f"check_solution results are rendered as role {role!r} messages")
    workers = ThreadPoolExecutor(max_workers=cfg.num_rollout_workers, thread_name_prefix="rollout")
    rollouts = Rollouts.of_run(run, cfg.num_rollout_workers, episodes=episodes, problems=train, workers=workers)
    before = eval_before_training(run, partial(evaluate, rollouts.sampler, episodes, heldout, log))
    last_eval = before["eval/pass_rate"] if before else None  # shown beside the reward once an eval has run

    for step in (progress := steps(run, cfg.steps, "code RL")):
        started = time.monotonic()
        # ------------------------------------------------------------ graded groups, each into forward_backward at once
        tally, attempts, fwd_futures = GroupTally(), [], []
        for group in read_groups(rollouts, tally, cfg, log=log, step=step):
            attempts += group.attempts
            for attempt in group.attempts:
                log.append("samples.jsonl", step, attempt.record(group.problem))
            advantages = tally.advantages([a.grade.reward for a in group.attempts], cfg.normalize_std)
            if advantages is None:
                continue
            datums = [multi_turn_rl_datum(a.pieces, adv) for a, adv in zip(group.attempts, advantages)]
            tally.tokens += sum(d.model_input.length for d in datums)
            fwd_futures.append(training.forward_backward(datums, cfg.loss_fn))
        optim_future = training.optim_step(adam(cfg)) if fwd_futures else None

        # ------------------------------------------------------------ results, new snapshot
        waited = time.monotonic()
        loss = sum(f.result().metrics.get("loss:sum", 0.0) for f in fwd_futures)
        if optim_future is not None:
            optim_future.result()
        rollouts.sampler, rollouts.version = training.save_weights_and_get_sampling_client(), step
        metrics = {**attempt_metrics(attempts), "loss:sum": loss, **tally.metrics()}
        metrics["time/train_wait"] = time.monotonic() - waited

        # ------------------------------------------------------------ eval and checkpoint, with the stream's position
        evaluate_now = partial(evaluate, rollouts.sampler, episodes, heldout, log)
        end_step(run, step, metrics, evaluate_now, position=rollouts.position(), started=started)
        last_eval = metrics.get("eval/pass_rate", last_eval)
        progress.set_postfix(
            reward=f"{metrics['reward/mean']:.2f}", **({} if last_eval is None else {"eval_pass": f"{last_eval:.2f}"})
        )
    workers.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------------- curve and summary
    curve = ["reward/mean", "accuracy/train", "eval/pass_rate"]
    return close_run(run, f"code RL, {cfg.max_turns} turn(s)", curve, "eval/pass_rate")


if __name__ == "__main__":
    result = main(parse_config(Config, prog="python -m treadle.recipes.code_rl"))
    with open(result.metrics_path) as f:
        rows = [json.loads(line) for line in f]
    train, evals = [r for r in rows if r["step"] > 0], [r for r in rows if "eval/pass_rate" in r]
    for what, key, first, last in [
        ("train reward, first -> last step", "reward/mean", train[0], train[-1]),
        ("held-out pass rate", "eval/pass_rate", evals[0], evals[-1]),
        ("held-out answers with a code block", "eval/has_code", evals[0], evals[-1]),
    ]:
        print(f"{what}: {first[key]:.3f} -> {last[key]:.3f}")
    print(f"metrics: {result.metrics_path}\ncurve:   {result.png_path}\nstate:   {result.final_state_path}")
