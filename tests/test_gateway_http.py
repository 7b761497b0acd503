"""The gateway's HTTP rules, spoken directly: keys (401), owners (404), seq_id ordering and retries (409)."""

from __future__ import annotations

import httpx
import pytest
import tinker
import zstandard
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.fixtures.gateway import ALICE_KEY, BOB_KEY


def _client(gateway, key: str | None) -> httpx.Client:
    headers = {"X-API-Key": key} if key else {}
    return httpx.Client(base_url=gateway.url + "/api/v1", headers=headers, timeout=60)


def _result(client: httpx.Client, request_id: str) -> httpx.Response:
    while True:
        response = client.post("/retrieve_future", json={"request_id": request_id})
        if (
            response.headers["content-type"].startswith("application/json")
            and response.json().get("type") == "try_again"
        ):
            continue
        return response


def _fb_body(model_id: str, seq_id: int, tokens=(5, 6, 7, 8)) -> bytes:
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(
            data=[
                tt.Datum(
                    model_input=tt.ModelInput.from_ints(list(tokens[:-1])),
                    loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": [1.0] * (len(tokens) - 1)},
                )
            ],
            loss_fn="cross_entropy",
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _post_fb(client: httpx.Client, body: bytes) -> httpx.Response:
    return client.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})


def create_model(gateway) -> tuple[str, str, str]:
    """A training model of alice's, created over plain HTTP: (client session id, the model id the create answered,
    the model id its result names)."""
    with _client(gateway, ALICE_KEY) as alice:
        session_id = alice.post(
            "/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
        ).json()["session_id"]
        created = alice.post(
            "/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": 0,
                "base_model": "tiny",
                "lora_config": {"rank": 4, "seed": 1},
            },
        ).json()
        return session_id, created["model_id"], _result(alice, created["request_id"]).json()["model_id"]


@pytest.fixture(scope="module")
def alice_model(gateway):
    """A training model of alice's, created over plain HTTP."""
    _, answered, result = create_model(gateway)
    assert result == answered
    return answered


def test_missing_or_wrong_key_is_401(gateway):
    for key in (None, "tml-not-a-key"):
        with _client(gateway, key) as client:
            assert client.post("/client/config", json={"sdk_version": "0.38.0"}).status_code == 401
    with httpx.Client(base_url=gateway.url) as client:
        assert (
            client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": "Bearer tml-wrong"},
            ).status_code
            == 401
        )
        assert client.get("/api/v1/healthz").json() == {"status": "ok"}  # health needs no key
    sdk = tinker.ServiceClient(base_url=gateway.url, api_key="tml-not-a-key")
    with pytest.raises(tinker.AuthenticationError):
        sdk.create_lora_training_client(base_model="tiny", rank=4).result()


def test_another_owners_model_request_and_checkpoint_are_404(gateway, alice_model):
    with _client(gateway, ALICE_KEY) as alice, _client(gateway, BOB_KEY) as bob:
        request_id = alice.post("/save_weights", json={"model_id": alice_model, "path": "mine", "seq_id": 1}).json()[
            "request_id"
        ]
        path = _result(alice, request_id).json()["path"]
        assert path == f"tinker://{alice_model}/weights/mine"
        assert alice.post("/weights_info", json={"tinker_path": path}).json()["lora_rank"] == 4

        assert bob.post("/get_info", json={"model_id": alice_model}).status_code == 404
        assert _post_fb(bob, _fb_body(alice_model, 2)).status_code == 404
        assert bob.post("/retrieve_future", json={"request_id": request_id}).status_code == 404
        assert bob.post("/weights_info", json={"tinker_path": path}).status_code == 404
        assert bob.get(f"/training_runs/{alice_model}").status_code == 404
        assert bob.get(f"/training_runs/{alice_model}/checkpoints").status_code == 404
        assert bob.delete(f"/training_runs/{alice_model}/checkpoints/weights/mine").status_code == 404
        # (the shared stack holds many runs: ask for all of them, not the first page of 20)
        assert alice_model not in [
            r["training_run_id"] for r in bob.get("/training_runs?limit=10000").json()["training_runs"]
        ]
        assert alice_model in [
            r["training_run_id"] for r in alice.get("/training_runs?limit=10000").json()["training_runs"]
        ]
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {BOB_KEY}"}) as bob_openai:
        response = bob_openai.post("/v1/completions", json={"model": path, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 404


def test_seq_ids_run_in_order_and_a_retry_returns_the_original_future(gateway, alice_model):
    with _client(gateway, ALICE_KEY) as alice:
        info = alice.post("/get_info", json={"model_id": alice_model}).json()
        assert info["model_data"]["model_name"] == "tiny"
        # seq 3 (optim_step) arrives before seq 2 (forward_backward): the worker must run 2 first
        optim_id = alice.post(
            "/optim_step", json={"model_id": alice_model, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}}
        ).json()["request_id"]
        fb_body = _fb_body(alice_model, 2)
        fb_id = _post_fb(alice, fb_body).json()["request_id"]
        assert _post_fb(alice, fb_body).json()["request_id"] == fb_id  # a retry: same future, not run twice
        assert _post_fb(alice, _fb_body(alice_model, 2, tokens=(9, 9, 9))).status_code == 409
        optim = _result(alice, optim_id).json()
        fb = _result(alice, fb_id)
        assert fb.headers["content-type"] == "application/x-protobuf"
        assert deserialize_forward_backward_output(fb.content).metrics["step:max"] == 0  # ran before the optim_step
        assert optim["metrics"]["step:max"] == 1

        # an op the gateway cannot translate still takes its seq (as a noop) and fails with a user error
        bad = alice.post(
            "/optim_step",
            json={"model_id": alice_model, "seq_id": 4, "optimizer_params": {"type": "dimuon", "learning_rate": 0.1}},
        ).json()
        assert _result(alice, bad["request_id"]).json()["category"] == "user"
        after = alice.post("/optim_step", json={"model_id": alice_model, "seq_id": 5, "adam_params": {}}).json()
        assert _result(alice, after["request_id"]).json()["metrics"]["step:max"] == 2

        # a zstd-compressed body (the SDK sends one when client/config asks for it)
        compressed = zstandard.ZstdCompressor().compress(_fb_body(alice_model, 6))
        request_id = alice.post(
            "/forward_backward",
            content=compressed,
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
        ).json()["request_id"]
        assert len(deserialize_forward_backward_output(_result(alice, request_id).content).loss_fn_outputs) == 1
