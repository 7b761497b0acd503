"""Acceptance: tinker-cookbook's `rl.train`, unmodified, trains 2 steps of a small custom environment through
the gateway, with only TINKER_BASE_URL and TINKER_API_KEY set.

The environment is the user's own (Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, as the cookbook's
rl/types.py asks for): "answer 1 or 2", rewarded by string match on the decoded answer. rl.train takes
the renderer from the config, so the tiny model keeps its own name (`tiny`, its tokenizer registered
with the cookbook by tests/fixtures/cookbook.py). Every reward the env handed out is recorded here, so the logged
reward means must be exactly theirs: the cookbook trained on what this env saw, sampled through the gateway.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import chz
import tinker
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult

PROMPT = "Answer with one digit, 1 or 2:"
GROUP_SIZE = 4
# (batch, reward, answer length) of every episode, in the order the env was stepped (one process: rollouts run in-process).
EPISODES: list[tuple[int, float, int]] = []


class OneOrTwoEnv(Env):
    def __init__(self, renderer: renderers.Renderer, batch: int):
        self.renderer, self.batch = renderer, batch

    async def initial_observation(self):
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": PROMPT}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None) -> StepResult:
        answer = self.renderer.tokenizer.decode(action)
        reward = 1.0 if "1" in answer else 0.5 if "2" in answer else 0.0
        EPISODES.append((self.batch, reward, len(action)))
        return StepResult(
            reward=reward,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
            metrics={"answered": float(reward > 0)},
        )


class OneOrTwoGroup(EnvGroupBuilder):
    def __init__(self, batch: int):
        self.batch = batch

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer("role_colon", tokenizer_utils.get_tokenizer("tiny"))
        return [OneOrTwoEnv(renderer, self.batch) for _ in range(GROUP_SIZE)]

    def logging_tags(self) -> list[str]:
        return ["one_or_two"]


class OneOrTwoDataset(RLDataset):
    def __init__(self, groups_per_batch: int, batches: int):
        self.groups_per_batch, self.batches = groups_per_batch, batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [OneOrTwoGroup(index) for _ in range(self.groups_per_batch)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class OneOrTwoBuilder(RLDatasetBuilder):
    groups_per_batch: int = 2
    batches: int = 3  # more than max_steps: the run must stop at max_steps, not at the data's end

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return OneOrTwoDataset(self.groups_per_batch, self.batches), None


def test_cookbook_rl_train_custom_env_two_steps(cookbook_tiny, tmp_path):
    EPISODES.clear()
    config = (
        chz.Blueprint(train.Config)
        .apply(
            {
                "log_path": str(tmp_path / "rl"),
                "model_name": "tiny",
                "recipe_name": "treadle_rl_train_test",
                "renderer_name": "role_colon",
                "dataset_builder": OneOrTwoBuilder(),
                "learning_rate": 1e-3,
                "max_tokens": 6,
                "lora_rank": 4,
                "max_steps": 2,
                "save_every": 0,
                "eval_every": 0,
                "loss_fn": "importance_sampling",
                "num_groups_to_log": 0,
                "rollout_json_export": False,
            }
        )
        .make()
    )
    asyncio.run(train.main(config))

    metrics = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "progress/batch" in m]
    assert [m["progress/batch"] for m in steps] == [0, 1]
    assert [b for b, _, _ in EPISODES] == [0] * 2 * GROUP_SIZE + [1] * 2 * GROUP_SIZE
    for step in steps:
        rewards = [r for b, r, _ in EPISODES if b == step["progress/batch"]]
        assert abs(step["env/all/reward/total"] - sum(rewards) / len(rewards)) < 1e-6, (step, rewards)
        assert step["tokens/sampled"] == sum(n for b, _, n in EPISODES if b == step["progress/batch"])
        # The sampler's logprobs are the trainer's: the gateway served the policy being trained, on-policy.
        assert abs(step["optim/kl_sample_train_v1"]) < 1e-4, step
        # Group-centred advantages are all zero unless some group had mixed rewards: then, and only then, a gradient.
        assert (step["grad_norm:mean"] > 0) == (step["env/all/by_group/frac_mixed"] > 0), step
    assert [m["step:max"] for m in steps] == [1.0, 2.0]  # the server's optimizer stepped once a batch
    saved = [json.loads(line) for line in (tmp_path / "rl" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["name"] == "final" and saved[-1]["state_path"].startswith("tinker://")
