"""Acceptance: tinker-cookbook's on-policy distillation (`distillation.train_on_policy`), unmodified, trains
2 steps through the gateway with the base model as teacher, with only TINKER_BASE_URL and TINKER_API_KEY set.

A student that starts as the base model would distil nothing (its KL to the teacher is 0, so are the
advantages), so the test first teaches the student, through the official SDK, to answer ANSWER to every
prompt, saves that state, and starts the cookbook from it (`load_checkpoint_path`). The cookbook's
prompts come from its own PromptOnlyDataset on a local list (its builder only knows Hub datasets).
Distillation must then pull the student back towards the teacher: the reverse KL it logs is clearly
positive, a gradient flows, and the student's log-probability of ANSWER, measured exactly on the saved
samplers before and after, falls back from where the SFT had raised it.
"""

from __future__ import annotations

import asyncio
import json

import chz
import tinker
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder

PROMPTS = ["Name a colour.", "Say hello.", "What is your name?", "Count to three."]
ANSWER = " The sky is blue.\n\nUser:"  # with role_colon's stop sequence, so the student's samples end there


def _renderer() -> renderers.Renderer:
    return renderers.get_renderer("role_colon", tokenizer_utils.get_tokenizer("tiny"))


@chz.chz
class LocalPrompts(RLDatasetBuilder):
    groups_per_batch: int = 2
    group_size: int = 4

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = _renderer()
        return PromptOnlyDataset(PROMPTS, self.groups_per_batch, self.group_size, renderer, renderer.tokenizer), None


def _answer_logprob(sampler: tinker.SamplingClient, prompt: list[int], answer: list[int]) -> float:
    logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt + answer)).result()
    return sum(logprobs[len(prompt) :])


def test_cookbook_on_policy_distillation_two_steps(cookbook_tiny, tmp_path):
    renderer = _renderer()
    prompts = [renderer.build_generation_prompt([{"role": "user", "content": p}]).to_ints() for p in PROMPTS]
    answer = renderer.tokenizer.encode(ANSWER, add_special_tokens=False)

    service = tinker.ServiceClient()
    # A fixed LoRA seed: unseeded, the SFT start varied (49 to 67 nats above the teacher) and so did the drop
    # after two steps (2 to 215 nats over 7 runs; the 2, from the 49 start, failed CI). Sampling stays random.
    student = service.create_lora_training_client("tiny", rank=4, seed=0)
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(p + answer[:-1]),
            loss_fn_inputs={"target_tokens": (p + answer)[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(answer)},
        )
        for p in prompts
    ]
    for _ in range(20):
        student.forward_backward(data, "cross_entropy")
        student.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()
    start_state = student.save_state("start").result().path
    start_sampler = student.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model="tiny")

    config = (
        chz.Blueprint(train_on_policy.Config)
        .apply(
            {
                "log_path": str(tmp_path / "distill"),
                "model_name": "tiny",
                "recipe_name": "treadle_distill_test",
                "renderer_name": "role_colon",
                "learning_rate": 3e-3,
                "max_tokens": len(answer) + 2,
                "lora_rank": 4,
                "load_checkpoint_path": start_state,
                "max_steps": 2,
                "save_every": 0,
                "eval_every": 0,
                "kl_penalty_coef": 1.0,
                "dataset_configs": [
                    DistillationDatasetConfig(
                        dataset_builder=LocalPrompts(),
                        groups_per_batch=2,
                        teacher_config=TeacherConfig(base_model="tiny"),
                    )
                ],
            }
        )
        .make()
    )
    asyncio.run(train_on_policy.main(config))

    metrics = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "progress/batch" in m]
    assert [m["progress/batch"] for m in steps] == [0, 1]
    assert steps[1]["step:max"] == steps[0]["step:max"] + 1
    assert steps[0]["teacher_kl"] > 0.5 and steps[0]["grad_norm:mean"] > 0, steps[0]  # the student was far off
    saved = [json.loads(line) for line in (tmp_path / "distill" / "checkpoints.jsonl").read_text().splitlines()]
    final = service.create_sampling_client(model_path=saved[-1]["sampler_path"])

    measured = [[_answer_logprob(s, p, answer) for s in (base, final, start_sampler)] for p in prompts]
    # Reverse KL pushes down what the student over-weights: ANSWER, which the SFT had raised far above the
    # teacher's log-probability, loses much of it (by 13 to 196 nats over 12 seeded runs; mode-seeking, it may
    # overshoot).
    assert all(before > teacher + 20 and after < before - 5 for teacher, after, before in measured), measured
