"""Supervised fine-tuning on chat conversations (JSONL, JSON, parquet or HF datasets), through the treadle SDK.

Each conversation is rendered with the tokenizer's own chat template and trained with cross_entropy
on assistant tokens only. Submission is pipelined: step s+1's forward_backward and optim_step are
enqueued before step s's results are read (`submit_ahead`), so the worker never idles waiting for
this loop. Held-out loss (a `forward` on a fixed split, no gradients) is submitted right after the
optim_step it measures, so it sees exactly the weights of that step.

    python -m treadle.recipes.sft --base_model SmolLM2-135M-Instruct --steps 20 --log_dir runs/sft
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from tqdm import tqdm

from treadle import ServiceClient
from treadle.recipes.cli import parse_config
from treadle.recipes.conversations import EXAMPLE_CONVERSATIONS, load_conversations, load_hf_conversations
from treadle.recipes.datums import supervised_datum
from treadle.recipes.loop import adam, batch_indices, close_run, eval_before_training, is_due, start_run, steps
from treadle.recipes.packing import pack_conversations
from treadle.recipes.rendering import RenderedConversation, render_conversation
from treadle.recipes.run_log import RunConfig, RunLog


class Config(RunConfig):
    """Chat SFT with an assistant-only loss mask, pipelined through the treadle SDK."""

    log_dir: str = Field(default="runs/sft", description="Where metrics.jsonl, checkpoints.jsonl and the PNG go.")
    data_path: str = Field(
        default=EXAMPLE_CONVERSATIONS,
        description="Conversations file: JSONL, JSON or parquet (Tulu 3 / UltraChat layouts; unless hf_dataset).",
    )
    hf_dataset: str | None = Field(
        default=None, description="HF dataset instead, e.g. allenai/tulu-3-sft-mixture (online)."
    )
    hf_split: str = Field(default="train", description="Split of hf_dataset (UltraChat: train_sft).")
    hf_limit: int | None = Field(default=2000, description="Use the first N conversations of hf_dataset (None: all).")
    eval_size: int = Field(default=8, ge=1, description="Conversations held out for the eval loss.")
    batch_size: int = Field(default=8, ge=1, description="Conversations per step.")
    max_length: int = Field(default=512, ge=2, description="Truncate rendered conversations to this many tokens.")
    pack_tokens: int | None = Field(
        default=None,
        ge=2,
        description="Pack training conversations into sequences of up to N tokens (None: one per datum).",
    )
    train_on: Literal["all_assistant", "last_assistant"] = Field(
        default="all_assistant", description="Which assistant turns to train on."
    )
    learning_rate: float = Field(default=2e-4, gt=0.0, description="AdamW learning rate.")
    submit_ahead: int = Field(default=1, ge=0, description="Steps enqueued before the oldest result is read.")


@dataclass
class RunResult:
    eval_loss_before: float
    eval_loss_after: float
    final_state_path: str
    metrics_path: str
    png_path: str


@dataclass
class Submitted:
    """One step's futures, waiting to be read."""

    step: int
    started: float
    trained_weight: float
    forward_backward: object
    optim: object
    eval: object | None
    save: object | None


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    service = service or ServiceClient()
    log = RunLog.for_config(cfg)
    run = start_run(service, log, cfg)  # a fresh session, or the last checkpoint's
    training, tokenizer = run.training, run.training.get_tokenizer()

    # ---------------------------------------------------------------- data: render once, split once
    if cfg.hf_dataset:
        conversations = load_hf_conversations(cfg.hf_dataset, cfg.hf_split, cfg.hf_limit)
    else:
        conversations = load_conversations(cfg.data_path)
    random.Random(cfg.seed).shuffle(conversations)
    if len(conversations) <= cfg.eval_size:
        raise ValueError(f"eval_size={cfg.eval_size} leaves no training data out of {len(conversations)} conversations")
    rendered = []
    for messages in tqdm(conversations, desc="render", leave=False):
        full = render_conversation(tokenizer, messages, cfg.train_on)
        rendered.append(RenderedConversation(full.tokens[: cfg.max_length], full.mask[: cfg.max_length]))
    # Held-out conversations stay one per datum, so the eval loss does not depend on packing.
    train_rendered = (
        pack_conversations(rendered[cfg.eval_size :], cfg.pack_tokens) if cfg.pack_tokens else rendered[cfg.eval_size :]
    )
    eval_datums = [supervised_datum(r.tokens, r.mask) for r in rendered[: cfg.eval_size]]
    train_datums = [supervised_datum(r.tokens, r.mask) for r in train_rendered]
    eval_weight = sum(sum(d.loss_fn_inputs["weights"].data) for d in eval_datums)

    def eval_loss(future) -> float:
        """Mean loss per trained token of the held-out split."""
        return future.result().metrics["loss:sum"] / eval_weight

    eval_before_training(run, lambda step: {"eval/loss": eval_loss(training.forward(eval_datums, "cross_entropy"))})

    # ---------------------------------------------------------------- pipelined loop
    def submit(step: int) -> Submitted:
        batch = [train_datums[i] for i in batch_indices(step, cfg.batch_size, len(train_datums), cfg.seed)]
        fwd_bwd = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(adam(cfg))
        evaluate = is_due(step, cfg.eval_every, cfg.steps)
        save = is_due(step, cfg.save_every, cfg.steps)
        return Submitted(
            step,
            time.monotonic(),
            sum(sum(d.loss_fn_inputs["weights"].data) for d in batch),
            fwd_bwd,
            optim,
            training.forward(eval_datums, "cross_entropy") if evaluate else None,
            training.save_state(f"step-{step:06d}") if save else None,
        )

    def finish(s: Submitted) -> None:
        """Read a step's results and log its row (and its checkpoint's record)."""
        loss = s.forward_backward.result().metrics["loss:sum"]
        s.optim.result()
        metrics = {"train/loss": loss / s.trained_weight, "tokens": s.trained_weight}
        if s.eval is not None:
            metrics["eval/loss"] = eval_loss(s.eval)
        if s.save is not None:
            run.state_path = s.save.result().path
        metrics["time/step"] = time.monotonic() - s.started
        log.log_metrics(s.step, metrics)  # before the checkpoint's record: see loop.end_step
        if s.save is not None:
            log.record_checkpoint(f"step-{s.step:06d}", s.step, run.state_path)
        progress.set_postfix(loss=f"{metrics['train/loss']:.3f}")

    in_flight: deque[Submitted] = deque()
    for step in (progress := steps(run, cfg.steps, "SFT")):
        in_flight.append(submit(step))
        while len(in_flight) > cfg.submit_ahead:
            finish(in_flight.popleft())
    while in_flight:
        finish(in_flight.popleft())

    # ---------------------------------------------------------------- curve and summary
    summary = close_run(run, "SFT", ["train/loss", "eval/loss"], "eval/loss")
    return RunResult(
        summary.eval_before, summary.eval_after, summary.final_state_path, summary.metrics_path, summary.png_path
    )


if __name__ == "__main__":
    result = main(parse_config(Config, prog="python -m treadle.recipes.sft"))
    print(
        f"held-out loss {result.eval_loss_before:.3f} -> {result.eval_loss_after:.3f}\n"
        f"metrics: {result.metrics_path}\ncurve:   {result.png_path}\nstate:   {result.final_state_path}"
    )
