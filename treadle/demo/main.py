"""The demo: GRPO visibly teaches SmolLM2-135M-Instruct arithmetic on a CPU, through treadle's SDK.

What it really does: converts SmolLM2-135M-Instruct (shipped on PyPI as GGUF) into a cached model
directory, starts the embedded stack (Redis + one worker serving that model), and runs the
`math_rl` recipe on one-digit addition and subtraction ("What is 7 - 3?"): the fixed held-out set
is answered greedily before training, then GRPO trains a LoRA adapter for a few steps, answering
the held-out set again every `eval_every` steps and at the end. The base model usually knows the sums but rambles ("7 - 3 is a
simple arithmetic operation that ...") past the 16-token budget or miscounts; reward for right
answers teaches it to answer briefly and correctly. The held-out questions are never trained on.

    treadle demo [--seed 1]        # or: python -m treadle.demo.main
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from pydantic import BaseModel, Field

MODEL_NAME = "SmolLM2-135M-Instruct"


class DemoConfig(BaseModel):
    """GRPO on SmolLM2-135M-Instruct through a local treadle stack: held-out accuracy before and after."""

    seed: int = Field(default=0, description="Seed of the training problems, the sampler and the LoRA init.")
    steps: int = Field(default=10, ge=1, description="GRPO steps.")
    groups_per_batch: int = Field(default=8, ge=1, description="Problems per step.")
    group_size: int = Field(default=8, ge=2, description="Samples per problem.")
    learning_rate: float = Field(default=3e-4, gt=0.0, description="AdamW learning rate of the LoRA adapter.")
    lora_rank: int = Field(default=16, ge=1, description="LoRA rank.")
    eval_problems: int = Field(default=50, ge=1, description="Size of the fixed held-out set.")
    home: str = Field(
        default=os.path.expanduser("~/.treadle/demo"), description="Stack state, logs, checkpoints and run logs."
    )
    model_cache_dir: str | None = Field(
        default=None, description="Converted model directory (default: ~/.cache/treadle/models/...)."
    )
    model_dir: str | None = Field(
        default=None, description="Serve this model directory instead of SmolLM2 (e.g. a tiny test model)."
    )
    worker_threads: int = Field(
        default_factory=lambda: os.cpu_count() or 1,
        ge=1,
        description="Torch threads of the worker (default: every CPU core of this machine).",
    )
    eval_every: int = Field(
        default=5, ge=0, description="Held-out eval every N steps, besides before and after (0: only those)."
    )


@contextmanager
def _phase(timings: dict[str, float], name: str):
    print(f"[demo] {name} ...", flush=True)
    started = time.monotonic()
    yield
    timings[name] = time.monotonic() - started


def run_demo(config: DemoConfig | None = None, **overrides) -> dict:
    """Run the demo end to end; returns the numbers it prints (accuracies, seconds per phase, paths)."""
    from treadle import ServiceClient
    from treadle.demo.model import cached_smollm2, prepare_smollm2
    from treadle.local_stack import LocalStack
    from treadle.recipes import math_rl

    cfg = (config or DemoConfig()).model_copy(update=overrides)
    timings: dict[str, float] = {}
    started = time.monotonic()
    model_dir = cfg.model_dir or cached_smollm2(cfg.model_cache_dir)
    if model_dir is None:
        with _phase(timings, "prepare model"):
            model_dir = prepare_smollm2(cfg.model_cache_dir)
    else:
        print(f"[demo] model: {model_dir}", flush=True)
    model_name = os.path.basename(os.path.normpath(cfg.model_dir)) if cfg.model_dir else MODEL_NAME

    stack = LocalStack([f"{model_name}={model_dir}"], home=os.path.join(cfg.home, "stack"))
    previous_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(cfg.worker_threads)  # read by the worker process at start
    try:
        with _phase(timings, "start stack"):
            stack.start()
    finally:
        if previous_threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous_threads
    try:
        service = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
        rl_config = math_rl.Config(
            base_model=model_name,
            log_dir=os.path.join(cfg.home, f"runs/seed-{cfg.seed}"),
            seed=cfg.seed,
            steps=cfg.steps,
            groups_per_batch=cfg.groups_per_batch,
            group_size=cfg.group_size,
            learning_rate=cfg.learning_rate,
            lora_rank=cfg.lora_rank,
            eval_problems=cfg.eval_problems,
            eval_every=cfg.eval_every,
            save_every=cfg.steps,
            max_tokens=16,
            temperature=1.0,
        )
        with _phase(timings, "GRPO (eval before, train, eval after)"):
            result = math_rl.main(rl_config, service)
    finally:
        stack.stop()
    evals = result.eval_seconds
    rl_total = timings.pop("GRPO (eval before, train, eval after)")
    timings["eval before"] = evals[0]
    timings["train"] = rl_total - sum(evals)  # training steps only: every eval is counted apart
    if len(evals) > 2:
        timings["evals during"] = sum(evals[1:-1])
    timings["eval after"] = evals[-1]
    timings["total"] = time.monotonic() - started

    print(f"\nheld-out accuracy of {model_name} on {cfg.eval_problems} arithmetic problems (greedy), seed {cfg.seed}")
    print(f"  {'before':>8} {'after':>8} {'change':>8}")
    print(f"  {result.eval_before:8.1%} {result.eval_after:8.1%} {result.eval_after - result.eval_before:+8.1%}")
    print("\nwall time per phase")
    for name, seconds in timings.items():
        print(f"  {name:<14} {seconds:7.1f} s")
    print(
        f"\nmetrics:          {result.metrics_path}\ncurve:            {result.png_path}\n"
        f"final checkpoint: {result.final_state_path}\n(stored under {stack.storage_url})"
    )
    return {
        "seed": cfg.seed,
        "accuracy_before": result.eval_before,
        "accuracy_after": result.eval_after,
        "seconds": timings,
        "metrics_path": result.metrics_path,
        "png_path": result.png_path,
        "final_checkpoint": result.final_state_path,
    }


if __name__ == "__main__":
    from treadle.recipes.cli import parse_config

    run_demo(parse_config(DemoConfig, prog="python -m treadle.demo.main"))
