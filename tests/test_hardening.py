"""A catalog of malformed requests and misuse, through treadle's SDK and raw HTTP to the gateway.

Each row asserts: the error class (SDK) or HTTP status, that the message names the field (a future that
can never resolve fails with its own error, not by waiting out a timeout), and that the session it was
aimed at then trains bit-identically to an untouched twin (one forward_backward + optim_step on both,
metrics and logprobs compared exactly).
One stack, one gateway with small body limits, and two twin pairs (SDK, HTTP) serve every row.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import numpy as np
import pytest
import zstandard
from pydantic import ValidationError
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.fixtures.gateway import settle
from treadle import AdamParams, Datum, ModelInput, SamplingParams
from treadle.errors import (
    CheckpointNotFoundError,
    InvalidCheckpointNameError,
    InvalidRequestError,
    SessionNotFoundError,
    SessionStoppedError,
)
from treadle.gateway.server import BackgroundGateway
from treadle.gateway.settings import GatewaySettings
from treadle.types import LoraConfig, TensorData

KEY = "tml-hardening-key"
# A liveness bound, not a speed claim: an answer still missing by then is a hang (a loaded machine answers
# far sooner). A future that can never resolve must fail with its own error, which each row asserts.
LIVENESS_S = 120.0
ADAM = AdamParams(learning_rate=5e-3)
MAX_BODY = 64 << 10
MAX_DECOMPRESSED = 1 << 20
SEQ_AHEAD = 64


def _batch() -> list[Datum]:
    toks = [(j * 7) % 200 + 5 for j in range(17)]
    return [
        Datum(
            model_input=ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16},
        )
    ]


def _rl_datum(**overrides) -> Datum:
    toks = list(range(10, 27))
    n = len(toks) - 1
    inputs: dict[str, Any] = {"target_tokens": toks[1:], "logprobs": [-1.0] * n, "advantages": [0.5] * n}
    inputs.update(overrides)
    return Datum(model_input=ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)


# ---------------------------------------------------------------- fixtures: twins on one stack


@pytest.fixture(scope="module")
def sdk(stack):
    """(victim, twin, service client, path of a rank-8 checkpoint): the twins start identical."""
    from treadle import ServiceClient

    sc = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
    victim = sc.create_lora_training_client("tiny", rank=4, seed=7)
    twin = sc.create_lora_training_client("tiny", rank=4, seed=7)
    other = sc.create_lora_training_client("tiny", rank=8, seed=1)
    rank8 = other.save_state("rank8").result(timeout=60).path
    other.stop()
    yield victim, twin, sc, rank8
    victim.stop()
    twin.stop()


@pytest.fixture(scope="module")
def gw(stack):
    settings = GatewaySettings(
        port=0,
        broker_url=stack.broker_url,
        storage_url=stack.storage_url,
        api_keys={KEY: "hard"},
        long_poll_seconds=2,
        max_body_bytes=MAX_BODY,
        max_decompressed_bytes=MAX_DECOMPRESSED,
        max_seq_ahead=SEQ_AHEAD,
    )
    with BackgroundGateway(settings) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def http(gw, sdk):
    """(client, victim model id, twin model id, ops): two identical models created over plain HTTP."""
    ops = sdk[2].ops
    client = httpx.Client(base_url=gw.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30)
    session_id = client.post(
        "/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    ).json()["session_id"]
    models = []
    for n in range(2):
        created = client.post(
            "/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": n,
                "base_model": "tiny",
                "lora_config": {"rank": 4, "seed": 7},
            },
        ).json()
        assert settle(client, created["request_id"]).json()["model_id"] == created["model_id"]
        models.append(created["model_id"])
    other = client.post("/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()[
        "session_id"
    ]
    created = client.post(
        "/create_model", json={"session_id": other, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 8}}
    ).json()
    settle(client, created["request_id"])
    saved = client.post("/save_weights", json={"model_id": created["model_id"], "seq_id": 1, "path": "rank8"}).json()
    HTTP_RANK8["path"] = settle(client, saved["request_id"]).json()["path"]
    client.post(f"/sessions/{other}/finish")
    yield client, models[0], models[1], ops
    client.close()


# ---------------------------------------------------------------- training one step, compared exactly


def _sdk_step(tc) -> tuple:
    fb = tc.forward_backward(_batch(), "cross_entropy")
    opt = tc.optim_step(ADAM)
    out = fb.result(timeout=60)
    return (
        out.metrics,
        [o["logprobs"].to_numpy().tobytes() for o in out.loss_fn_outputs],
        opt.result(timeout=60).metrics,
    )


def _fb_proto(
    model_id: str,
    seq_id: int,
    datums: list[tt.Datum] | None = None,
    loss_fn: str = "cross_entropy",
    config: dict | None = None,
) -> bytes:
    if datums is None:
        toks = _batch()[0].model_input.to_ints() + [_batch()[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
        datums = [
            tt.Datum(
                model_input=tt.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
            )
        ]
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=datums, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.loss_fn = loss_fn  # set on the message: the SDK's own types would refuse a bad name before sending
    for key, value in (config or {}).items():
        msg.loss_fn_config[key] = value
    return msg.SerializeToString()


def _rl_proto(
    model_id: str, seq_id: int, loss_fn: str = "importance_sampling", config: dict | None = None, **inputs
) -> bytes:
    toks = list(range(10, 27))
    n = len(toks) - 1
    values = {"target_tokens": toks[1:], "logprobs": [-1.0] * n, "advantages": [0.5] * n, **inputs}
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={
            k: tt.TensorData(data=v, dtype="int64" if k == "target_tokens" else "float32") for k, v in values.items()
        },
    )
    return _fb_proto(model_id, seq_id, [datum], loss_fn, config)


PROTO = {"Content-Type": "application/x-protobuf"}


def _http_step(client: httpx.Client, model_id: str, ops) -> tuple:
    seq = ops.next_seq(model_id) + 1
    fb = client.post("/forward_backward", content=_fb_proto(model_id, seq), headers=PROTO).json()["request_id"]
    opt = client.post(
        "/optim_step", json={"model_id": model_id, "seq_id": seq + 1, "adam_params": ADAM.model_dump()}
    ).json()["request_id"]
    out = deserialize_forward_backward_output(settle(client, fb).content)
    return out.metrics, [o["logprobs"].data for o in out.loss_fn_outputs], settle(client, opt).json()["metrics"]


# ---------------------------------------------------------------- the SDK catalog


@dataclass
class SdkCase:
    name: str
    act: Callable  # (victim, service_client, rank8 path) -> anything; must raise
    error: type[BaseException]
    names: tuple[str, ...]  # substrings the message must hold: the field (and the value where given)


def _fb(datums, loss_fn="cross_entropy", config=None):
    return lambda tc, sc, p: tc.forward_backward(datums() if callable(datums) else datums, loss_fn, config).result(
        timeout=LIVENESS_S
    )


def _sample(**params):
    return lambda tc, sc, p: (
        tc.create_sampling_client("unused")
        .sample(ModelInput.from_ints([5, 6, 7]), 1, SamplingParams(**params))
        .result(timeout=LIVENESS_S)
    )


def _adam(**params):
    return lambda tc, sc, p: tc.optim_step(AdamParams(**params)).result(timeout=LIVENESS_S)


def _lora(**params):
    return lambda tc, sc, p: sc.create_lora_training_client("tiny", **params)


NAN, INF = math.nan, math.inf
RL = _rl_datum
SDK_CASES = [
    SdkCase(
        "nan_advantages",
        _fb(lambda: [RL(advantages=[NAN] + [0.5] * 15)], "importance_sampling"),
        InvalidRequestError,
        ("advantages", "nan"),
    ),
    SdkCase(
        "inf_advantages_numpy",
        _fb(lambda: [RL(advantages=np.full(16, np.inf, dtype=np.float32))], "ppo"),
        InvalidRequestError,
        ("advantages", "inf"),
    ),
    SdkCase(
        "nan_logprobs_numpy",
        _fb(lambda: [RL(logprobs=np.full(16, np.nan))], "cispo"),
        InvalidRequestError,
        ("logprobs", "nan"),
    ),
    SdkCase(
        "neg_inf_weights",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints(list(range(5, 21))),
                    loss_fn_inputs={"target_tokens": list(range(6, 22)), "weights": [-INF] * 16},
                )
            ]
        ),
        InvalidRequestError,
        ("weights", "inf"),
    ),
    SdkCase(
        "nan_tensordata_list",
        _fb(lambda: [RL(advantages=TensorData.from_list([NAN] * 16, "float32"))], "dro"),
        InvalidRequestError,
        ("advantages",),
    ),
    SdkCase(
        "ppo_clip_order",
        _fb(lambda: [RL()], "ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}),
        InvalidRequestError,
        ("clip_low_threshold",),
    ),
    SdkCase(
        "ppo_clip_low_zero",
        _fb(lambda: [RL()], "ppo", {"clip_low_threshold": 0.0}),
        InvalidRequestError,
        ("clip_low_threshold",),
    ),
    SdkCase(
        "cispo_negative_low",
        _fb(lambda: [RL()], "cispo", {"clip_low_threshold": -0.5}),
        InvalidRequestError,
        ("clip_low_threshold",),
    ),
    SdkCase(
        "cispo_high_huge",
        _fb(lambda: [RL()], "cispo", {"clip_high_threshold": 1e9}),
        InvalidRequestError,
        ("clip_high_threshold",),
    ),
    SdkCase("dro_beta_huge", _fb(lambda: [RL()], "dro", {"beta": 1e30}), InvalidRequestError, ("beta",)),
    SdkCase("dro_beta_nan", _fb(lambda: [RL()], "dro", {"beta": NAN}), InvalidRequestError, ("beta",)),
    SdkCase("dro_beta_zero", _fb(lambda: [RL()], "dro", {"beta": 0.0}), InvalidRequestError, ("beta",)),
    SdkCase(
        "gspo_clip_order",
        _fb(lambda: [RL()], "gspo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}),
        InvalidRequestError,
        ("clip_low_threshold",),
    ),
    SdkCase("config_key_of_another_loss", _fb(lambda: [RL()], "ppo", {"beta": 0.1}), InvalidRequestError, ("beta",)),
    SdkCase("unknown_loss", _fb(_batch, "hinge"), InvalidRequestError, ("loss_fn", "hinge")),
    SdkCase(
        "stable_reinforce_refused",
        _fb(_batch, "stable_reinforce"),
        InvalidRequestError,
        ("loss_fn", "stable_reinforce"),
    ),
    SdkCase("custom_loss_refused", _fb(_batch, "custom"), InvalidRequestError, ("loss_fn", "custom")),
    SdkCase(
        "token_out_of_vocab",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6, 10**6]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
                )
            ]
        ),
        InvalidRequestError,
        ("tokens", "1000000"),
    ),
    SdkCase(
        "negative_token",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, -1]),
                    loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0] * 2},
                )
            ]
        ),
        ValidationError,
        ("tokens",),
    ),
    SdkCase(
        "token_beyond_int32",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 2**31]),
                    loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0] * 2},
                )
            ]
        ),
        ValidationError,
        ("tokens",),
    ),
    SdkCase("empty_batch", _fb([]), InvalidRequestError, ("data",)),
    SdkCase(
        "empty_model_input",
        _fb(lambda: [Datum(model_input=ModelInput.empty(), loss_fn_inputs={"target_tokens": [], "weights": []})]),
        InvalidRequestError,
        ("model_input",),
    ),
    SdkCase(
        "weights_length",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints(list(range(5, 21))),
                    loss_fn_inputs={"target_tokens": list(range(6, 22)), "weights": [1.0] * 5},
                )
            ]
        ),
        InvalidRequestError,
        ("weights",),
    ),
    SdkCase(
        "over_length",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([7] * 600),
                    loss_fn_inputs={"target_tokens": [7] * 600, "weights": [1.0] * 600},
                )
            ]
        ),
        InvalidRequestError,
        ("model_input", "600"),
    ),
    SdkCase(
        "missing_target_tokens",
        _fb(lambda: [Datum(model_input=ModelInput.from_ints([5, 6]), loss_fn_inputs={"weights": [1.0, 1.0]})]),
        InvalidRequestError,
        ("target_tokens",),
    ),
    SdkCase(
        "input_of_another_loss",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0], "advantages": [1.0, 1.0]},
                )
            ]
        ),
        InvalidRequestError,
        ("advantages",),
    ),
    SdkCase(
        "shape_mismatch",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={
                        "target_tokens": {"data": [6, 7], "dtype": "int64", "shape": [3]},
                        "weights": [1.0, 1.0],
                    },
                )
            ]
        ),
        ValidationError,
        ("shape",),
    ),
    SdkCase(
        "string_targets",
        _fb(lambda: [{"model_input": ModelInput.from_ints([1, 2]), "loss_fn_inputs": {"target_tokens": ["a", "b"]}}]),
        ValidationError,
        ("target_tokens",),
    ),
    SdkCase("adam_lr_nan", _adam(learning_rate=NAN), ValidationError, ("learning_rate", "nan")),
    SdkCase("adam_lr_inf", _adam(learning_rate=INF), ValidationError, ("learning_rate", "inf")),
    SdkCase("adam_lr_negative", _adam(learning_rate=-1.0), ValidationError, ("learning_rate",)),
    SdkCase("adam_lr_huge", _adam(learning_rate=1e6), ValidationError, ("learning_rate",)),
    SdkCase("adam_beta1_one", _adam(beta1=1.0), ValidationError, ("beta1",)),
    SdkCase("adam_beta2_nan", _adam(beta2=NAN), ValidationError, ("beta2",)),
    SdkCase("adam_eps_zero", _adam(eps=0.0), ValidationError, ("eps",)),
    SdkCase("adam_weight_decay", _adam(weight_decay=2.0), ValidationError, ("weight_decay",)),
    SdkCase("adam_grad_clip_negative", _adam(grad_clip_norm=-1.0), ValidationError, ("grad_clip_norm",)),
    SdkCase("adam_unknown_field", _adam(momentum=0.9), ValidationError, ("momentum",)),
    SdkCase("sample_seed_2_64", _sample(seed=2**64), ValidationError, ("seed",)),
    SdkCase("sample_seed_negative", _sample(seed=-1), ValidationError, ("seed",)),
    SdkCase("sample_temperature_inf", _sample(temperature=INF), ValidationError, ("temperature", "inf")),
    SdkCase("sample_temperature_nan", _sample(temperature=NAN), ValidationError, ("temperature",)),
    SdkCase("sample_temperature_negative", _sample(temperature=-0.5), ValidationError, ("temperature",)),
    SdkCase("sample_top_p_zero", _sample(top_p=0.0), ValidationError, ("top_p",)),
    SdkCase("sample_top_k_zero", _sample(top_k=0), ValidationError, ("top_k",)),
    SdkCase("sample_max_tokens_zero", _sample(max_tokens=0), ValidationError, ("max_tokens",)),
    SdkCase("sample_too_many_stops", _sample(stop=[str(i) for i in range(65)]), ValidationError, ("stop",)),
    SdkCase(
        "sample_num_samples_zero",
        lambda tc, sc, p: (
            sc.create_sampling_client(base_model="tiny").sample(ModelInput.from_ints([5]), 0).result(timeout=LIVENESS_S)
        ),
        InvalidRequestError,
        ("num_samples",),
    ),
    SdkCase(
        "sample_topk_prompt_logprobs",
        lambda tc, sc, p: (
            sc.create_sampling_client(base_model="tiny")
            .sample(ModelInput.from_ints([5]), 1, topk_prompt_logprobs=101)
            .result(timeout=LIVENESS_S)
        ),
        InvalidRequestError,
        ("topk_prompt_logprobs",),
    ),
    SdkCase("lora_seed_2_64", _lora(seed=2**64), ValidationError, ("seed",)),
    SdkCase("lora_rank_zero", _lora(rank=0), ValidationError, ("rank",)),
    SdkCase("lora_rank_huge", _lora(rank=4096), ValidationError, ("rank",)),
    SdkCase("lora_alpha_nan", _lora(alpha=NAN), ValidationError, ("alpha",)),
    SdkCase(
        "lora_nothing_to_train",
        _lora(train_mlp=False, train_attn=False, train_unembed=False),
        ValidationError,
        ("train_mlp",),
    ),
    SdkCase(
        "save_state_bad_name",
        lambda tc, sc, p: tc.save_state("../escape").result(timeout=LIVENESS_S),
        InvalidCheckpointNameError,
        ("name",),
    ),
    SdkCase(
        "save_state_ttl_zero",
        lambda tc, sc, p: tc.save_state("ok", ttl_seconds=0),
        InvalidRequestError,
        ("ttl_seconds",),
    ),
    SdkCase(
        "load_missing_checkpoint",
        lambda tc, sc, p: tc.load_state(p.replace("rank8", "absent")).result(timeout=LIVENESS_S),
        CheckpointNotFoundError,
        ("absent",),
    ),
    SdkCase(
        "load_other_lora_rank",
        lambda tc, sc, p: tc.load_state(p).result(timeout=LIVENESS_S),
        InvalidRequestError,
        ("rank", "8", "4"),
    ),
    SdkCase(
        "future_never_submitted",
        lambda tc, sc, p: tc.future(f"{tc.session_id}:{sc.ops.next_seq(tc.session_id) + 50}").result(),
        InvalidRequestError,
        ("never submitted",),
    ),
    SdkCase(
        "future_of_missing_session",
        lambda tc, sc, p: sc.future("no-such-session:3").result(),
        SessionNotFoundError,
        ("no-such-session",),
    ),
    SdkCase(
        "future_seq_zero",
        lambda tc, sc, p: tc.future(f"{tc.session_id}:0").result(timeout=LIVENESS_S),
        InvalidRequestError,
        ("seq 0", "1"),
    ),
    SdkCase(
        "future_tail_not_digits",
        lambda tc, sc, p: sc.future(f"{tc.session_id}:-1").result(timeout=LIVENESS_S),
        InvalidRequestError,
        (":-1", "not a future id"),
    ),
    SdkCase(
        "future_unknown_sample",
        lambda tc, sc, p: sc.future("sample:" + "0" * 32).result(timeout=LIVENESS_S),
        InvalidRequestError,
        ("sample:" + "0" * 32,),
    ),
    SdkCase(
        "future_async_never_submitted",
        lambda tc, sc, p: asyncio.run(
            tc.future(f"{tc.session_id}:{sc.ops.next_seq(tc.session_id) + 50}").result_async(timeout=LIVENESS_S)
        ),
        InvalidRequestError,
        ("never submitted",),
    ),
    SdkCase(
        "future_async_missing_session",
        lambda tc, sc, p: asyncio.run(sc.future("no-such-session:3").result_async(timeout=LIVENESS_S)),
        SessionNotFoundError,
        ("no-such-session",),
    ),
    SdkCase(
        "future_async_unknown_sample",
        lambda tc, sc, p: asyncio.run(sc.future("sample:" + "1" * 32).result_async(timeout=LIVENESS_S)),
        InvalidRequestError,
        ("sample:",),
    ),
    SdkCase(
        "tensor_shape_negative",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={
                        "target_tokens": [6, 7],
                        "weights": {"data": [1.0, 1.0], "dtype": "float32", "shape": [-1, -2]},
                    },
                )
            ]
        ),
        ValidationError,
        ("shape",),
    ),
    SdkCase(
        "tensor_too_many_dims",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={
                        "target_tokens": [6, 7],
                        "weights": {"data": [1.0, 1.0], "dtype": "float32", "shape": [2] + [1] * 8},
                    },
                )
            ]
        ),
        ValidationError,
        ("shape",),
    ),
    SdkCase(
        "int64_beyond_64_bits",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={"target_tokens": [2**70, 7], "weights": [1.0, 1.0]},
                )
            ]
        ),
        ValidationError,
        ("loss_fn_inputs", str(2**70), "int64"),
    ),
    SdkCase(
        "tensordata_int64_beyond_64_bits",
        lambda tc, sc, p: TensorData(data=[7, -(2**70)], dtype="int64"),
        ValidationError,
        ("data[1]", "int64"),
    ),
    SdkCase(
        "too_many_loss_inputs",
        _fb(
            lambda: [
                Datum(
                    model_input=ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={"target_tokens": [6, 7], **{f"x{i}": [1.0, 1.0] for i in range(64)}},
                )
            ]
        ),
        ValidationError,
        ("loss_fn_inputs", "64"),
    ),
    SdkCase("too_many_datums", _fb(lambda: _batch() * 16385), InvalidRequestError, ("data", "16384")),
    SdkCase(
        "save_state_ttl_beyond_10_years",
        lambda tc, sc, p: tc.save_state("ok", ttl_seconds=10**12),
        InvalidRequestError,
        ("ttl_seconds", "315360000"),
    ),
    SdkCase(
        "sampler_ttl_beyond_10_years",
        lambda tc, sc, p: tc.save_weights_for_sampler("ok", ttl_seconds=10**12),
        InvalidRequestError,
        ("ttl_seconds",),
    ),
    SdkCase(
        "checkpoint_every_huge",
        lambda tc, sc, p: sc.create_lora_training_client("tiny", rank=4, checkpoint_every=10**9),
        InvalidRequestError,
        ("checkpoint_every", "1000000"),
    ),
]


@pytest.mark.parametrize("case", SDK_CASES, ids=[c.name for c in SDK_CASES])
def test_sdk_catalog(sdk, case: SdkCase):
    victim, twin, sc, rank8 = sdk
    with pytest.raises(case.error) as err:
        case.act(victim, sc, rank8)
    message = str(err.value)
    for text in case.names:
        assert text in message, f"{case.name}: {text!r} not in {message!r}"
    assert _sdk_step(victim) == _sdk_step(twin)


# ---------------------------------------------------------------- the HTTP catalog


@dataclass
class HttpCase:
    name: str
    send: Callable  # (client, model_id, next seq) -> httpx.Response
    status: int  # the HTTP status; 200 means a future that must fail
    names: tuple[str, ...]
    takes_seq: bool = False
    headers: dict = field(default_factory=dict)


def _post(path: str, body: Callable[[str, int], Any], headers: dict | None = None, raw: bool = False):
    def send(client: httpx.Client, model_id: str, seq: int) -> httpx.Response:
        value = body(model_id, seq)
        if raw or isinstance(value, bytes):
            return client.post(path, content=value, headers=headers or PROTO)
        return client.post(path, json=value)

    return send


def _fbp(make: Callable[[str, int], bytes], headers: dict | None = None):
    return _post("/forward_backward", make, headers)


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


ZSTD = {**PROTO, "Content-Encoding": "zstd"}
BOMB = _zstd(b"\0" * (512 << 20))  # ~16 kB that expands to 512 MB
JSON_RAW = {"Content-Type": "application/json"}


def _fb_edit(edit: Callable[[Any], None]):
    """A valid forward_backward whose protobuf `edit` then breaks (the SDK's own types would refuse it before sending)."""

    def make(model_id: str, seq_id: int) -> bytes:
        msg = pb.ForwardBackwardRequest.FromString(_fb_proto(model_id, seq_id))
        edit(msg)
        return msg.SerializeToString()

    return _fbp(make)


def _tokens(msg, tokens) -> None:
    msg.data[0].model_input[0].encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()


def _weights(msg, shape, dense=None, csr=None) -> None:
    t = msg.data[0].loss_fn_inputs["weights"]
    del t.shape[:]
    t.shape.extend(shape)
    if csr is not None:
        values, crow, cols = csr
        t.sparse_csr.values, t.sparse_csr.crow_indices = (
            np.asarray(values, "<f4").tobytes(),
            np.asarray(crow, "<i8").tobytes(),
        )
        t.sparse_csr.col_indices = np.asarray(cols, "<i8").tobytes()
    elif dense is not None:
        t.dense = np.asarray(dense, "<f4").tobytes()


HTTP_RANK8: dict[str, str] = {}  # a rank-8 checkpoint of the catalog's owner (the `http` fixture saves it)


def _v1(path: str, body: dict):
    """The OpenAI-compatible routes live under /v1, beside /api/v1."""
    return lambda client, m, s: client.post(client.base_url.copy_with(path=path), json=body)


def _opt(**adam):
    return _post("/optim_step", lambda m, s: {"model_id": m, "seq_id": s, "adam_params": {**ADAM.model_dump(), **adam}})


HTTP_CASES = [
    HttpCase("fb_not_protobuf", _fbp(lambda m, s: b"\xff\xfe not protobuf"), 400, ("body", "protobuf")),
    HttpCase("fb_corrupt_zstd", _fbp(lambda m, s: b"\x28\xb5\x2f\xfd garbage", ZSTD), 400, ("zstd",)),
    HttpCase("fb_truncated_zstd", _fbp(lambda m, s: _zstd(_fb_proto(m, s))[:-7], ZSTD), 400, ("zstd",)),
    HttpCase("fb_zstd_bomb", _fbp(lambda m, s: BOMB, ZSTD), 413, ("max_decompressed_bytes",)),
    HttpCase("fb_body_too_large", _fbp(lambda m, s: b"\0" * (MAX_BODY + 1)), 413, ("max_body_bytes",)),
    HttpCase(
        "fb_gzip_encoding",
        _fbp(lambda m, s: _fb_proto(m, s), {**PROTO, "Content-Encoding": "gzip"}),
        415,
        ("content-encoding",),
    ),
    HttpCase("fb_seq_far_ahead", _fbp(lambda m, s: _fb_proto(m, s + 10**6)), 400, ("seq_id", "max_seq_ahead")),
    HttpCase(
        "fb_seq_just_past_window", _fbp(lambda m, s: _fb_proto(m, s + SEQ_AHEAD + 5)), 400, ("seq_id", str(SEQ_AHEAD))
    ),
    HttpCase("fb_seq_zero", _fbp(lambda m, s: _fb_proto(m, 0)), 400, ("seq_id",)),
    HttpCase("fb_unknown_model", _fbp(lambda m, s: _fb_proto(m + "x", s)), 404, ("model",)),
    HttpCase(
        "fb_nan_advantages", _fbp(lambda m, s: _rl_proto(m, s, advantages=[NAN] * 16)), 200, ("advantages", "nan"), True
    ),
    HttpCase(
        "fb_inf_logprobs",
        _fbp(lambda m, s: _rl_proto(m, s, "ppo", logprobs=[INF] * 16)),
        200,
        ("logprobs", "inf"),
        True,
    ),
    HttpCase(
        "fb_ppo_clip_order",
        _fbp(lambda m, s: _rl_proto(m, s, "ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0})),
        200,
        ("clip_low_threshold",),
        True,
    ),
    HttpCase(
        "fb_cispo_negative_low",
        _fbp(lambda m, s: _rl_proto(m, s, "cispo", {"clip_low_threshold": -1.0})),
        200,
        ("clip_low_threshold",),
        True,
    ),
    HttpCase("fb_dro_beta_huge", _fbp(lambda m, s: _rl_proto(m, s, "dro", {"beta": 1e30})), 200, ("beta",), True),
    HttpCase("fb_unknown_loss", _fbp(lambda m, s: _fb_proto(m, s, loss_fn="hinge")), 200, ("loss_fn", "hinge"), True),
    HttpCase(
        "fb_stable_reinforce", _fbp(lambda m, s: _fb_proto(m, s, loss_fn="stable_reinforce")), 200, ("loss_fn",), True
    ),
    HttpCase(
        "fb_token_out_of_vocab",
        _fbp(
            lambda m, s: _fb_proto(
                m,
                s,
                [
                    tt.Datum(
                        model_input=tt.ModelInput.from_ints([5, 10**6]),
                        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]},
                    )
                ],
            )
        ),
        200,
        ("tokens", "1000000"),
        True,
    ),
    HttpCase(
        "fb_weights_length",
        _fbp(
            lambda m, s: _fb_proto(
                m,
                s,
                [
                    tt.Datum(
                        model_input=tt.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0]},
                    )
                ],
            )
        ),
        200,
        ("weights",),
        True,
    ),
    HttpCase("fb_empty_batch", _fbp(lambda m, s: _fb_proto(m, s, [])), 200, ("data",), True),
    HttpCase("opt_invalid_json", _post("/optim_step", lambda m, s: b"{not json", JSON_RAW), 400, ("JSON",)),
    HttpCase("opt_not_utf8", _post("/optim_step", lambda m, s: b"\xff\xfe\xfa", JSON_RAW), 400, ("body",)),
    HttpCase("opt_json_array", _post("/optim_step", lambda m, s: b"[1, 2]", JSON_RAW), 400, ("request",)),
    HttpCase("opt_lr_string", _opt(learning_rate="fast"), 400, ("learning_rate",), True),
    HttpCase(
        "opt_lr_nan_literal",
        _post(
            "/optim_step",
            lambda m, s: json.dumps({"model_id": m, "seq_id": s, "adam_params": {"learning_rate": NAN}}).encode(),
            JSON_RAW,
        ),
        200,
        ("learning_rate",),
        True,
    ),
    HttpCase("opt_lr_huge", _opt(learning_rate=1e9), 200, ("learning_rate",), True),
    HttpCase("opt_beta1_above_one", _opt(beta1=1.5), 200, ("beta1",), True),
    HttpCase("opt_eps_negative", _opt(eps=-1.0), 200, ("eps",), True),
    HttpCase(
        "opt_dimuon",
        _post(
            "/optim_step",
            lambda m, s: {"model_id": m, "seq_id": s, "optimizer_params": {"type": "dimuon", "learning_rate": 0.1}},
        ),
        200,
        ("optimizer_params",),
        True,
    ),
    HttpCase(
        "opt_seq_far_ahead",
        _post("/optim_step", lambda m, s: {"model_id": m, "seq_id": s + 10**9, "adam_params": {}}),
        400,
        ("seq_id",),
    ),
    HttpCase(
        "opt_seq_string",
        _post("/optim_step", lambda m, s: {"model_id": m, "seq_id": "x", "adam_params": {}}),
        400,
        ("seq_id",),
    ),
    HttpCase(
        "opt_missing_model_id", _post("/optim_step", lambda m, s: {"seq_id": s, "adam_params": {}}), 400, ("model_id",)
    ),
    HttpCase(
        "opt_extra_field",
        _post("/optim_step", lambda m, s: {"model_id": m, "seq_id": s, "adam_params": {"momentum": 1}}),
        400,
        ("momentum",),
        True,
    ),
    HttpCase(
        "save_empty_path",
        _post("/save_weights", lambda m, s: {"model_id": m, "seq_id": s, "path": ""}),
        200,
        ("path",),
        True,
    ),
    HttpCase(
        "save_bad_name",
        _post("/save_weights", lambda m, s: {"model_id": m, "seq_id": s, "path": "a/b"}),
        200,
        ("name",),
        True,
    ),
    HttpCase(
        "sampler_ttl_zero",
        _post("/save_weights_for_sampler", lambda m, s: {"model_id": m, "seq_id": s, "path": "x", "ttl_seconds": 0}),
        200,
        ("ttl_seconds",),
        True,
    ),
    HttpCase(
        "load_missing_checkpoint",
        _post(
            "/load_weights",
            lambda m, s: {"model_id": m, "seq_id": s, "path": f"tinker://{m}/weights/none", "optimizer": False},
        ),
        200,
        ("checkpoint",),
        True,
    ),
    HttpCase(
        "retrieve_unknown_request", _post("/retrieve_future", lambda m, s: {"request_id": "nope:1"}), 404, ("request",)
    ),
    HttpCase("retrieve_invalid_json", _post("/retrieve_future", lambda m, s: b"{", JSON_RAW), 400, ("JSON",)),
    HttpCase(
        "get_info_unknown_model", _post("/get_info", lambda m, s: {"model_id": "s-none:train:0"}), 404, ("model",)
    ),
    HttpCase(
        "create_model_rank_negative",  # rank 0 asks for full fine-tuning (docs/gateway.md)
        _post(
            "/create_model",
            lambda m, s: {
                "session_id": m.rsplit(":train:", 1)[0],
                "model_seq_id": 90,
                "base_model": "tiny",
                "lora_config": {"rank": -1},
            },
        ),
        400,
        ("rank",),
    ),
    HttpCase(
        "create_model_seed_2_64",
        _post(
            "/create_model",
            lambda m, s: {
                "session_id": m.rsplit(":train:", 1)[0],
                "model_seq_id": 91,
                "base_model": "tiny",
                "lora_config": {"rank": 4, "seed": 2**64},
            },
        ),
        400,
        ("seed",),
    ),
    HttpCase(
        "asample_seed_2_64",
        _post(
            "/asample",
            lambda m, s: {
                "base_model": "tiny",
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "sampling_params": {"max_tokens": 2, "seed": 2**64},
            },
        ),
        200,
        ("seed",),
    ),
    HttpCase(
        "asample_temperature_inf",
        _post(
            "/asample",
            lambda m, s: json.dumps(
                {
                    "base_model": "tiny",
                    "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
                    "sampling_params": {"max_tokens": 2, "temperature": INF},
                }
            ).encode(),
            JSON_RAW,
        ),
        200,
        ("temperature",),
    ),
    HttpCase(
        "fb_negative_token", _fb_edit(lambda msg: _tokens(msg, [5, -1] + [7] * 14)), 400, ("tokens[1]", "-1"), True
    ),
    HttpCase(
        "fb_token_bytes_ragged",
        _fb_edit(lambda msg: setattr(msg.data[0].model_input[0].encoded_text, "tokens", b"\1\2\3")),
        400,
        ("tokens", "3 bytes"),
        True,
    ),
    HttpCase("fb_negative_shape", _fb_edit(lambda msg: _weights(msg, [-4, -4])), 400, ("weights.shape", "-4"), True),
    HttpCase(
        "fb_shape_too_many_dims", _fb_edit(lambda msg: _weights(msg, [16] + [1] * 8)), 400, ("weights.shape", "8"), True
    ),
    HttpCase(
        "fb_shape_huge", _fb_edit(lambda msg: _weights(msg, [2**62, 2**62])), 400, ("weights.shape", "2^24"), True
    ),
    HttpCase(
        "fb_csr_col_out_of_bounds",
        _fb_edit(lambda msg: _weights(msg, [1, 16], csr=([1.0], [0, 1], [99]))),
        400,
        ("col_indices[0]", "99"),
        True,
    ),
    HttpCase(
        "fb_csr_bad_offsets",
        _fb_edit(lambda msg: _weights(msg, [4, 4], csr=([1.0], [0, 1], [0]))),
        400,
        ("crow_indices",),
        True,
    ),
    HttpCase(
        "fb_csr_huge",
        _fb_edit(lambda msg: _weights(msg, [1, 2**40], csr=([], [0, 0], []))),
        400,
        ("sparse", "2^24"),
        True,
    ),
    HttpCase(
        "fb_unknown_dtype",
        _fb_edit(lambda msg: setattr(msg.data[0].loss_fn_inputs["weights"], "dtype", 77)),
        400,
        ("weights", "dtype 77"),
        True,
    ),
    HttpCase(
        "save_ttl_beyond_10_years",
        _post("/save_weights", lambda m, s: {"model_id": m, "seq_id": s, "path": "x", "ttl_seconds": 10**12}),
        200,
        ("ttl_seconds", "315360000"),
        True,
    ),
    HttpCase(
        "external_ttl_beyond_10_years",
        _post("/save_weights_external", lambda m, s: {"model_id": m, "seq_id": s, "path": "x", "ttl_seconds": 10**12}),
        200,
        ("ttl_seconds",),
        True,
    ),
    HttpCase(
        "load_other_lora_rank",
        _post(
            "/load_weights", lambda m, s: {"model_id": m, "seq_id": s, "path": HTTP_RANK8["path"], "optimizer": True}
        ),
        200,
        ("rank", "8", "4"),
        True,
    ),
    HttpCase(
        "asample_prompt_out_of_range",
        _post(
            "/asample",
            lambda m, s: {
                "base_model": "tiny",
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [-1, 2**70]}]},
                "sampling_params": {"max_tokens": 2},
            },
        ),
        200,
        ("prompt",),
    ),
    HttpCase(
        "v1_completions_prompt_out_of_range",
        _v1("/v1/completions", {"model": "tiny", "prompt": [-1, 2**70], "max_tokens": 2}),
        400,
        ("prompt",),
    ),
    HttpCase(
        "v1_completions_seed_beyond_64_bits",
        _v1("/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "seed": 2**70}),
        400,
        ("seed",),
    ),
    HttpCase(
        "v1_chat_max_tokens_huge",
        _v1(
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**40},
        ),
        400,
        ("max_tokens",),
    ),
    HttpCase(
        "asample_unserved_model",
        _post(
            "/asample",
            lambda m, s: {
                "base_model": "huge",
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
                "sampling_params": {"max_tokens": 2},
            },
        ),
        400,
        ("base_model",),
    ),
]


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
def test_http_catalog(http, case: HttpCase):
    client, victim, twin, ops = http
    before = ops.next_seq(victim)
    response = case.send(client, victim, before + 1)
    assert response.status_code == case.status, response.text
    body = response.json()
    if case.status == 200:  # a future that fails with the reason (it may also have taken a seq)
        body = settle(client, body["request_id"], timeout=LIVENESS_S).json()
        assert body.get("category") == "user", body
    error = (
        body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    )  # /v1 answers in OpenAI's error form
    for text in case.names:
        assert text in error, f"{case.name}: {text!r} not in {error!r}"
    assert ops.next_seq(victim) == before + (1 if case.takes_seq else 0), (
        "the seq rule: a refused op takes its seq, or none"
    )
    assert _http_step(client, victim, ops) == _http_step(client, twin, ops)


def test_the_catalog_is_large_enough():
    assert len(SDK_CASES) + len(HTTP_CASES) >= 60


# ---------------------------------------------------------------- misuse that ends sessions


def test_an_op_on_a_session_another_handle_stopped_fails_at_once(sdk):
    sc = sdk[2]
    tc = sc.create_lora_training_client("tiny", rank=4, seed=0)
    from treadle import ServiceClient
    from treadle.sdk.training_client import TrainingClient

    second = TrainingClient(
        ServiceClient(broker_url=sc.settings.broker_url).ops, tc.session
    )  # another handle, own connections
    pending = tc.forward(_batch())
    second.stop()
    assert pending.result(timeout=LIVENESS_S).metrics  # submitted before the stop: it ran
    with pytest.raises(SessionStoppedError) as err:
        tc.forward_backward(_batch(), "cross_entropy").result(timeout=LIVENESS_S)
    assert tc.session_id in str(err.value) and "stopped" in str(err.value)
    with pytest.raises(SessionStoppedError):
        tc.future(f"{tc.session_id}:{sc.ops.next_seq(tc.session_id) + 1}").result(timeout=LIVENESS_S)


def test_after_finish_over_http_the_next_op_fails_clearly(http):
    client, _, _, ops = http
    session_id = client.post(
        "/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    ).json()["session_id"]
    created = client.post(
        "/create_model",
        json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4, "seed": 3}},
    ).json()
    model = settle(client, created["request_id"]).json()["model_id"]
    fb = client.post("/forward_backward", content=_fb_proto(model, 1), headers=PROTO).json()["request_id"]
    assert client.post(f"/sessions/{session_id}/finish").json() == {"status": "finished"}
    assert deserialize_forward_backward_output(settle(client, fb).content).metrics["loss:sum"] > 0
    for seq in (2, 3):  # the seq right after the client's last one, which the stop must not have taken, and the next
        response = client.post("/forward_backward", content=_fb_proto(model, seq), headers=PROTO)
        assert response.status_code == 410, response.text
        assert "stopped" in response.json()["error"]
    assert client.post(f"/sessions/{session_id}/finish").json() == {"status": "finished"}  # twice is harmless


def test_a_late_chunk_below_the_stop_still_runs(http):
    """Chunks arrive concurrently: a finish may land between them; the earlier seq still runs before the stop."""
    client, _, _, ops = http
    session_id = client.post(
        "/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    ).json()["session_id"]
    created = client.post(
        "/create_model",
        json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4, "seed": 3}},
    ).json()
    model = settle(client, created["request_id"]).json()["model_id"]
    second = client.post("/forward_backward", content=_fb_proto(model, 2), headers=PROTO).json()["request_id"]
    client.post(f"/sessions/{session_id}/finish")
    first = client.post("/forward_backward", content=_fb_proto(model, 1), headers=PROTO).json()["request_id"]
    for request_id in (first, second):
        assert (
            deserialize_forward_backward_output(settle(client, request_id, timeout=30).content).metrics["loss:sum"] > 0
        )
    assert ops.session_info(model).status == "stopped" or ops.session_info(model).stop_seq == 3


def test_load_state_refuses_another_lora_shape_and_get_info_is_unchanged(sdk):
    victim, _, sc, rank8 = sdk
    with pytest.raises(InvalidRequestError) as err:
        victim.load_state_with_optimizer(rank8).result(timeout=LIVENESS_S)
    assert "rank" in str(err.value)
    assert sc.ops.session_info(victim.session_id).lora == LoraConfig(rank=4, seed=7)


def test_the_largest_accepted_seeds_work_end_to_end(sdk):
    """The bounds are what torch takes: SEED_MAX as a LoRA seed and as a sampling seed (plus per-row offsets) run."""
    from treadle.types import SEED_MAX

    sc = sdk[2]
    tc = sc.create_lora_training_client("tiny", rank=4, seed=SEED_MAX)
    out = (
        tc.create_sampling_client(tc.save_weights_for_sampler().result(timeout=60).path)
        .sample(ModelInput.from_ints([5, 6, 7]), 4, SamplingParams(max_tokens=2, seed=SEED_MAX))
        .result(timeout=60)
    )
    assert len(out.sequences) == 4 and all(len(s.tokens) == 2 for s in out.sequences)
    tc.stop()


@pytest.mark.parametrize("status, error", [("lost", "SessionLostError"), ("expired", "SessionExpiredError")])
def test_ops_and_pending_futures_of_a_lost_or_expired_session_fail_with_its_error(sdk, status, error):
    from treadle.queue.ops import NoopRequest, StopRequest

    sc = sdk[2]
    tc = sc.create_lora_training_client("tiny", rank=4, seed=0)
    gap = sc.ops.next_seq(tc.session_id) + 1
    pending = sc.ops.submit(tc.session_id, NoopRequest(), seq=gap + 1)  # behind a gap: it waits
    sc.ops.sessions.update(tc.session_id, status=status, checkpoint=f"treadle://{tc.run_id}/weights/auto")
    with pytest.raises(Exception) as err:
        tc.forward(_batch())
    assert type(err.value).__name__ == error and tc.session_id in str(err.value)
    with pytest.raises(Exception) as err:
        sc.ops.wait(pending, timeout=LIVENESS_S)  # a hang fails as FutureTimeoutError, not as `error`
    assert type(err.value).__name__ == error
    if status == "expired":
        assert f"treadle://{tc.run_id}/weights/auto" in str(err.value)  # says where to resume from
    sc.ops.sessions.update(tc.session_id, status="active")  # fill the gap and stop, so the worker frees the adapter
    sc.ops.submit(tc.session_id, NoopRequest(), seq=gap)
    sc.ops.wait(pending, timeout=30)
    tc._submit(StopRequest()).result(timeout=30)


def test_a_pending_gateway_future_of_a_lost_model_fails_with_the_error(http):
    """retrieve_future asks whether a held future can still resolve: a Tinker client of a lost model gets
    the error in the one error form, not try_again for ever."""
    from treadle.queue.ops import NoopRequest

    client, _, _, ops = http
    session_id = client.post(
        "/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    ).json()["session_id"]
    created = client.post(
        "/create_model",
        json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4, "seed": 3}},
    ).json()
    model = settle(client, created["request_id"]).json()["model_id"]
    pending = client.post("/forward_backward", content=_fb_proto(model, 2), headers=PROTO).json()[
        "request_id"
    ]  # behind a gap: it waits
    assert client.post("/retrieve_future", json={"request_id": pending}).json()["type"] == "try_again"
    ops.sessions.update(model, status="lost")
    body = settle(client, pending, timeout=LIVENESS_S).json()  # still try_again after it: the assertions below fail
    assert model in body.get("error", "") and "lost" in body["error"], body
    assert body["category"] == "server"
    ops.sessions.update(model, status="active")  # fill the gap and finish, so the worker frees the adapter
    ops.submit(model, NoopRequest(), seq=1)
    assert deserialize_forward_backward_output(settle(client, pending, timeout=30).content).metrics["loss:sum"] > 0
    client.post(f"/sessions/{session_id}/finish")


def test_a_submitted_sample_is_known_for_as_long_as_its_result(sdk):
    """A sample id is recorded when submitted, so check_future passes it while pending (restarts included)
    and refuses one never submitted; the record lives as long as the result would."""
    from treadle.queue import names
    from treadle.queue.celery_app import RESULT_EXPIRES_S

    ops = sdk[2].ops
    future = (
        sdk[2]
        .create_sampling_client(base_model="tiny")
        .sample(ModelInput.from_ints([5, 6]), 1, SamplingParams(max_tokens=2))
    )
    ops.check_future(future.id)
    assert ops.redis.ttl(names.submitted_key(future.id)) > RESULT_EXPIRES_S - 60
    assert len(future.result(timeout=60).sequences) == 1
    with pytest.raises(InvalidRequestError, match="no sample was submitted"):
        ops.check_future("sample:" + "2" * 32)
