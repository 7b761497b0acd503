"""Acceptance: tinker-cookbook 0.6.1's `supervised.train`, unmodified, runs 3 steps against the gateway.

The dataset is the conversations file shipped in the cookbook wheel; the tiny model is served as
`tiny`, so the cookbook's tokenizer lookup for that name is registered to the model's directory
(offline, as the reference describes). Everything else - the SDK calls, checkpoints, NLL evaluation
through compute_logprobs - is the cookbook's own code.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources

import tinker
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from tests.fixtures.gateway import ALICE_KEY


def test_cookbook_supervised_train_runs_three_steps(tinker_env, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer("tiny", lambda: AutoTokenizer.from_pretrained(tiny_model_dir))
    conversations = str(resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl")
    config = train.Config(
        log_path=str(tmp_path / "sft"),
        model_name="tiny",
        recipe_name="treadle_gateway_test",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(
            file_path=conversations,
            test_size=8,
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer="tiny",
                renderer_name="role_colon",
                max_length=256,
                batch_size=8,
            ),
        ),
        learning_rate=1e-3,
        lora_rank=8,
        max_steps=3,
        save_every=2,
        eval_every=2,
    )
    asyncio.run(train.main(config))

    metrics = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(train_losses) == 3
    assert any("test/nll" in m for m in metrics)  # the NLL evaluator sampled through compute_logprobs
    saved = [json.loads(line) for line in (tmp_path / "sft" / "checkpoints.jsonl").read_text().splitlines()]
    final = saved[-1]
    assert final["state_path"].startswith("tinker://") and "/weights/" in final["state_path"]

    rest = tinker.RestClient(api_key=ALICE_KEY)
    run = rest.get_training_run_by_tinker_path(final["state_path"]).result()
    assert run.user_metadata["renderer_name"] == "role_colon"  # what the cookbook reads back when resuming
    paths = [c.tinker_path for c in rest.list_checkpoints(run.training_run_id).result().checkpoints]
    assert final["state_path"] in paths
