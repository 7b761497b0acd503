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

from treadle import ServiceClient
from treadle.config import parse_config
from treadle.recipes.lib.loop import batch_indices, end_step, eval_before_training, steps
from treadle.recipes.lib.preference import PreferenceConfig, RunResult, completion_datum, start_preference_run
from treadle.recipes.lib.preference_data import arithmetic_kto_examples, load_kto_examples
from treadle.recipes.lib.preference_losses import kto_on_batch


class Config(PreferenceConfig):
    """KTO from desirable / undesirable labels, the loss on the client, through the treadle SDK."""

    log_dir: str = Field(default="runs/kto", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    examples: int = Field(default=256, ge=2, description="Arithmetic: labelled examples to generate.")
    desirable_fraction: float = Field(
        default=0.5, gt=0.0, lt=1.0, description="Arithmetic: share of right (desirable) examples."
    )
    batch_size: int = Field(default=16, ge=1, description="Examples per step.")
    desirable_weight: float = Field(default=1.0, gt=0.0, description="lambda_D: weight of desirable examples.")
    undesirable_weight: float = Field(default=1.0, gt=0.0, description="lambda_U: weight of undesirable examples.")


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    start = start_preference_run(service or ServiceClient(), cfg)  # a fresh session, or the last checkpoint's
    run, tokenizer, evaluate = start.run, start.tokenizer, start.evaluate

    # ---------------------------------------------------------------- data, and reference logprobs once per completion
    examples = (
        load_kto_examples(cfg.data_path)
        if cfg.data_path
        else arithmetic_kto_examples(cfg.examples, cfg.seed, cfg.desirable_fraction, cfg.max_operand)
    )
    datums = [completion_datum(tokenizer, e.prompt, e.completion, cfg.system_prompt) for e in examples]
    # Each prompt's mismatched completion is another example's, fixed once (a seeded derangement), so
    # its reference logprob too is computed once; the batch's z0 averages its examples' pairs.
    order = list(range(len(examples)))
    random.Random(cfg.seed).shuffle(order)
    partner = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
    mismatched = [
        completion_datum(tokenizer, e.prompt, examples[partner[i]].completion, cfg.system_prompt)
        for i, e in enumerate(examples)
    ]
    ref = start.reference([*datums, *mismatched])
    ref, ref_mismatched = ref[: len(datums)], ref[len(datums) :]
    desirable = np.array([e.label for e in examples])
    eval_before_training(run, evaluate)

    # ---------------------------------------------------------------- training loop
    for step in (progress := steps(run, cfg.steps, "KTO")):
        started = time.monotonic()
        indices = batch_indices(step, cfg.batch_size, len(examples), cfg.seed)
        loss_fn = kto_on_batch(
            ref[indices],
            desirable[indices],
            ref_mismatched[indices],
            cfg.beta,
            cfg.desirable_weight,
            cfg.undesirable_weight,
        )
        batch = [datums[i] for i in indices] + [mismatched[i] for i in indices]
        result = start.train_on_loss(batch, loss_fn, n_trained=len(indices))
        metrics = {
            **result.metrics,
            "desirable_share": float(desirable[indices].mean()),
            "time/step": time.monotonic() - started,
        }
        end_step(run, step, metrics, evaluate)
        progress.set_postfix(loss=f"{result.loss:.3f}", kl=f"{result.metrics['kto/kl']:.3f}")

    # ---------------------------------------------------------------- curve and summary
    return start.finish("KTO", ["kto/loss", "kto/kl", "eval/reward_accuracy", "eval/accuracy"])


if __name__ == "__main__":
    print(main(parse_config(Config, prog="python -m treadle.recipes.kto")).summary())
