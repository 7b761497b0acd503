"""KTO from binary feedback: unpaired (prompt, completion, desirable?) examples, the loss on the client.

No pairs are needed, only a thumbs up or down per completion. Each step's batch is scored by the
policy in one `forward` together with its mismatched pairs (each prompt with another example's
completion, as in the KTO paper; the partner is fixed once, as TRL's KL dataset is), whose
log-ratio to the reference estimates the KL reference point z0 (floored at 0, no gradient). The
KTO loss and its exact gradient are computed here with numpy and sent back as a cross_entropy
`forward_backward` on the batch's own examples, then `optim_step`.

Reference logprobs come from the frozen base model's sampler, once per completion, before training.
By default the examples are the arithmetic task's, labelled by its grader; `--data_path` takes any
JSONL of `{"prompt", "completion", "label"}`. Held-out metrics are DPO's: implicit-reward accuracy
on held-out pairs and greedy arithmetic accuracy.

    python -m treadle.recipes.kto --base_model SmolLM2-135M-Instruct --steps 20 --log_dir runs/kto
"""

from __future__ import annotations

import random
import time

import numpy as np
from pydantic import Field
from tqdm import tqdm

from treadle import AdamParams, ServiceClient
from treadle.recipes.cli import parse_config
from treadle.recipes.math_tasks import arithmetic_heldout
from treadle.recipes.preference import (
    ReferenceSource, RunResult, completion_datum, finish_run, heldout_metrics, reference_scorer, render_pairs,
)
from treadle.recipes.preference_data import arithmetic_kto_examples, arithmetic_pairs, load_kto_examples, load_pairs
from treadle.recipes.preference_losses import forward_backward_with_loss, kto_on_batch
from treadle.recipes.run_log import RunConfig, RunLog, is_due, resume_or_create
from treadle.recipes.sft import batch_indices


class Config(RunConfig):
    """KTO from desirable / undesirable labels, the loss on the client, through the treadle SDK."""

    base_model: str = Field(default="SmolLM2-135M-Instruct", description="Base model served by the workers (also the reference).")
    log_dir: str = Field(default="runs/kto", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    data_path: str | None = Field(default=None, description="JSONL of {prompt, completion, label}; None: arithmetic examples.")
    heldout_path: str | None = Field(default=None, description="Held-out pairs JSONL {prompt, chosen, rejected}; None: arithmetic.")
    examples: int = Field(default=256, ge=2, description="Arithmetic: labelled examples to generate.")
    desirable_fraction: float = Field(default=0.5, gt=0.0, lt=1.0, description="Arithmetic: share of right (desirable) examples.")
    heldout_pairs: int = Field(default=50, ge=1, description="Arithmetic: held-out pairs (and problems of the accuracy eval).")
    max_operand: int = Field(default=9, ge=1, description="Arithmetic: operands are drawn from [0, max_operand].")
    arithmetic_eval: bool = Field(default=True, description="Also measure greedy accuracy on the held-out arithmetic problems.")
    system_prompt: str | None = Field(default=None, description="System message (None: the chat template's default).")
    seed: int = Field(default=0, description="Seed of the data, the batch order and the LoRA init.")
    steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=16, ge=1, description="Examples per step.")
    reference: ReferenceSource = Field(default="sampler", description="Reference logprobs: the base model's sampler, or a fresh adapter's batched forward.")
    beta: float = Field(default=0.1, gt=0.0, description="KTO beta: the strength of the implicit KL to the reference.")
    desirable_weight: float = Field(default=1.0, gt=0.0, description="lambda_D: weight of desirable examples.")
    undesirable_weight: float = Field(default=1.0, gt=0.0, description="lambda_U: weight of undesirable examples.")
    lora_rank: int = Field(default=16, ge=1, description="LoRA rank (alpha is 2 x rank).")
    learning_rate: float = Field(default=1e-4, gt=0.0, description="AdamW learning rate.")
    max_tokens: int = Field(default=16, ge=1, description="Accuracy eval: most tokens per answer.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Accuracy eval: stop strings.")
    eval_every: int = Field(default=5, ge=0, description="Held-out eval every N steps (0: only before and after).")
    save_every: int = Field(default=10, ge=1, description="save_state every N steps (and at the end).")


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    service = service or ServiceClient()
    log = RunLog.for_config(cfg)
    training, start_step = resume_or_create(service, log, cfg.resume, cfg.base_model, cfg.lora_rank, cfg.seed)
    tokenizer = training.get_tokenizer()

    # ---------------------------------------------------------------- data, and reference logprobs once per completion
    examples = (load_kto_examples(cfg.data_path) if cfg.data_path
                else arithmetic_kto_examples(cfg.examples, cfg.seed, cfg.desirable_fraction, cfg.max_operand))
    heldout = (load_pairs(cfg.heldout_path) if cfg.heldout_path
               else arithmetic_pairs(cfg.heldout_pairs, cfg.seed, heldout=True, max_operand=cfg.max_operand))
    reference = reference_scorer(service, cfg.base_model, cfg.reference)
    datums = [completion_datum(tokenizer, e.prompt, e.completion, cfg.system_prompt) for e in examples]
    # Each prompt's mismatched completion is another example's, fixed once (a seeded derangement), so
    # its reference logprob too is computed once; the batch's z0 averages its examples' pairs.
    order = list(range(len(examples)))
    random.Random(cfg.seed).shuffle(order)
    partner = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
    mismatched = [completion_datum(tokenizer, e.prompt, examples[partner[i]].completion, cfg.system_prompt)
                  for i, e in enumerate(examples)]
    ref = reference([*datums, *mismatched])
    ref, ref_mismatched = ref[: len(datums)], ref[len(datums):]
    desirable = np.array([e.label for e in examples])
    heldout_pairs = render_pairs(tokenizer, reference, heldout, cfg.system_prompt)
    problems = arithmetic_heldout(cfg.heldout_pairs, cfg.max_operand) if cfg.arithmetic_eval else []

    def evaluate(step: int) -> dict[str, float]:
        return heldout_metrics(training, tokenizer, log, step, heldout_pairs, cfg.beta, problems,
                               system_prompt=cfg.system_prompt, max_tokens=cfg.max_tokens, stop=cfg.stop)

    if start_step == 1:
        log.log_metrics(0, evaluate(0))

    # ---------------------------------------------------------------- training loop
    final_state_path = log.last_checkpoint().state_path if start_step > 1 else ""
    progress = tqdm(range(start_step, cfg.steps + 1), desc="KTO", initial=start_step - 1, total=cfg.steps)
    for step in progress:
        started = time.monotonic()
        indices = batch_indices(step, cfg.batch_size, len(examples), cfg.seed)
        loss_fn = kto_on_batch(ref[indices], desirable[indices], ref_mismatched[indices], cfg.beta,
                               cfg.desirable_weight, cfg.undesirable_weight)
        batch = [datums[i] for i in indices] + [mismatched[i] for i in indices]
        fwd_bwd, result = forward_backward_with_loss(training, batch, loss_fn, n_trained=len(indices))
        optim = training.optim_step(AdamParams(learning_rate=cfg.learning_rate, eps=1e-8))
        fwd_bwd.result(), optim.result()
        metrics = {**result.metrics, "desirable_share": float(desirable[indices].mean()), "time/step": time.monotonic() - started}
        if is_due(step, cfg.eval_every, cfg.steps):
            metrics.update(evaluate(step))
        if is_due(step, cfg.save_every, cfg.steps):
            final_state_path = log.save_checkpoint(training, step, metrics)
        else:
            log.log_metrics(step, metrics)
        progress.set_postfix(loss=f"{result.loss:.3f}", kl=f"{result.metrics['kto/kl']:.3f}")

    # ---------------------------------------------------------------- curve and summary
    return finish_run(log, final_state_path, ["kto/loss", "kto/kl", "eval/reward_accuracy", "eval/accuracy"],
                      f"KTO ({cfg.base_model})", "eval/reward_accuracy")


if __name__ == "__main__":
    print(main(parse_config(Config, prog="python -m treadle.recipes.kto")).summary())
