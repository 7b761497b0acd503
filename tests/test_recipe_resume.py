"""Every recipe resumes exactly where it was: drop the last checkpoint (as if the run died after the first
save) and resume; the steps after it come out identical to the uninterrupted run (sft and math_rl have
their own tests of this shape in test_recipes.py, math_rl with a real SIGKILL). Batches of 2 from 8 examples:
every step reads other data, so a resume that restarted the data stream would differ too."""

from __future__ import annotations

import json

import pytest

from treadle.recipes import distill, dpo, kto
from treadle.recipes.lib.preference_data import arithmetic_kto_examples, arithmetic_pairs, write_jsonl


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _config(recipe: str, tmp_path):
    run = dict(base_model="tiny", log_dir=str(tmp_path / "run"), steps=4, save_every=2, eval_every=0, lora_rank=4)
    if recipe == "dpo":
        pairs = write_jsonl(str(tmp_path / "pairs.jsonl"), arithmetic_pairs(8, seed=0, max_operand=3))
        return (
            dpo,
            dpo.Config(
                **run,
                pairs=8,
                heldout_path=pairs,
                heldout_pairs=2,
                max_operand=3,
                batch_size=2,
                beta=0.5,
                learning_rate=5e-3,
                max_tokens=4,
            ),
            "dpo/loss",
        )
    if recipe == "kto":
        data = write_jsonl(str(tmp_path / "kto.jsonl"), arithmetic_kto_examples(8, seed=0, max_operand=3))
        pairs = write_jsonl(str(tmp_path / "pairs.jsonl"), arithmetic_pairs(4, seed=0, max_operand=3))
        return (
            kto,
            kto.Config(
                **run,
                data_path=data,
                heldout_path=pairs,
                arithmetic_eval=False,
                batch_size=2,
                beta=0.5,
                learning_rate=5e-3,
            ),
            "kto/loss",
        )
    return (
        distill,
        distill.Config(
            **run,
            max_operand=3,
            prompts_per_batch=2,
            samples_per_prompt=2,
            max_tokens=4,
            learning_rate=1e-2,
            eval_prompts=2,
            eval_samples=1,
            arithmetic_eval=False,
        ),
        "kl/student_teacher",
    )


@pytest.mark.parametrize("recipe", ["dpo", "kto", "distill"])
def test_recipe_resumes_from_its_checkpoint_repeating_and_skipping_no_step(service_client, tmp_path, recipe):
    module, cfg, key = _config(recipe, tmp_path)
    module.main(cfg, service_client)
    original = _rows(tmp_path / "run" / "metrics.jsonl")
    checkpoints = (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(c)["step"] for c in checkpoints] == [2, 4]
    (tmp_path / "run" / "checkpoints.jsonl").write_text(checkpoints[0] + "\n")  # only step 2 survives
    module.main(cfg.model_copy(update={"resume": True}), service_client)
    resumed = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert [r[key] for r in resumed[1:]] == [r[key] for r in original[1:]]
