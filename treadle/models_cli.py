"""`treadle models check MODEL`: the pre-flight an operator runs before pointing a worker at a model.

With `--memory_gb G` it loads no weight: it says from the config's shapes whether the model fits `--devices N`
devices of G GB (sharded with `--shard`), with how many resident sessions and tokens per micro-batch
(treadle.gpu_worker.model.fit)."""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel, Field

from treadle.config import add_config_args, config_of


class ModelsCheckConfig(BaseModel):
    device: str | None = Field(
        default=None, description="Device (default: the one a worker would pick: CUDA, else CPU)."
    )
    dtype: str | None = Field(
        default=None, description="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)."
    )
    smoke: bool = Field(
        default=True, description="Also train two steps and sample (--no-smoke: load and profile only)."
    )
    as_json: bool = Field(default=False, description="Print the profile (and smoke result) as JSON.")
    memory_gb: float | None = Field(
        default=None,
        gt=0,
        description="Memory of one device in GB: say from the config's shapes, loading no weight, whether the model fits (no smoke run).",
    )
    devices: int = Field(default=1, ge=1, description="With --memory_gb: devices of the worker's group (all hosts).")
    shard: bool = Field(default=False, description="With --memory_gb: the group shards the base weights (FSDP2).")
    lora_rank: int = Field(default=32, ge=1, description="With --memory_gb: LoRA rank of a resident session.")


def cmd_models(ns) -> None:
    cfg = config_of(ns)
    if cfg.memory_gb is not None:
        failed = [f"{model}: does not fit" for model in ns.models if not fit_one(model, cfg)]
        if failed:
            sys.exit("treadle models check: " + "; ".join(failed))
        return
    failed = [f"{model}: {problem}" for model in ns.models for problem in check_one(model, cfg)]
    if failed:
        sys.exit("treadle models check: " + "; ".join(failed))


def fit_one(model: str, cfg: ModelsCheckConfig) -> bool:
    """Print whether `model` fits the devices `cfg` names (from its config alone); returns whether it does."""
    from treadle.gpu_worker.model.fit import plan

    fit = plan(
        model,
        devices=cfg.devices,
        shard=cfg.shard,
        memory_gb=cfg.memory_gb or 0.0,
        dtype=cfg.dtype or "bfloat16",
        lora_rank=cfg.lora_rank,
    )
    if cfg.as_json:
        print(json.dumps(vars(fit) | {"fits": fit.fits}, indent=2))
    else:
        print(f"model         {model}")
        print(fit.render())
    print(flush=True)
    return fit.fits


def check_one(model: str, cfg: ModelsCheckConfig) -> list[str]:
    """Load, profile and smoke-test one model, printing the result and its verdict (serves, refused and why, or
    what failed in the smoke run); returns what failed."""
    from treadle.errors import InvalidRequestError
    from treadle.gpu_worker import model_check
    from treadle.gpu_worker.engine import Engine

    print(f"loading {model} ...", file=sys.stderr, flush=True)
    try:
        engine = Engine(model, device=cfg.device, dtype=cfg.dtype)
    except (InvalidRequestError, ValueError) as exc:
        _report(model, cfg, {}, f"refused: {exc}", "")
        return [f"cannot serve {model}: {exc}"]
    result, problems = None, []
    try:
        result = model_check.smoke(engine) if cfg.smoke else None
    except Exception as exc:  # a verdict, not a traceback: what the first session would have met
        problems = [f"the smoke run failed: {type(exc).__name__}: {exc}"]
    finally:
        engine.close()
    if result is not None:
        problems = model_check.check_result(engine.profile, result)
    verdict = f"fails: {'; '.join(problems)}" if problems else "serves"
    body = engine.profile.model_dump() | ({"smoke": vars(result)} if result is not None else {})
    _report(model, cfg, body, verdict, model_check.render(engine.profile, result))
    return problems


def _report(model: str, cfg: ModelsCheckConfig, body: dict, verdict: str, text: str) -> None:
    if cfg.as_json:
        print(json.dumps(body | {"model": model, "verdict": verdict}, indent=2))
    else:
        print(f"model         {model}")
        if text:  # the profile and smoke result (none for a model refused at load)
            print(text)
        print(f"verdict       {verdict}")
    print(flush=True)  # a blank line between models


def add_model_commands(sub) -> None:
    p = sub.add_parser(
        "models", help="Check that a worker can serve a model: family, LoRA targets, sampler, a smoke run."
    )
    p.add_argument("action", choices=["check"])
    p.add_argument("models", nargs="+", metavar="MODEL", help="Local directories or cached hub ids.")
    add_config_args(p, ModelsCheckConfig, "TREADLE_MODELS_", section="models")
    p.set_defaults(func=cmd_models)
