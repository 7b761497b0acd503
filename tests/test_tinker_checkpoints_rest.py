"""The official SDK's checkpoint and session REST calls against the gateway: TTL changes, publishing, copies,
external weights (signed per-file URLs, with and without age encryption), session search and traces,
and a delivered future polled again. Only TINKER_BASE_URL and TINKER_API_KEY are set.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pyrage
import pytest
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY, BOB_KEY


@pytest.fixture(scope="module")
def trained(gateway):
    """One of alice's models with one optimizer step, a training checkpoint and an external export."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_BASE_URL", gateway.url)
        mp.setenv("TINKER_API_KEY", ALICE_KEY)
        sc = tinker.ServiceClient(user_metadata={"team": "rest-test"}, display_name="nightly rest run")
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        tokens = tc.get_tokenizer().encode("the cat is red and the dog is blue")
        datum = tt.Datum(
            model_input=tt.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("rest-state").result().path
        external = tc.save_weights_external("rest-export").result().path
        yield {"sc": sc, "tc": tc, "state": state, "external": external, "session_id": sc.holder.get_session_id()}
        sc.close("success")


def _rest(gateway, key):
    return tinker.RestClient(base_url=gateway.url, api_key=key)


def _checkpoint(rest, path):
    run_id = path.removeprefix("tinker://").split("/")[0]
    return next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path)


def test_ttl_is_set_and_removed_and_bounded(gateway, trained):
    rest = _rest(gateway, ALICE_KEY)
    before = time.time()
    rest.set_checkpoint_ttl_from_tinker_path(trained["state"], 7200).result()
    expires = _checkpoint(rest, trained["state"]).expires_at
    assert before + 7200 - 5 <= expires.timestamp() <= time.time() + 7200 + 5
    rest.set_checkpoint_ttl_from_tinker_path(trained["state"], None).result()
    assert _checkpoint(rest, trained["state"]).expires_at is None
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds: 60.*3600"):
        rest.set_checkpoint_ttl_from_tinker_path(trained["state"], 60).result()
    with pytest.raises(tinker.NotFoundError):  # bob cannot change alice's checkpoint, nor see that it exists
        _rest(gateway, BOB_KEY).set_checkpoint_ttl_from_tinker_path(trained["state"], 7200).result()


def test_published_checkpoint_is_readable_by_others_and_never_writable(gateway, trained):
    alice, bob = _rest(gateway, ALICE_KEY), _rest(gateway, BOB_KEY)
    path = trained["external"]
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(path).result()
    alice.publish_checkpoint_from_tinker_path(path).result()
    try:
        assert _checkpoint(alice, path).public is True
        assert set(bob.get_external_weights_urls(path).result().urls) == {
            "adapter_config.json",
            "adapter_model.safetensors",
        }
        for write in (
            lambda: bob.unpublish_checkpoint_from_tinker_path(path).result(),
            lambda: bob.set_checkpoint_ttl_from_tinker_path(path, 7200).result(),
            lambda: bob.delete_checkpoint_from_tinker_path(path).result(),
        ):
            with pytest.raises(tinker.NotFoundError):
                write()
    finally:
        alice.unpublish_checkpoint_from_tinker_path(path).result()
    assert _checkpoint(alice, path).public is False
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(path).result()


def test_external_weight_urls_serve_the_adapter_files_without_a_key(gateway, trained):
    response = _rest(gateway, ALICE_KEY).get_external_weights_urls(trained["external"]).result()
    assert response.expires > datetime.now(timezone.utc)
    with urllib.request.urlopen(response.urls["adapter_config.json"]) as got:  # no API key sent
        config = json.loads(got.read())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    forged = response.urls["adapter_config.json"][:-3] + "AAA"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(forged)
    assert err.value.code == 404


def test_age_encrypted_export_decrypts_with_the_recipient_key(gateway, trained):
    identity = pyrage.x25519.Identity.generate()
    path = (
        trained["tc"]
        .save_weights_external(
            "rest-encrypted", ttl_seconds=3600, age_encryption_recipients=[str(identity.to_public())]
        )
        .result()
        .path
    )
    urls = _rest(gateway, ALICE_KEY).get_external_weights_urls(path).result().urls
    assert set(urls) == {"adapter_config.json.age", "adapter_model.safetensors.age"}
    with urllib.request.urlopen(urls["adapter_config.json.age"]) as got:
        ciphertext = got.read()
    assert b'"peft_type"' not in ciphertext
    assert json.loads(pyrage.decrypt(ciphertext, [identity]))["r"] == 4


def test_copy_weights_makes_an_independent_checkpoint_in_a_new_run(gateway, trained):
    rest = _rest(gateway, ALICE_KEY)
    copy = rest.copy_weights(trained["state"], "archive", ttl_seconds=7200).result()
    assert copy.startswith("tinker://") and copy.endswith("/weights/rest-state") and copy != trained["state"]
    copied, source = _checkpoint(rest, copy), _checkpoint(rest, trained["state"])
    assert copied.size_bytes == source.size_bytes and copied.expires_at is not None
    assert rest.get_weights_info_by_tinker_path(copy).result().lora_rank == 4
    with pytest.raises(tinker.NotFoundError):  # bob cannot copy alice's private checkpoint
        _rest(gateway, BOB_KEY).copy_weights(trained["state"], "archive").result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.copy_weights(trained["state"], "archive", ttl_seconds=10).result()


def test_search_sessions_by_name_metadata_and_owner(gateway, trained):
    alice, bob = _rest(gateway, ALICE_KEY), _rest(gateway, BOB_KEY)
    found = alice.search_sessions(tt.SessionSearchRequest(display_name="NIGHTLY rest")).result().sessions
    assert [s.session_id for s in found] == [trained["session_id"]]
    assert found[0].user_metadata == {"team": "rest-test"} and found[0].checkpoints_count >= 2
    assert found[0].status is not None and found[0].status.type == "active"
    by_meta = alice.search_sessions(tt.SessionSearchRequest(user_metadata={"team": "rest-test"})).result().sessions
    assert trained["session_id"] in [s.session_id for s in by_meta]
    assert not alice.search_sessions(tt.SessionSearchRequest(user_metadata={"team": "other"})).result().sessions
    assert trained["session_id"] not in [
        s.session_id for s in bob.search_sessions(tt.SessionSearchRequest()).result().sessions
    ]
    page = alice.search_sessions(tt.SessionSearchRequest(limit=1)).result()
    if page.next_cursor is not None:  # the next page starts after the first one
        nxt = alice.search_sessions(tt.SessionSearchRequest(limit=1, cursor=page.next_cursor)).result()
        assert [s.session_id for s in nxt.sessions] != [s.session_id for s in page.sessions]


def test_session_trace_lists_the_ops_with_seq_and_tokens(gateway, trained):
    url = _rest(gateway, ALICE_KEY).export_session_trace(trained["session_id"]).result()
    with urllib.request.urlopen(url) as got:
        trace = json.loads(got.read())
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "op"]
    names = [e["name"] for e in ops]
    assert names.index("forward_backward") < names.index("optim_step")
    fb = next(e for e in ops if e["name"] == "forward_backward")
    assert fb["ph"] == "X" and fb["dur"] > 0 and fb["args"]["trained_tokens"] > 0
    assert fb["args"]["seq"] < next(e for e in ops if e["name"] == "optim_step")["args"]["seq"]
    # Each op ends when the worker finished it (ts and dur are microseconds, finished_at seconds; 1 us
    # covers the float rounding of ts + dur, which equals finished_at by construction).
    for op in ops:
        assert op["ts"] + op["dur"] <= op["args"]["finished_at"] * 1e6 + 1
    # Journaled ops also show their wait: a `queued` span from submission to the op's start.
    queued = {(e["tid"], e["args"]["op"], e["ts"]): e for e in trace["traceEvents"] if e.get("cat") == "queue"}
    assert queued and fb["args"]["queued_at"] <= fb["ts"] / 1e6
    wait = queued[(fb["tid"], "forward_backward", fb["args"]["queued_at"] * 1e6)]
    assert wait["name"] == "queued" and wait["ph"] == "X" and wait["dur"] >= 0
    assert wait["ts"] + wait["dur"] == pytest.approx(fb["ts"], abs=1)
    with pytest.raises(tinker.NotFoundError):
        _rest(gateway, BOB_KEY).export_session_trace(trained["session_id"]).result()


def test_a_delivered_future_answers_the_same_when_polled_again(gateway, trained):
    """The SDK re-polls futures it has already read: the gateway keeps every result for its state TTL
    (7 days by default, docs/gateway.md), so a second poll gets the same answer, never a 404."""
    import httpx

    tc, headers = trained["tc"], {"X-API-Key": ALICE_KEY}
    seq = tc._get_request_id() + 1  # the SDK's own next seq_id, so its later calls stay in order
    body = tt.OptimStepRequest(adam_params=tt.AdamParams(learning_rate=1e-3), model_id=tc.model_id, seq_id=seq)
    submitted = httpx.post(
        f"{gateway.url}/api/v1/optim_step", json=body.model_dump(mode="json"), headers=headers, timeout=30
    ).json()

    def poll() -> dict:
        for _ in range(20):  # each poll is held up to the gateway's long-poll time
            answer = httpx.post(
                f"{gateway.url}/api/v1/retrieve_future",
                json={"request_id": submitted["request_id"]},
                headers=headers,
                timeout=30,
            ).json()
            if answer.get("type") != "try_again":
                return answer
        raise AssertionError("no result after 20 polls")

    first = poll()
    assert "metrics" in first and first["metrics"]["step:max"] >= 2
    assert poll() == first


def test_tinker_cli_checkpoint_download_of_external_weights(gateway, trained, tmp_path):
    """The SDK's own CLI, `tinker checkpoint download`, fetches the files through the signed URLs."""
    import os
    import subprocess
    import sys

    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "TINKER_BASE_URL": gateway.url,
        "TINKER_API_KEY": ALICE_KEY,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tinker.cli", "checkpoint", "download", trained["external"], "--output", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    target = tmp_path / trained["external"].removeprefix("tinker://").replace("/", "_")
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((target / "adapter_config.json").read_text())["r"] == 4
