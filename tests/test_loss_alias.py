"""stable_reinforce: refused by name with the losses to pass instead, or, on a gateway started with
`--loss_alias stable_reinforce=cispo`, trained as cispo, which the gateway logs at start and records in
every new run's user_metadata.

The cookbook's stable_reinforce datums carry target_tokens, logprobs and advantages (plus provenance
spans, which treadle does not read), exactly cispo's inputs, so the aliased loss is cispo's loss on them.
"""

from __future__ import annotations

import logging

import pytest
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY
from treadle.cli import build_parser
from treadle.config import config_of
from treadle.gateway.server import BackgroundGateway
from treadle.gateway.settings import LOSS_ALIAS_METADATA_KEY, GatewaySettings

IDS = list(range(5, 18))


def _rl_datum(shift: float = 0.3) -> tt.Datum:
    n = len(IDS) - 1
    return tt.Datum(
        model_input=tt.ModelInput.from_ints(IDS[:-1]),
        loss_fn_inputs={
            "target_tokens": IDS[1:],
            "logprobs": [-5.0 + shift * (i % 3) for i in range(n)],
            "advantages": [1.0 if i % 2 else -0.5 for i in range(n)],
        },
    )


def test_the_option_parses_and_bad_aliases_name_the_limit():
    ns = build_parser().parse_args(["gateway", "--loss_alias", "stable_reinforce=cispo"])
    assert config_of(ns).loss_aliases == {"stable_reinforce": "cispo"}
    assert GatewaySettings().loss_aliases == {}  # off by default
    for entry in ("stable_reinforce=gspo", "cross_entropy=cispo", "stable_reinforce", "custom=ppo"):
        with pytest.raises(ValueError) as err:
            GatewaySettings(loss_alias=[entry])
        assert f"loss_alias: {entry!r}" in str(err.value) and "importance_sampling, ppo, cispo, dro" in str(err.value)
    with pytest.raises(ValueError, match="stable_reinforce is mapped twice"):
        GatewaySettings(loss_alias=["stable_reinforce=cispo", "stable_reinforce=ppo"])


def test_without_an_alias_the_refusal_names_what_to_pass(tinker_env):
    service = tinker.ServiceClient()
    try:
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        with pytest.raises(Exception) as err:
            training.forward_backward([_rl_datum()], "stable_reinforce").result()
        message = str(err.value)
        assert (
            "not published" in message
            and "loss_fn=cispo" in message
            and "--loss_alias stable_reinforce=cispo" in message
        )
    finally:
        service.close("success")


@pytest.fixture(scope="module")
def aliased(stack):
    settings = GatewaySettings(
        port=0,
        broker_url=stack.broker_url,
        storage_url=stack.storage_url,
        api_keys={ALICE_KEY: "alice"},
        loss_alias=["stable_reinforce=cispo"],
    )
    with BackgroundGateway(settings) as gw:
        yield gw


def test_an_aliased_gateway_trains_stable_reinforce_as_cispo(aliased, monkeypatch, caplog):
    monkeypatch.setenv("TINKER_BASE_URL", aliased.url)
    monkeypatch.setenv("TINKER_API_KEY", ALICE_KEY)
    service = tinker.ServiceClient()
    try:
        training = service.create_lora_training_client(
            base_model="tiny", rank=4, seed=0, user_metadata={"who": "test"}
        ).result()
        as_cispo = training.forward([_rl_datum()], "cispo").result()
        aliased_out = training.forward([_rl_datum()], "stable_reinforce").result()
        assert aliased_out.metrics["loss:sum"] == as_cispo.metrics["loss:sum"]
        training.forward_backward([_rl_datum()], "stable_reinforce").result()
        assert training.optim_step(tt.AdamParams(learning_rate=1e-3)).result() is not None

        # Its own parameters cannot be carried over to cispo: refused by name rather than dropped.
        with pytest.raises(Exception) as err:
            training.forward([_rl_datum()], "stable_reinforce", loss_fn_config={"kl_coeff": 0.1}).result()
        assert "loss_fn_config: ['kl_coeff'] given for stable_reinforce" in str(err.value)

        run = service.create_rest_client().get_training_run(training.model_id).result()
        assert run.user_metadata == {"who": "test", LOSS_ALIAS_METADATA_KEY: "stable_reinforce=cispo"}
    finally:
        service.close("success")


def test_the_alias_is_logged_at_start(stack, caplog):
    settings = GatewaySettings(
        port=0, broker_url=stack.broker_url, api_keys={ALICE_KEY: "alice"}, loss_alias=["stable_reinforce=ppo"]
    )
    with caplog.at_level(logging.WARNING, logger="treadle.gateway.app"), BackgroundGateway(settings):
        pass
    assert any(
        "loss_alias: forward_backward requests for stable_reinforce train with ppo" in r.getMessage()
        for r in caplog.records
    )
