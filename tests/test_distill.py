"""On-policy distillation: the reverse-KL datum by hand, and a tiny-model run through the real local stack
whose teacher is an SFT-trained checkpoint of the same base model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from treadle.recipes import distill, sft
from treadle.recipes.distill import Scored, mean_token_kl, reverse_kl_datum
from treadle.recipes.lib.preference_data import arithmetic_sft_conversations, write_jsonl


def test_reverse_kl_datum_by_hand():
    scored = Scored(prompt=[5, 6, 7], tokens=[8, 9], student=np.array([-1.0, -2.0]), teacher=np.array([-0.5, -4.0]))
    datum = reverse_kl_datum(scored, kl_coef=2.0)
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    assert datum.loss_fn_inputs["target_tokens"].to_numpy().tolist() == [6, 7, 8, 9]
    # prompt targets carry nothing; a token the teacher likes more than the student (-0.5 > -1) is pushed up
    np.testing.assert_allclose(datum.loss_fn_inputs["advantages"].to_numpy(), [0.0, 0.0, 2.0 * 0.5, 2.0 * -2.0])
    np.testing.assert_allclose(datum.loss_fn_inputs["logprobs"].to_numpy(), [0.0, 0.0, -1.0, -2.0])
    assert mean_token_kl([scored]) == pytest.approx(((-1.0 + 0.5) + (-2.0 + 4.0)) / 2)


def test_distillation_lowers_the_students_kl_to_an_sft_teacher(service_client, tmp_path):
    data = write_jsonl(str(tmp_path / "sft.jsonl"), arithmetic_sft_conversations(24, seed=1, max_operand=3))
    teacher = sft.main(
        sft.Config(
            base_model="tiny",
            log_dir=str(tmp_path / "teacher"),
            data_path=data,
            eval_size=4,
            steps=5,
            batch_size=8,
            learning_rate=2e-2,
            lora_rank=8,
            eval_every=0,
            save_every=5,
        ),
        service_client,
    )
    assert "/weights/" in teacher.final_state_path  # a training state serves as the teacher's sampler too
    cfg = distill.Config(
        base_model="tiny",
        teacher_path=teacher.final_state_path,
        log_dir=str(tmp_path / "student"),
        max_operand=3,
        steps=8,
        prompts_per_batch=4,
        samples_per_prompt=4,
        max_tokens=6,
        learning_rate=1e-2,
        lora_rank=8,
        eval_prompts=6,
        eval_samples=2,
        arithmetic_eval=False,
        eval_every=0,
        save_every=8,
    )
    result = distill.main(cfg, service_client)
    rows = [json.loads(line) for line in open(result.metrics_path)]
    assert [r["step"] for r in rows] == list(range(9))
    assert all(r["tokens"] > 0 for r in rows[1:])
    before, after = result.eval_before["eval/kl_student_teacher"], result.eval_after["eval/kl_student_teacher"]
    assert before > 0.1  # the SFT'd teacher really differs from the untrained student
    assert after < 0.9 * before, (before, after)  # measured here: 3.74 -> 3.03 nats per token in 8 steps
    train_kl = [r["kl/student_teacher"] for r in rows[1:]]
    assert sum(train_kl[-3:]) < sum(train_kl[:3]), train_kl  # on the student's own training samples too
