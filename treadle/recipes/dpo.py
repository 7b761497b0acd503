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
from tqdm import tqdm

from treadle import AdamParams, ServiceClient
from treadle.recipes.cli import parse_config
from treadle.recipes.math_tasks import arithmetic_heldout
from treadle.recipes.preference import (
    ReferenceSource, RunResult, finish_run, heldout_metrics, reference_scorer, render_pairs,
)
from treadle.recipes.preference_data import arithmetic_pairs, load_pairs
from treadle.recipes.preference_losses import dpo_on_pairs, forward_backward_with_loss
from treadle.recipes.run_log import RunConfig, RunLog, is_due, resume_or_create
from treadle.recipes.sft import batch_indices


class Config(RunConfig):
    """DPO from preference pairs, the loss on the client, through the treadle SDK."""

    base_model: str = Field(default="SmolLM2-135M-Instruct", description="Base model served by the workers (also the reference).")
    log_dir: str = Field(default="runs/dpo", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    data_path: str | None = Field(default=None, description="JSONL of {prompt, chosen, rejected}; None: arithmetic pairs.")
    heldout_path: str | None = Field(default=None, description="Held-out pairs JSONL; None: arithmetic held-out pairs.")
    pairs: int = Field(default=256, ge=1, description="Arithmetic: training pairs to generate.")
    heldout_pairs: int = Field(default=50, ge=1, description="Arithmetic: held-out pairs (and problems of the accuracy eval).")
    max_operand: int = Field(default=9, ge=1, description="Arithmetic: operands are drawn from [0, max_operand].")
    arithmetic_eval: bool = Field(default=True, description="Also measure greedy accuracy on the held-out arithmetic problems.")
    system_prompt: str | None = Field(default=None, description="System message (None: the chat template's default).")
    seed: int = Field(default=0, description="Seed of the data, the batch order and the LoRA init.")
    steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=16, ge=1, description="Pairs per step.")
    reference: ReferenceSource = Field(default="sampler", description="Reference logprobs: the base model's sampler, or a fresh adapter's batched forward.")
    beta: float = Field(default=0.1, gt=0.0, description="DPO beta: the strength of the implicit KL to the reference.")
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5, description="Conservative DPO: assumed share of flipped labels.")
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
    train = load_pairs(cfg.data_path) if cfg.data_path else arithmetic_pairs(cfg.pairs, cfg.seed, max_operand=cfg.max_operand)
    heldout = (load_pairs(cfg.heldout_path) if cfg.heldout_path
               else arithmetic_pairs(cfg.heldout_pairs, cfg.seed, heldout=True, max_operand=cfg.max_operand))
    reference = reference_scorer(service, cfg.base_model, cfg.reference)
    pairs = render_pairs(tokenizer, reference, train, cfg.system_prompt)
    heldout_pairs = render_pairs(tokenizer, reference, heldout, cfg.system_prompt)
    problems = arithmetic_heldout(cfg.heldout_pairs, cfg.max_operand) if cfg.arithmetic_eval else []

    def evaluate(step: int) -> dict[str, float]:
        return heldout_metrics(training, tokenizer, log, step, heldout_pairs, cfg.beta, problems,
                               system_prompt=cfg.system_prompt, max_tokens=cfg.max_tokens, stop=cfg.stop)

    if start_step == 1:
        log.log_metrics(0, evaluate(0))

    # ---------------------------------------------------------------- training loop
    final_state_path = log.last_checkpoint().state_path if start_step > 1 else ""
    progress = tqdm(range(start_step, cfg.steps + 1), desc="DPO", initial=start_step - 1, total=cfg.steps)
    for step in progress:
        started = time.monotonic()
        indices = batch_indices(step, cfg.batch_size, len(train), cfg.seed)
        batch = [pairs.chosen[i] for i in indices] + [pairs.rejected[i] for i in indices]
        loss_fn = dpo_on_pairs(pairs.ref_chosen[indices], pairs.ref_rejected[indices], cfg.beta, cfg.label_smoothing)
        fwd_bwd, result = forward_backward_with_loss(training, batch, loss_fn)
        optim = training.optim_step(AdamParams(learning_rate=cfg.learning_rate, eps=1e-8))
        fwd_bwd.result(), optim.result()
        metrics = {**result.metrics, "time/step": time.monotonic() - started}
        if is_due(step, cfg.eval_every, cfg.steps):
            metrics.update(evaluate(step))
        if is_due(step, cfg.save_every, cfg.steps):
            final_state_path = log.save_checkpoint(training, step, metrics)
        else:
            log.log_metrics(step, metrics)
        progress.set_postfix(loss=f"{result.loss:.3f}", acc=f"{result.metrics['dpo/accuracy']:.2f}")

    # ---------------------------------------------------------------- curve and summary
    return finish_run(log, final_state_path, ["dpo/loss", "dpo/accuracy", "eval/reward_accuracy", "eval/accuracy"],
                      f"DPO ({cfg.base_model})", "eval/reward_accuracy")


if __name__ == "__main__":
    print(main(parse_config(Config, prog="python -m treadle.recipes.dpo")).summary())
