"""DPO on (prompt, chosen, rejected) pairs, through the treadle SDK, with the loss computed on the client.

Reference logprobs come from the frozen base model's sampler (`compute_logprobs`), once per
completion before training starts (`--reference forward`: the same numbers from one batched
forward of a fresh adapter, far faster where the sampler answers one request at a time). Each step runs a `forward` for the policy's logprobs of a batch
of pairs, computes the DPO loss and its exact gradient here with numpy (`preference_losses`), and
sends that gradient back as a cross_entropy `forward_backward` (weights = -dLoss/dlogprob), then
`optim_step`. No torch on the client.

By default the pairs are the arithmetic task's (right answer chosen, a graded-wrong one rejected);
`--data_path` takes any JSONL of `{"prompt", "chosen", "rejected"}`. Held-out metrics: implicit-
reward accuracy and margin on held-out pairs and, on the arithmetic task, greedy accuracy.

    python -m treadle.recipes.dpo --base_model SmolLM2-135M-Instruct --steps 20 --log_dir runs/dpo
"""

from __future__ import annotations

import time

from pydantic import Field

from treadle import ServiceClient
from treadle.config import parse_config
from treadle.recipes.lib.loop import batch_indices, end_step, eval_before_training, steps
from treadle.recipes.lib.preference import PreferenceConfig, RunResult, render_pairs, start_preference_run
from treadle.recipes.lib.preference_data import arithmetic_pairs, load_pairs
from treadle.recipes.lib.preference_losses import dpo_on_pairs


class Config(PreferenceConfig):
    """DPO from preference pairs, the loss on the client, through the treadle SDK."""

    log_dir: str = Field(default="runs/dpo", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    pairs: int = Field(default=256, ge=1, description="Arithmetic: training pairs to generate.")
    batch_size: int = Field(default=16, ge=1, description="Pairs per step.")
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="Conservative DPO: assumed share of flipped labels."
    )


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    start = start_preference_run(service or ServiceClient(), cfg)  # a fresh session, or the last checkpoint's
    run, evaluate = start.run, start.evaluate

    # ---------------------------------------------------------------- data, and reference logprobs once per completion
    train = (
        load_pairs(cfg.data_path)
        if cfg.data_path
        else arithmetic_pairs(cfg.pairs, cfg.seed, max_operand=cfg.max_operand)
    )
    pairs = render_pairs(start.tokenizer, start.reference, train, cfg.system_prompt)
    eval_before_training(run, evaluate)

    # ---------------------------------------------------------------- training loop
    for step in (progress := steps(run, cfg.steps, "DPO")):
        started = time.monotonic()
        indices = batch_indices(step, cfg.batch_size, len(train), cfg.seed)
        batch = [pairs.chosen[i] for i in indices] + [pairs.rejected[i] for i in indices]
        loss_fn = dpo_on_pairs(pairs.ref_chosen[indices], pairs.ref_rejected[indices], cfg.beta, cfg.label_smoothing)
        result = start.train_on_loss(batch, loss_fn)
        end_step(run, step, {**result.metrics, "time/step": time.monotonic() - started}, evaluate)
        progress.set_postfix(loss=f"{result.loss:.3f}", acc=f"{result.metrics['dpo/accuracy']:.2f}")

    # ---------------------------------------------------------------- curve and summary
    return start.finish("DPO", ["dpo/loss", "dpo/accuracy", "eval/reward_accuracy", "eval/accuracy"])


if __name__ == "__main__":
    print(main(parse_config(Config, prog="python -m treadle.recipes.dpo")).summary())
