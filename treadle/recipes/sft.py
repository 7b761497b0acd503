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
from functools import partial
from typing import Any, Literal

from pydantic import Field
from tqdm import tqdm

from treadle import Datum, ServiceClient
from treadle.config import parse_config
from treadle.recipes.lib.conversations import EXAMPLE_CONVERSATIONS, load_conversations, load_hf_conversations
from treadle.recipes.lib.datums import supervised_datum
from treadle.recipes.lib.loop import Run, adam, batch_indices, close_run, eval_before_training, is_due, start_run, steps
from treadle.recipes.lib.packing import pack_conversations
from treadle.recipes.lib.rendering import RenderedConversation, render_conversation
from treadle.recipes.lib.run_log import RunConfig


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
    forward_backward: Any
    optim: Any
    eval: Any | None
    save: Any | None


@dataclass
class Datums:
    """The training datums, and the held-out ones whose loss is measured."""

    train: list[Datum]
    heldout: list[Datum]

    def heldout_loss(self, future: Any) -> float:
        """Mean loss per trained token of the held-out split, from the future of its `forward`."""
        return future.result().metrics["loss:sum"] / sum(trained_weight(d) for d in self.heldout)


def trained_weight(datum: Datum) -> float:
    return sum(datum.loss_fn_inputs["weights"].data)


def load_datums(cfg: Config, tokenizer: Any) -> Datums:
    """The conversations rendered once (assistant-only mask, truncated), shuffled and split once."""
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
    train = rendered[cfg.eval_size :]
    train = pack_conversations(train, cfg.pack_tokens) if cfg.pack_tokens else train
    heldout = rendered[: cfg.eval_size]
    return Datums(
        [supervised_datum(r.tokens, r.mask) for r in train], [supervised_datum(r.tokens, r.mask) for r in heldout]
    )


def evaluate(training: Any, datums: Datums, step: int) -> dict[str, float]:
    return {"eval/loss": datums.heldout_loss(training.forward(datums.heldout, "cross_entropy"))}


def submit_step(training: Any, datums: Datums, cfg: Config, step: int) -> Submitted:
    """Enqueue step `step`: its batch's forward_backward and optim_step, then the held-out `forward` (which so
    sees exactly this step's weights) and the checkpoint when they are due."""
    batch = [datums.train[i] for i in batch_indices(step, cfg.batch_size, len(datums.train), cfg.seed)]
    fwd_bwd = training.forward_backward(batch, "cross_entropy")
    optim = training.optim_step(adam(cfg))
    heldout = training.forward(datums.heldout, "cross_entropy") if is_due(step, cfg.eval_every, cfg.steps) else None
    save = training.save_state(f"step-{step:06d}") if is_due(step, cfg.save_every, cfg.steps) else None
    return Submitted(step, time.monotonic(), sum(trained_weight(d) for d in batch), fwd_bwd, optim, heldout, save)


def finish_step(run: Run, datums: Datums, s: Submitted) -> dict[str, float]:
    """Read a step's results and log its row (and its checkpoint's record, after the row: see `loop.end_step`)."""
    loss = s.forward_backward.result().metrics["loss:sum"]
    s.optim.result()
    metrics = {"train/loss": loss / s.trained_weight, "tokens": s.trained_weight}
    if s.eval is not None:
        metrics["eval/loss"] = datums.heldout_loss(s.eval)
    if s.save is not None:
        run.state_path = s.save.result().path
    metrics["time/step"] = time.monotonic() - s.started
    run.log.log_metrics(s.step, metrics)
    if s.save is not None:
        run.log.record_checkpoint(f"step-{s.step:06d}", s.step, run.state_path)
    return metrics


def main(cfg: Config, service: ServiceClient | None = None) -> RunResult:
    run = start_run(service or ServiceClient(), cfg)  # its log, and a fresh session or the last checkpoint's
    training, tokenizer = run.training, run.training.get_tokenizer()

    # ---------------------------------------------------------------- data: render once, split once
    datums = load_datums(cfg, tokenizer)
    eval_before_training(run, partial(evaluate, training, datums))

    # ---------------------------------------------------------------- pipelined loop: submit ahead, then read
    in_flight: deque[Submitted] = deque()
    for step in (progress := steps(run, cfg.steps, "SFT")):
        in_flight.append(submit_step(training, datums, cfg, step))
        while len(in_flight) > cfg.submit_ahead:
            metrics = finish_step(run, datums, in_flight.popleft())
            progress.set_postfix(loss=f"{metrics['train/loss']:.3f}")
    while in_flight:  # the last steps' results
        finish_step(run, datums, in_flight.popleft())

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
