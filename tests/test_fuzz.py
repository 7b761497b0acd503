"""Property-based tests (hypothesis): the wire types, valid and invalid, and the gateway's routes.

Bounded example counts keep CI time fixed: 150 examples for each wire-type property (no stack), and
against one running gateway 120 requests over its training routes, 60 raw forward_backward bodies, 50
protobuf forward_backward messages (any int32 token, shape and sparse CSR) and 40 /asample prompts of
any integers: the whole file took 30 s on a shared 2-core machine, half of it starting the stack.
Derandomized, so a CI failure reproduces.
"""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb

from tests.fixtures.gateway import settle
from treadle.errors import InvalidRequestError
from treadle.queue.ops import ForwardBackwardRequest, OptimStepRequest, parse_request
from treadle.types import LOSS_CONFIGS, AdamParams, Datum, LoraConfig, ModelInput, SamplingParams

WIRE = settings(max_examples=150, deadline=None, derandomize=True)
ROUTES = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# A liveness bound, not a speed claim: a request or a future still unanswered by then hangs (a loaded machine
# answers far sooner). What the tests assert is the answer: no 5xx, settled, not a server error.
LIVENESS_S = 120.0

# Every numeric field of the configs, with its bounds: (low, low inclusive, high, high inclusive).
BOUNDS = {
    AdamParams: {
        "learning_rate": (0.0, True, 10.0, True),
        "beta1": (0.0, True, 1.0, False),
        "beta2": (0.0, True, 1.0, False),
        "eps": (0.0, False, 1.0, True),
        "weight_decay": (0.0, True, 1.0, True),
        "grad_clip_norm": (0.0, True, 1e6, True),
    },
    SamplingParams: {"temperature": (0.0, True, 100.0, True), "top_p": (0.0, False, 1.0, True)},
    LoraConfig: {"alpha": (0.0, False, 1e6, True)},
}
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def _inside(low, low_in, high, high_in):
    return st.floats(min_value=low, max_value=high, exclude_min=not low_in, exclude_max=not high_in, allow_nan=False)


def _outside(low, low_in, high, high_in):
    below = st.floats(max_value=low, exclude_max=low_in, allow_nan=False, allow_infinity=False)
    above = st.floats(min_value=high, exclude_min=high_in, allow_nan=False, allow_infinity=False)
    return st.one_of(below, above, NON_FINITE)


def _valid(model):
    return st.fixed_dictionaries({}, optional={k: _inside(*b) for k, b in BOUNDS[model].items()})


@WIRE
@given(st.sampled_from(list(BOUNDS)).flatmap(lambda m: st.tuples(st.just(m), _valid(m))))
def test_valid_configs_build_and_round_trip(model_and_fields):
    model, fields = model_and_fields
    value = model(**fields)
    assert model.model_validate_json(value.model_dump_json()) == value


@WIRE
@given(
    st.sampled_from([(m, f) for m in BOUNDS for f in BOUNDS[m]]).flatmap(
        lambda mf: st.tuples(st.just(mf), _outside(*BOUNDS[mf[0]][mf[1]]))
    )
)
def test_an_out_of_bounds_or_non_finite_number_is_refused_by_name(case):
    (model, field), value = case
    with pytest.raises(ValidationError) as err:
        model(**{field: value})
    assert field in str(err.value)
    with pytest.raises(InvalidRequestError) as err:  # the same through the gateway's and worker's door
        parse_request(model, {field: value}, model.__name__)
    assert field in str(err.value)


INTS = {
    (SamplingParams, "seed"): (0, 2**63 - 1),
    (SamplingParams, "max_tokens"): (1, 2**20),
    (LoraConfig, "rank"): (1, 1024),
    (LoraConfig, "seed"): (0, 2**63 - 1),
    (SamplingParams, "top_k"): (1, 2**31 - 1),
}


@WIRE
@given(
    st.sampled_from(list(INTS)).flatmap(
        lambda key: st.tuples(
            st.just(key),
            st.one_of(
                st.integers(max_value=INTS[key][0] - 1), st.integers(min_value=INTS[key][1] + 1, max_value=2**80)
            ),
        )
    )
)
def test_an_integer_outside_its_range_is_refused_by_name(case):
    (model, field), value = case
    if (model, field) == (SamplingParams, "top_k") and value == -1:
        return  # -1 is top_k's "off"
    with pytest.raises(ValidationError) as err:
        model(**{field: value})
    assert field in str(err.value)


CLIPPED = [name for name, cfg in LOSS_CONFIGS.items() if "clip_low_threshold" in cfg.model_fields]


@WIRE
@given(st.sampled_from(CLIPPED), st.floats(-10, 10, allow_nan=False), st.floats(-10, 1e4, allow_nan=False))
def test_loss_configs_are_valid_exactly_when_in_bounds_and_ordered(loss_fn, low, high):
    cfg = LOSS_CONFIGS[loss_fn]
    fields = cfg.model_fields

    def ok(name, value):
        meta = {type(m).__name__: m for m in fields[name].metadata}
        return all(
            [
                "Gt" not in meta or value > meta["Gt"].gt,
                "Ge" not in meta or value >= meta["Ge"].ge,
                "Lt" not in meta or value < meta["Lt"].lt,
                "Le" not in meta or value <= meta["Le"].le,
            ]
        )

    valid = ok("clip_low_threshold", low) and ok("clip_high_threshold", high) and low < high
    payload = {"clip_low_threshold": low, "clip_high_threshold": high}
    if valid:
        cfg.model_validate(payload)
    else:
        with pytest.raises(ValidationError) as err:
            cfg.model_validate(payload)
        assert "clip_" in str(err.value)


FLOAT_VALUES = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), NON_FINITE)


@WIRE
@given(
    st.lists(st.integers(-5, 2**31 + 5), min_size=0, max_size=8),
    st.lists(FLOAT_VALUES, min_size=0, max_size=8),
    st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "hinge"]),
    st.one_of(
        st.none(),
        st.dictionaries(
            st.sampled_from(["beta", "clip_low_threshold", "clip_high_threshold", "x"]), FLOAT_VALUES, max_size=3
        ),
    ),
)
def test_forward_backward_requests_build_or_fail_naming_a_field(tokens, weights, loss_fn, config):
    """The SDK's door: any mix of tokens, values, losses and configs builds or is an InvalidRequestError / ValidationError naming a field."""
    try:
        datum = Datum(
            model_input=ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": tokens, "weights": weights}
        )
    except ValidationError as err:
        assert "tokens" in str(err) or "shape" in str(err)
        return
    try:
        ForwardBackwardRequest.build(data=[datum], loss_fn=loss_fn, loss_fn_config=config)
    except InvalidRequestError as err:
        assert any(name in str(err) for name in ("loss_fn", "data[0]", "loss_fn_config", "beta", "clip_")), str(err)
    else:
        assert all(math.isfinite(w) for w in weights)


@WIRE
@given(
    st.dictionaries(
        st.sampled_from(list(AdamParams.model_fields) + ["momentum"]),
        st.one_of(FLOAT_VALUES, st.text(max_size=3), st.none(), st.booleans()),
        max_size=4,
    )
)
def test_optim_step_payloads_parse_or_name_a_field(payload):
    try:
        OptimStepRequest.build(adam_params=payload)
    except InvalidRequestError as err:
        assert any(name in str(err) for name in payload), str(err)


# ---------------------------------------------------------------- the gateway's routes, running

KEY = "tml-fuzz-key"
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def fuzz_gateway(stack):
    from treadle import ServiceClient
    from treadle.gateway.server import BackgroundGateway
    from treadle.gateway.settings import GatewaySettings

    settings_ = GatewaySettings(
        port=0,
        broker_url=stack.broker_url,
        storage_url=stack.storage_url,
        api_keys={KEY: "fuzz"},
        long_poll_seconds=1,
        max_body_bytes=1 << 16,
        max_decompressed_bytes=1 << 20,
        max_seq_ahead=32,
    )
    ops = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url).ops
    with BackgroundGateway(settings_) as gateway:
        client = httpx.Client(base_url=gateway.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=LIVENESS_S)
        session_id = client.post(
            "/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
        ).json()["session_id"]
        created = client.post(
            "/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": 0,
                "base_model": "tiny",
                "lora_config": {"rank": 4, "seed": 5},
            },
        ).json()
        assert settle(client, created["request_id"], 60).json()["model_id"] == created["model_id"]
        yield client, created["model_id"], ops
        client.close()


JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8)
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
FIELDS = {
    "/optim_step": {
        "adam_params": st.fixed_dictionaries({}, optional={k: JSON_LEAF for k in AdamParams.model_fields}),
        "optimizer_params": JSON_VALUE,
    },
    "/save_weights": {
        "path": st.one_of(st.text(max_size=12), JSON_LEAF),
        "ttl_seconds": JSON_LEAF,
        "overwrite": JSON_LEAF,
    },
    "/save_weights_for_sampler": {"path": st.one_of(st.none(), st.text(max_size=12)), "ttl_seconds": JSON_LEAF},
    "/load_weights": {"path": st.text(max_size=20), "optimizer": JSON_LEAF},
    "/get_info": {},
    "/retrieve_future": {"request_id": JSON_LEAF},
    "/asample": {
        "base_model": st.sampled_from(["tiny", "nope"]),
        "num_samples": JSON_LEAF,
        "prompt": st.just({"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}),
        "sampling_params": st.fixed_dictionaries(
            {"max_tokens": st.integers(-2, 3)},
            optional={k: JSON_LEAF for k in ("seed", "temperature", "top_p", "top_k")},
        ),
    },
}


SEEN: dict[str, set[int]] = {}  # route -> statuses answered, so the last test can check the fuzz reached both paths


# The next seq (it runs), an old one (a retry or a 409), or one outside the window or not a seq at all
# (refused, takes nothing). Drawn as a kind plus a number, so generation never depends on the server's state.
SEQ_KIND = st.sampled_from(["next", "next", "next", "old", "not_positive", "far", "text", "none"])


def _seq(kind: str, number: int, next_seq: int):
    return {
        "next": next_seq,
        "old": 1,
        "not_positive": -number,
        "far": next_seq + 40 + number,
        "text": str(number),
        "none": None,
    }[kind]


@ROUTES
@given(data=st.data())
def test_gateway_routes_never_5xx_nor_hang(fuzz_gateway, data):
    client, model, ops = fuzz_gateway
    route = data.draw(st.sampled_from(list(FIELDS)))
    body = {
        "model_id": data.draw(st.sampled_from([model, model, model, model + "x", 3])),
        "seq_id": _seq(data.draw(SEQ_KIND), data.draw(st.integers(0, 2**70)), ops.next_seq(model) + 1),
    }
    body.update(data.draw(st.fixed_dictionaries({}, optional=FIELDS[route])))
    raw = json.dumps(body, allow_nan=True).encode()
    response = client.post(route, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (route, raw, response.text)
    SEEN.setdefault(route, set()).add(response.status_code)
    if response.status_code != 200:
        assert response.json()["error"], response.text  # every error in the one JSON form, with a message
    elif "request_id" in response.json():
        settled = settle(client, response.json()["request_id"], LIVENESS_S)
        assert settled.status_code == 200
        if settled.headers["content-type"].startswith("application/json"):
            outcome = settled.json()
            assert outcome.get("type") != "try_again", (route, raw, "still pending")
            assert outcome.get("category") != "server", (route, raw, outcome)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=256), compress=st.booleans())
def test_forward_backward_bodies_never_5xx(fuzz_gateway, raw, compress):
    client, _, _ = fuzz_gateway
    headers = {**PROTO, "Content-Encoding": "zstd"} if compress else PROTO
    body = zstandard.ZstdCompressor().compress(raw) if compress and raw[:1] != b"\x00" else raw
    response = client.post("/forward_backward", content=body, headers=headers)
    assert response.status_code < 500, response.text


# Protobuf forward_backwards as the SDK would never send them: any int32 token, any shape (negative,
# huge, too many dimensions), dense bytes of any length, sparse CSR with any offsets and indices, any
# dtype number. Mostly near-valid (small tokens, the datum's own length), so many reach the worker.
INT32 = st.integers(-(2**31), 2**31 - 1)
TOKENS = st.one_of(
    st.lists(st.integers(0, 250), max_size=8), st.lists(st.one_of(st.integers(0, 250), INT32), max_size=8)
)
RAGGED = st.sampled_from([b""] * 7 + [b"\x07"])  # now and then a byte too many
DIM = st.one_of(st.integers(-3, 20), st.integers(-(2**62), 2**62))
FLOAT32 = st.one_of(st.floats(-1e3, 1e3, width=32), NON_FINITE)


@st.composite
def _tensor_into(draw, tensor, n: int) -> None:
    tensor.dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32] * 4 + [pb.DTYPE_INT64] * 3 + [7]))
    tensor.shape.extend(draw(st.one_of(st.just([n]), st.just([n]), st.just([]), st.lists(DIM, max_size=9))))
    itemsize, np_dtype = (8, "<i8") if tensor.dtype == pb.DTYPE_INT64 else (4, "<f4")
    values = st.integers(-(2**63), 2**63 - 1) if itemsize == 8 else FLOAT32
    if draw(st.integers(0, 3)) == 0:  # sparse CSR
        nnz = draw(st.integers(0, 4))
        tensor.sparse_csr.values = np.asarray(
            draw(st.lists(values, min_size=nnz, max_size=nnz)), dtype=np_dtype
        ).tobytes()
        tensor.sparse_csr.crow_indices = np.asarray(
            draw(st.lists(st.integers(-2, 6), max_size=6)), dtype="<i8"
        ).tobytes()
        tensor.sparse_csr.col_indices = np.asarray(
            draw(
                st.lists(st.one_of(st.integers(-2, 20), st.integers(-(2**62), 2**62)), min_size=nnz, max_size=nnz + 1)
            ),
            dtype="<i8",
        ).tobytes()
    else:
        size = draw(st.one_of(st.just(n), st.just(n), st.integers(0, n + 2)))
        tensor.dense = np.asarray(draw(st.lists(values, min_size=size, max_size=size)), dtype=np_dtype).tobytes()


@st.composite
def forward_backward_messages(draw) -> "pb.ForwardBackwardRequest":
    """A ForwardBackwardRequest without model_id and seq_id (the test sets them against the live model)."""
    msg = pb.ForwardBackwardRequest(
        loss_fn=draw(st.sampled_from(["cross_entropy", "cross_entropy", "importance_sampling", "hinge"])),
        forward_only=draw(st.booleans()),
    )
    for _ in range(draw(st.integers(0, 2))):
        datum = msg.data.add()
        tokens = draw(TOKENS)
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes() + draw(RAGGED)
        for name in draw(
            st.lists(st.sampled_from(["target_tokens", "weights", "advantages", "logprobs"]), unique=True, max_size=3)
        ):
            draw(_tensor_into(datum.loss_fn_inputs[name], len(tokens)))
    return msg


def _answered(client, response, what) -> None:
    """No 5xx; a future settles and is not a server error; every error in the one JSON form."""
    assert response.status_code < 500, (what, response.text)
    if response.status_code != 200:
        assert response.json()["error"], response.text
    elif "request_id" in response.json():
        settled = settle(client, response.json()["request_id"], LIVENESS_S)
        assert settled.status_code == 200
        if settled.headers["content-type"].startswith("application/json"):
            outcome = settled.json()
            assert outcome.get("type") != "try_again", (what, "still pending")
            assert outcome.get("category") != "server", (what, outcome)


@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(msg=forward_backward_messages())
def test_forward_backward_messages_never_5xx_nor_hang(fuzz_gateway, msg):
    client, model, ops = fuzz_gateway
    msg.model_id, msg.seq_id = model, ops.next_seq(model) + 1
    response = client.post("/forward_backward", content=msg.SerializeToString(), headers=PROTO)
    _answered(client, response, msg)
    if response.status_code == 400 and "data" in response.json()["error"]:
        assert ops.next_seq(model) == msg.seq_id, "a forward_backward refused for its data still takes its seq"


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    tokens=st.lists(st.one_of(st.integers(0, 250), st.integers(0, 250), st.integers(-(2**70), 2**70)), max_size=6),
    max_tokens=st.integers(1, 2),
)
def test_asample_prompt_tokens_never_5xx_nor_hang(fuzz_gateway, tokens, max_tokens):
    client, _, _ = fuzz_gateway
    body = {
        "base_model": "tiny",
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": 1},
    }
    _answered(client, client.post("/asample", json=body), tokens)


def test_the_fuzzed_model_is_healthy_afterwards(fuzz_gateway):
    from tinker import types as tt
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    client, model, ops = fuzz_gateway
    assert {200, 400} <= set().union(*SEEN.values()) and len(SEEN) == len(FIELDS), SEEN
    seq = ops.next_seq(model) + 1
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(
            data=[
                tt.Datum(
                    model_input=tt.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
                )
            ],
            loss_fn="cross_entropy",
        ),
        model_id=model,
        seq_id=seq,
    )
    fb = client.post(
        "/forward_backward", content=forward_backward_request_to_proto(request).SerializeToString(), headers=PROTO
    )
    out = deserialize_forward_backward_output(settle(client, fb.json()["request_id"], 30).content)
    assert (
        "loss:sum" in out.metrics
    )  # finite or not: fuzzed but valid hyperparameters (lr 10, decay 1) may blow weights up
    opt = client.post(
        "/optim_step", json={"model_id": model, "seq_id": seq + 1, "adam_params": {"learning_rate": 1e-3}}
    ).json()
    assert settle(client, opt["request_id"], 30).json()["metrics"]["step:max"] >= 1
