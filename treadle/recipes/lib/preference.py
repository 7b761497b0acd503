"""The pieces DPO and KTO share: completion datums, cached reference logprobs, held-out pair metrics
(and, with distillation, the end of a run: the curve and the summary).

A completion is rendered as the conversation [system?, user: prompt, assistant: completion] with the
tokenizer's chat template, and only the assistant turn (its end-of-turn token included) is weighted,
so a sequence logprob is log pi(completion | prompt).

Reference logprobs come from the frozen base model's sampler (`compute_logprobs`), once per
completion: they never change during a run, so a recipe computes them up front and keeps them.
`forward_reference_logprobs` gets the same numbers in one batched op (see there).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal, Sequence

import numpy as np
from pydantic import Field

from treadle.recipes.lib.datums import supervised_datum
from treadle.recipes.lib.evaluation import evaluate_problems, prompt_messages
from treadle.recipes.lib.math_tasks import Problem, arithmetic_heldout
from treadle.recipes.lib.loop import Run, adam, close_run, start_run
from treadle.recipes.lib.preference_data import PreferencePair, arithmetic_pairs, load_pairs
from treadle.recipes.lib.preference_losses import (
    PreferenceLoss,
    SequenceLoss,
    dpo_loss,
    forward_backward_with_loss,
    sequence_logprobs,
)
from treadle.recipes.lib.rendering import render_conversation
from treadle.recipes.lib.run_log import RunConfig, RunLog
from treadle.types import Datum

ReferenceSource = Literal["sampler", "forward"]
ReferenceScorer = Callable[[Sequence[Datum]], np.ndarray]


class PreferenceConfig(RunConfig):
    """The fields DPO and KTO share: the reference, beta, and the held-out eval."""

    base_model: str = Field(
        default="SmolLM2-135M-Instruct", description="Base model served by the workers (also the reference)."
    )
    system_prompt: str | None = Field(default=None, description="System message (None: the chat template's default).")
    data_path: str | None = Field(
        default=None,
        description="Training JSONL: DPO {prompt, chosen, rejected}, KTO {prompt, completion, label}; None: arithmetic.",
    )
    reference: ReferenceSource = Field(
        default="sampler",
        description="Reference logprobs: the base model's sampler, or a fresh adapter's batched forward.",
    )
    beta: float = Field(default=0.1, gt=0.0, description="Beta: the strength of the implicit KL to the reference.")
    heldout_path: str | None = Field(
        default=None, description="Held-out pairs JSONL {prompt, chosen, rejected}; None: arithmetic held-out pairs."
    )
    heldout_pairs: int = Field(
        default=50, ge=1, description="Arithmetic: held-out pairs (and problems of the accuracy eval)."
    )
    max_operand: int = Field(default=9, ge=1, description="Arithmetic: operands are drawn from [0, max_operand].")
    arithmetic_eval: bool = Field(
        default=True, description="Also measure greedy accuracy on the held-out arithmetic problems."
    )
    max_tokens: int = Field(default=16, ge=1, description="Accuracy eval: most tokens per answer.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Accuracy eval: stop strings.")


def completion_datum(tokenizer: Any, prompt: str, completion: str, system_prompt: str | None) -> Datum:
    """A cross_entropy datum of `completion` after `prompt`, weighted 1 on the completion's tokens only."""
    messages = [*prompt_messages(prompt, system_prompt), {"role": "assistant", "content": completion}]
    rendered = render_conversation(tokenizer, messages, "last_assistant")
    return supervised_datum(rendered.tokens, rendered.mask)


def datum_tokens(datum: Any) -> list[int]:
    """The whole token sequence of a pre-shifted datum (model_input plus the last target)."""
    return [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]


def reference_logprobs(sampler: Any, datums: Sequence[Any]) -> np.ndarray:
    """The sampler's sequence logprob of each datum's weighted tokens; every request is in flight at once."""
    # The datum's own ModelInput class, so the official tinker SDK's sampler gets its own type.
    futures = [sampler.compute_logprobs(type(d.model_input).from_ints(datum_tokens(d))) for d in datums]
    # Entry 0 of compute_logprobs is None (no context); entry t+1 scores target t.
    token_logprobs = [np.asarray(f.result()[1:], dtype=np.float64) for f in futures]
    return sequence_logprobs(token_logprobs, [d.loss_fn_inputs["weights"].to_numpy() for d in datums])


def forward_reference_logprobs(service: Any, base_model: str, datums: Sequence[Datum]) -> np.ndarray:
    """The same numbers from one batched `forward` of a throwaway fresh LoRA session.

    A fresh adapter's B matrices are zero, so the session computes exactly the base model (to float
    rounding); one forward scores every datum, where the sampler answers one request at a time. On a
    busy CPU that is minutes against seconds. The session is stopped afterwards.
    """
    with service.create_lora_training_client(base_model, rank=1) as scorer:
        out = scorer.forward(list(datums), "cross_entropy").result()
    return sequence_logprobs(
        [o["logprobs"].to_numpy() for o in out.loss_fn_outputs],
        [d.loss_fn_inputs["weights"].to_numpy() for d in datums],
    )


def reference_scorer(service: Any, base_model: str, source: ReferenceSource) -> ReferenceScorer:
    """Sequence logprobs under the frozen base model: from its sampler (`compute_logprobs`) or a fresh session's forward."""
    if source == "sampler":
        sampler = service.create_sampling_client(base_model=base_model)
        return lambda datums: reference_logprobs(sampler, datums)
    return lambda datums: forward_reference_logprobs(service, base_model, datums)


@dataclass
class RenderedPairs:
    """Preference pairs as datums, with the reference's sequence logprobs of both sides."""

    chosen: list[Datum]
    rejected: list[Datum]
    ref_chosen: np.ndarray
    ref_rejected: np.ndarray


def render_pairs(
    tokenizer: Any, score: ReferenceScorer, pairs: Sequence[PreferencePair], system_prompt: str | None
) -> RenderedPairs:
    chosen = [completion_datum(tokenizer, p.prompt, p.chosen, system_prompt) for p in pairs]
    rejected = [completion_datum(tokenizer, p.prompt, p.rejected, system_prompt) for p in pairs]
    ref = score([*chosen, *rejected])
    return RenderedPairs(chosen, rejected, ref[: len(pairs)], ref[len(pairs) :])


def pair_metrics(training: Any, pairs: RenderedPairs, beta: float) -> dict[str, float]:
    """Held-out pair metrics of the current policy (a `forward`, no gradient).

    `eval/reward_accuracy`: share of pairs whose implicit reward beta*(log pi - log pi_ref) ranks the
    chosen completion above the rejected one (meaningless at the start, where every margin is 0 up to
    the ~1e-6 rounding by which the training forward and the sampler differ);
    `eval/preference_accuracy`: share where the policy itself gives the chosen completion the higher
    logprob (the base model's own ranking before training).
    """
    datums = [*pairs.chosen, *pairs.rejected]
    out = training.forward(datums, "cross_entropy").result()
    policy = sequence_logprobs(
        [o["logprobs"].to_numpy() for o in out.loss_fn_outputs],
        [d.loss_fn_inputs["weights"].to_numpy() for d in datums],
    )
    n = len(pairs.chosen)
    result = dpo_loss(policy[:n], policy[n:], pairs.ref_chosen, pairs.ref_rejected, beta)
    return {
        "eval/reward_accuracy": result.metrics["dpo/accuracy"],
        "eval/margin": result.metrics["dpo/margin"],
        "eval/dpo_loss": result.loss,
        "eval/preference_accuracy": float((policy[:n] > policy[n:]).mean()),
    }


def heldout_metrics(
    training: Any,
    tokenizer: Any,
    log: RunLog,
    step: int,
    heldout: RenderedPairs,
    problems: Sequence[Problem],
    cfg: PreferenceConfig,
) -> dict[str, float]:
    """`pair_metrics`, plus greedy accuracy on `problems` (if any) from a named sampler snapshot of this step."""
    metrics = pair_metrics(training, heldout, cfg.beta)
    if problems:
        path = training.save_weights_for_sampler(f"step-{step:06d}").result().path
        log.record_sampler(path, step)
        metrics["eval/accuracy"] = evaluate_problems(
            training.create_sampling_client(path), tokenizer, problems, cfg, step
        ).accuracy
    return metrics


def heldout_evaluator(
    training: Any, tokenizer: Any, log: RunLog, reference: ReferenceScorer, cfg: PreferenceConfig
) -> Callable[[int], dict[str, float]]:
    """A preference run's held-out eval (`heldout_metrics` by step): its pairs (`cfg.heldout_path`, else arithmetic
    ones) rendered and scored by the reference once, and the arithmetic problems when `cfg.arithmetic_eval`."""
    heldout = (
        load_pairs(cfg.heldout_path)
        if cfg.heldout_path
        else arithmetic_pairs(cfg.heldout_pairs, cfg.seed, heldout=True, max_operand=cfg.max_operand)
    )
    problems = arithmetic_heldout(cfg.heldout_pairs, cfg.max_operand) if cfg.arithmetic_eval else []
    return partial(
        heldout_metrics,
        training,
        tokenizer,
        log,
        heldout=render_pairs(tokenizer, reference, heldout, cfg.system_prompt),
        problems=problems,
        cfg=cfg,
    )


@dataclass
class PreferenceRun:
    """What a DPO or KTO run starts from: the run (fresh or resumed), its tokenizer, the frozen reference's
    scorer, and the held-out eval (`heldout_evaluator`)."""

    run: Run
    tokenizer: Any
    reference: ReferenceScorer
    evaluate: Callable[[int], dict[str, float]]

    def train_on_loss(
        self, batch: Sequence[Datum], loss_fn: SequenceLoss, n_trained: int | None = None
    ) -> PreferenceLoss:
        """One optimizer step on a loss computed here: the policy's `forward`, the loss's exact gradient sent
        back as a `forward_backward` (`forward_backward_with_loss`), then `optim_step`; returns once both are done."""
        fwd_bwd, result = forward_backward_with_loss(self.run.training, batch, loss_fn, n_trained)
        optim = self.run.training.optim_step(adam(self.run.cfg))
        fwd_bwd.result(), optim.result()
        return result

    def finish(self, name: str, curve: list[str]) -> RunResult:
        """The curve and the summary (`finish_run`), by the held-out implicit-reward accuracy's eval rows."""
        return finish_run(self.run, name, curve, "eval/reward_accuracy")


def start_preference_run(service: Any, cfg: PreferenceConfig) -> PreferenceRun:
    """The run's session (a fresh one, or the last checkpoint's with `cfg.resume`), the reference and the eval."""
    run = start_run(service, cfg)
    tokenizer = run.training.get_tokenizer()
    reference = reference_scorer(service, cfg.base_model, cfg.reference)
    return PreferenceRun(run, tokenizer, reference, heldout_evaluator(run.training, tokenizer, run.log, reference, cfg))


def eval_part(row: dict) -> dict[str, float]:
    """The held-out metrics of a metrics.jsonl row."""
    return {k: v for k, v in row.items() if k.startswith("eval/")}


@dataclass
class RunResult:
    """What a preference or distillation run returns: its first and last held-out metrics, and where things are."""

    eval_before: dict[str, float]
    eval_after: dict[str, float]
    final_state_path: str
    metrics_path: str
    png_path: str

    def summary(self) -> str:
        return (
            f"held-out before: {self.eval_before}\nheld-out after:  {self.eval_after}\n"
            f"metrics: {self.metrics_path}\ncurve:   {self.png_path}\nstate:   {self.final_state_path}"
        )


def finish_run(run: Run, name: str, curve: list[str], eval_key: str) -> RunResult:
    """`loop.close_run` with every held-out metric of the first and last eval rows (those with `eval_key`)."""
    summary = close_run(run, name, curve, eval_key)
    evals = [eval_part(row) for row in run.log.metrics() if eval_key in row]
    return RunResult(evals[0], evals[-1], summary.final_state_path, summary.metrics_path, summary.png_path)
