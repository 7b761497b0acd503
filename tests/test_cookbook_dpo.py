"""Acceptance: tinker-cookbook's `preference.train_dpo`, unmodified, runs 2 steps against the gateway with only
TINKER_BASE_URL and TINKER_API_KEY set, on a local JSONL of comparisons.

The cookbook takes its reference logprobs from a sampler snapshot of the fresh adapter
(`compute_logprobs`) and the policy's from `forward_backward_custom`, so the first step's loss is
exactly log 2 only if the two agree; every row is the same comparison, so the second step (after one
update towards the chosen answer) must prefer it.
"""

from __future__ import annotations

import json
import math

import chz
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

COMPARISON = {
    "comparison": {
        "prompt_conversation": [{"role": "user", "content": "What colour is the sky?"}],
        "completion_A": [{"role": "assistant", "content": "The sky is blue."}],
        "completion_B": [{"role": "assistant", "content": "Seven potatoes."}],
    },
    "label": "A",
}


def test_cookbook_train_dpo_runs_two_steps(tinker_env, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer("tiny", lambda: AutoTokenizer.from_pretrained(tiny_model_dir))
    data = tmp_path / "comparisons.jsonl"
    data.write_text("".join(json.dumps(COMPARISON) + "\n" for _ in range(4)))
    config = (
        chz.Blueprint(train_dpo.Config)
        .apply(
            {
                "log_path": str(tmp_path / "dpo"),
                "model_name": "tiny",
                "recipe_name": "treadle_dpo_test",
                "renderer_name": "role_colon",
                "learning_rate": 1e-2,
                "lr_schedule": "constant",
                "dpo_beta": 0.5,
                "lora_rank": 4,
                "max_steps": 2,
                "save_every": 0,
                "eval_every": 0,
                "dataset_builder": DPODatasetBuilderFromComparisons(
                    comparison_builder=ComparisonBuilderFromJsonl(train_path=str(data)),
                    common_config=ChatDatasetBuilderCommonConfig(
                        model_name_for_tokenizer="tiny", renderer_name="role_colon", max_length=128, batch_size=2
                    ),
                ),
            }
        )
        .make()
    )
    train_dpo.main(config)

    metrics = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "dpo_loss" in m]
    assert len(steps) == 2
    assert abs(steps[0]["dpo_loss"] - math.log(2)) < 1e-4  # policy == reference before any update
    assert steps[1]["dpo_loss"] < math.log(2) and steps[1]["accuracy"] == 1.0
    saved = [json.loads(line) for line in (tmp_path / "dpo" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved and saved[-1]["state_path"].startswith("tinker://")
