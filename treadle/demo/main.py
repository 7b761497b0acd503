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
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from treadle.local_stack import LocalStack
    from treadle.recipes import math_rl

MODEL_NAME = "SmolLM2-135M-Instruct"
_GRPO = "GRPO (eval before, train, eval after)"  # the phase whose time is split into evals and training


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
    from treadle.local_stack import LocalStack
    from treadle.recipes import math_rl

    cfg = (config or DemoConfig()).model_copy(update=overrides)
    timings: dict[str, float] = {}
    started = time.monotonic()
    model_name, model_dir = _model(cfg, timings)
    stack = LocalStack([f"{model_name}={model_dir}"], home=os.path.join(cfg.home, "stack"))
    _start(stack, cfg.worker_threads, timings)
    try:
        service = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
        with _phase(timings, _GRPO):
            result = math_rl.main(_rl_config(cfg, model_name), service)
    finally:
        stack.stop()
    _split_grpo(timings, result.eval_seconds)
    timings["total"] = time.monotonic() - started
    _print_summary(cfg, model_name, result, timings, stack.storage_url)
    return {
        "seed": cfg.seed,
        "accuracy_before": result.eval_before,
        "accuracy_after": result.eval_after,
        "seconds": timings,
        "metrics_path": result.metrics_path,
        "png_path": result.png_path,
        "final_checkpoint": result.final_state_path,
    }


def _model(cfg: DemoConfig, timings: dict[str, float]) -> tuple[str, str]:
    """The served model's name and directory: the cached SmolLM2, converted on first use, or `model_dir`."""
    from treadle.demo.model import cached_smollm2, prepare_smollm2

    model_dir = cfg.model_dir or cached_smollm2(cfg.model_cache_dir)
    if model_dir is None:
        with _phase(timings, "prepare model"):
            model_dir = prepare_smollm2(cfg.model_cache_dir)
    else:
        print(f"[demo] model: {model_dir}", flush=True)
    return (os.path.basename(os.path.normpath(cfg.model_dir)) if cfg.model_dir else MODEL_NAME), model_dir


def _start(stack: LocalStack, worker_threads: int, timings: dict[str, float]) -> None:
    """Start the stack with its worker on `worker_threads` torch threads, leaving this process's setting as it was."""
    previous_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(worker_threads)  # read by the worker process at start
    try:
        with _phase(timings, "start stack"):
            stack.start()
    finally:
        if previous_threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous_threads


def _rl_config(cfg: DemoConfig, model_name: str) -> math_rl.Config:
    from treadle.recipes import math_rl

    # The demo's own knobs of the same name are the recipe's.
    shared = cfg.model_dump(
        include={
            "seed",
            "steps",
            "groups_per_batch",
            "group_size",
            "learning_rate",
            "lora_rank",
            "eval_problems",
            "eval_every",
        }
    )
    return math_rl.Config(
        **shared,
        base_model=model_name,
        log_dir=os.path.join(cfg.home, f"runs/seed-{cfg.seed}"),
        save_every=cfg.steps,
        max_tokens=16,
        temperature=1.0,
    )


def _split_grpo(timings: dict[str, float], evals: list[float]) -> None:
    """The GRPO phase's time as its evals and its training steps (every eval is counted apart)."""
    rl_total = timings.pop(_GRPO)
    timings["eval before"] = evals[0]
    timings["train"] = rl_total - sum(evals)
    if len(evals) > 2:
        timings["evals during"] = sum(evals[1:-1])
    timings["eval after"] = evals[-1]


def _print_summary(
    cfg: DemoConfig, model_name: str, result: math_rl.RunResult, timings: dict[str, float], storage_url: str
) -> None:
    print(f"\nheld-out accuracy of {model_name} on {cfg.eval_problems} arithmetic problems (greedy), seed {cfg.seed}")
    print(f"  {'before':>8} {'after':>8} {'change':>8}")
    print(f"  {result.eval_before:8.1%} {result.eval_after:8.1%} {result.eval_after - result.eval_before:+8.1%}")
    print("\nwall time per phase")
    for name, seconds in timings.items():
        print(f"  {name:<14} {seconds:7.1f} s")
    print(
        f"\nmetrics:          {result.metrics_path}\ncurve:            {result.png_path}\n"
        f"final checkpoint: {result.final_state_path}\n(stored under {storage_url})"
    )


if __name__ == "__main__":
    from treadle.config import parse_config

    run_demo(parse_config(DemoConfig, prog="python -m treadle.demo.main"))
