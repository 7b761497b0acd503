"""A queue at its bound, seen through the gateway: 429 with Retry-After, which the official SDK retries.

The bound lives in the session's record, where the worker wrote it at creation (its configured
max_queued_ops_per_session); these tests lower it on one model so that a few ops reach it. An op whose
predecessor has not arrived cannot run, so a gap in the seq_ids holds a queue exactly as long as a test
needs it, with no race against the worker.
"""

from __future__ import annotations

import httpx
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY
from tests.test_gateway_http import _client, _fb_body, _post_fb, _result, create_model
from tests.test_sessions import sft_batch
from treadle.queue import names


def _model(gateway) -> tuple[str, str]:
    """(client session id, model id) of a new training model of alice's."""
    session_id, _, model_id = create_model(gateway)
    return session_id, model_id


def _bound(stack_redis, model_id: str, limit: int) -> None:
    stack_redis.hset(names.session_key(model_id), "max_queued_ops", limit)


def test_past_the_bound_a_submit_is_429_with_retry_after_and_takes_nothing(gateway, service_client):
    session_id, model_id = _model(gateway)
    _bound(service_client.ops.redis, model_id, 2)
    with _client(gateway, ALICE_KEY) as alice:
        held = _post_fb(alice, _fb_body(model_id, 2))  # seq 1 not sent yet: nothing can run
        assert held.status_code == 200
        refused = _post_fb(alice, _fb_body(model_id, 3))
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1 and int(refused.headers["Retry-After-Ms"]) >= 1000
        assert "max_queued_ops_per_session" in refused.json()["detail"] and "limit is 2" in refused.json()["detail"]
        assert service_client.ops.next_seq(model_id) == 2  # the refused op took no seq
        [queue] = alice.get(f"/sessions/{session_id}/queue").json()["models"]
        assert (queue["model_id"], queue["queued_ops"], queue["applied"]) == (model_id, 2, 0)  # the open seq 1 counts
        # Seq 1 fills the gap (always accepted), both run, and seq 3 on its retry goes through.
        first = _post_fb(alice, _fb_body(model_id, 1))
        for response in (first, held):
            assert _result(alice, response.json()["request_id"]).status_code == 200
        retried = _post_fb(alice, _fb_body(model_id, 3))
        assert retried.status_code == 200
        assert _result(alice, retried.json()["request_id"]).status_code == 200


def _requests_429(gateway) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("treadle_gateway_requests_total{") and 'status="429"' in line
    )


def test_the_official_sdk_retries_a_429_and_every_op_runs_once(tinker_env, service_client):
    """With a bound of 1, the official SDK pipelines three forward_backwards and an optim_step while the worker is
    busy with another tenant's heavy ops: each op after the first finds the one before it still queued, gets a 429,
    and the SDK retries it after Retry-After until it fits."""
    official = tinker.ServiceClient()
    tc = official.create_lora_training_client(base_model="tiny", rank=4)
    _bound(service_client.ops.redis, tc.model_id, 1)
    refused_before = _requests_429(tinker_env)
    other = service_client.create_lora_training_client("tiny", rank=4, seed=0)
    heavy = [other.forward(sft_batch(i, n=32, length=256), "cross_entropy") for i in range(4)]
    data = [
        [
            tt.Datum(
                model_input=tt.ModelInput.from_ints([5 + i, 6 + i, 7 + i]),
                loss_fn_inputs={"target_tokens": [6 + i, 7 + i, 8 + i], "weights": [1.0, 1.0, 1.0]},
            )
        ]
        for i in range(3)
    ]
    steps = [tc.forward_backward(batch, "cross_entropy") for batch in data]
    optim = tc.optim_step(tt.AdamParams(learning_rate=1e-3))
    assert [len(step.result().loss_fn_outputs) for step in steps] == [1, 1, 1]
    assert optim.result().metrics["step:max"] == 1  # after all three forward_backwards, in order
    assert _requests_429(tinker_env) > refused_before  # the bound was met, and the SDK got through it
    record = service_client.ops.session_info(tc.model_id)
    assert record.applied == service_client.ops.next_seq(tc.model_id) == 4  # every op ran once, none lost
    for future in heavy:
        future.result(timeout=300)
    other.stop()
    official.close("success")
