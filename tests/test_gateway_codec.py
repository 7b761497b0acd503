"""The gateway's protobuf codec, path mapping and settings, checked against the tinker SDK's own converters."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from treadle.errors import InvalidCheckpointNameError, InvalidRequestError
from treadle.gateway.paths import to_tinker, to_treadle
from treadle.gateway.proto_codec import (
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_request,
    parse_forward_backward,
)
from treadle.gateway.routes_sampling import _sample_request
from treadle.gateway.settings import GatewaySettings
from treadle.queue.ops import ForwardBackwardRequest, SampleRequest
from treadle.types import ForwardBackwardOutput, ImageChunk, ModelInput, SampleResponse, TensorData


def _sdk_request(data, loss_fn="ppo", config=None, forward_only=False) -> bytes:
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s-1:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_forward_backward_request_decodes_to_treadle_datums():
    data = [
        tt.Datum(
            model_input=tt.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={
                "target_tokens": [6, 7, 8],
                "logprobs": [-1.0, -2.0, -3.0],
                "advantages": [0.5, 0.5, 0.5],
            },
        ),
        tt.Datum(
            model_input=tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1]), tt.EncodedTextChunk(tokens=[2])]),
            loss_fn_inputs={"target_tokens": [2, 3], "weights": [0.0, 1.0]},
        ),
    ]
    msg = parse_forward_backward(_sdk_request(data, config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}))
    request = forward_backward_request(msg)

    assert (msg.model_id, msg.seq_id, msg.forward_only) == ("s-1:train:0", 7, False)
    assert (request.op, request.loss_fn) == ("forward_backward", "ppo")
    assert request.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    datums = request.data
    assert datums[0].model_input.to_ints() == [5, 6, 7]
    assert datums[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    assert datums[0].loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8]
    assert datums[0].loss_fn_inputs["logprobs"].tolist() == [-1.0, -2.0, -3.0]
    assert datums[1].model_input.to_ints() == [1, 2]  # chunks are concatenated
    assert datums[1].loss_fn_inputs["weights"].tolist() == [0.0, 1.0]


def test_forward_only_flag_and_sparse_inputs():
    sparse = tt.TensorData(
        data=[0.5, 2.0], dtype="float32", shape=[2, 3], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[2, 0]
    )
    data = [
        tt.Datum(model_input=tt.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3], "dist": sparse})
    ]
    msg = parse_forward_backward(_sdk_request(data, "cross_entropy", forward_only=True))
    request = forward_backward_request(msg)
    assert msg.forward_only is True and request.op == "forward"
    assert request.loss_fn_config is None
    dense = request.data[0].loss_fn_inputs["dist"].to_numpy()
    np.testing.assert_array_equal(dense, [[0, 0, 0.5], [2.0, 0, 0]])


def test_image_chunks_travel_from_the_sdk_to_the_journal_and_bad_ones_are_user_errors():
    png = b"\x89PNG\r\n\x1a\n not decoded here"
    image = tt.ImageChunk(data=png, format="png", expected_tokens=4)
    model_input = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1, 2]), image, tt.EncodedTextChunk(tokens=[3])])
    assert model_input.length == 7  # Tinker's rule: an image chunk's length is its expected_tokens
    data = [tt.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [0] * 7, "weights": [1.0] * 7})]
    request = forward_backward_request(parse_forward_backward(_sdk_request(data, "cross_entropy")))
    chunks = request.data[0].model_input.chunks
    assert [c.type for c in chunks] == ["encoded_text", "image", "encoded_text"]
    assert (chunks[1].data, chunks[1].format, chunks[1].expected_tokens) == (png, "png", 4)
    assert request.data[0].model_input.length == 7
    # The journal holds the request as JSON (the image base64'd) and the worker decodes it back whole.
    assert ForwardBackwardRequest.decode(request.encode()) == request
    assert b"image" in request.encode() and png not in request.encode()

    # asample's JSON prompt (the SDK base64s the bytes) becomes chunks; a text-only prompt stays token ids.
    sample = tt.SampleRequest(prompt=model_input, num_samples=1, sampling_params=tt.SamplingParams(max_tokens=2))
    parsed = tt.SampleRequest.model_validate_json(sample.model_dump_json())
    ours = _sample_request(parsed, "tiny", None)[0]
    assert isinstance(ours.prompt, ModelInput) and ours.prompt_length == 7
    assert SampleRequest.decode(ours.encode()).prompt_input.chunks[1] == ImageChunk(
        data=png, format="png", expected_tokens=4
    )
    text = tt.SampleRequest(prompt=tt.ModelInput.from_ints([4, 5]), num_samples=1, sampling_params=tt.SamplingParams())
    assert _sample_request(text, "tiny", None)[0].prompt == [4, 5]

    msg = parse_forward_backward(_sdk_request(data, "cross_entropy"))
    msg.data[0].model_input[1].image.format = "gif"
    with pytest.raises(InvalidRequestError, match=r"data\[0\].model_input.chunks\[1\].format: .*'png' or 'jpeg'"):
        forward_backward_request(msg)
    msg.data[0].model_input[1].image.format = "png"
    msg.data[0].model_input[1].image.override_dimensions.width = 8
    with pytest.raises(InvalidRequestError, match=r"chunks\[1\].override_dimensions: not supported"):
        forward_backward_request(msg)
    with pytest.raises(InvalidRequestError, match="not a protobuf ForwardBackwardRequest"):
        parse_forward_backward(b"\xff\xff\xff")


def test_forward_backward_output_round_trips_through_the_sdk_decoder():
    outputs = [
        TensorData.from_list([-0.5, -1.25], "float32"),
        TensorData.from_list([-3.0], "float32"),
        TensorData.from_list([], "float32"),
    ]
    result = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": t} for t in outputs], metrics={"loss:sum": 4.75, "step:max": 3.0}
    )
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert decoded.metrics == {"loss:sum": 4.75, "step:max": 3.0}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-0.5, -1.25], [-3.0], []]


def test_sample_response_round_trips_with_none_prompt_logprobs_and_topk():
    result = SampleResponse.model_validate(
        {
            "sequences": [
                {"tokens": [4, 5, 6], "logprobs": [-0.1, -0.2, -0.3], "stop_reason": "stop"},
                {"tokens": [9], "logprobs": None, "stop_reason": "length"},
            ],
            "prompt_logprobs": [None, -1.5, -2.5],
            "topk_prompt_logprobs": [None, [(3, -0.5), (4, -1.0)], [(7, -0.25)]],
        }
    )
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert [s.tokens for s in decoded.sequences] == [[4, 5, 6], [9]]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert decoded.sequences[1].logprobs is None
    assert decoded.prompt_logprobs[0] is None and decoded.prompt_logprobs[1:] == pytest.approx([-1.5, -2.5])
    topk = decoded.topk_prompt_logprobs
    assert topk[1] == [(3, -0.5), (4, -1.0)]
    assert topk[2][0] == (7, -0.25)


def test_paths_map_both_ways_and_reject_malformed():
    assert to_tinker("treadle://s-1:train:0/weights/final") == "tinker://s-1:train:0/weights/final"
    assert to_treadle("tinker://s-1:train:0/sampler_weights/x") == "treadle://s-1:train:0/sampler_weights/x"
    for bad in ("tinker://run/weights", "tinker://run/other/x", "http://run/weights/x", "tinker://run/weights/a/b"):
        with pytest.raises(InvalidCheckpointNameError):
            to_treadle(bad)


def test_keys_come_from_a_toml_file_and_must_start_with_tml(tmp_path, monkeypatch):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys]\n"tml-alice" = "alice"\n')
    monkeypatch.setenv("TREADLE_GATEWAY_API_KEYS_FILE", str(keys))
    monkeypatch.setenv("TREADLE_GATEWAY_API_KEYS", '{"tml-bob": "bob"}')
    monkeypatch.setenv("TREADLE_BROKER_URL", "redis://example:1/0")
    settings = GatewaySettings()
    assert settings.api_keys == {"tml-alice": "alice", "tml-bob": "bob"}
    assert settings.broker_url == "redis://example:1/0"
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        GatewaySettings(api_keys={"sk-nope": "eve"})


def test_target_ids_and_their_scores_keep_the_requests_layout_through_the_sdks_decoder():
    import torch

    from tinker.types._pydantic_types.tensor_data import TensorData as WireTensor

    from treadle.gateway.sample_targets import dense_target_ids
    from treadle.types import PromptAltTokens, SampledSequence

    ids = torch.full((10, 2), -1, dtype=torch.int64)  # sparse enough that the SDK sends CSR
    ids[2] = torch.tensor([7, 9])
    sparse = tt.TensorData.from_torch_sparse(ids, pad_value=-1)
    wire = WireTensor(
        data=sparse.data,
        dtype="int64",
        shape=sparse.shape,
        sparse_crow_indices=sparse.sparse_crow_indices,
        sparse_col_indices=sparse.sparse_col_indices,
    )
    dense, layout = dense_target_ids(wire, 10)
    assert (dense.to_numpy() == ids.numpy()).all() and layout == {"crow": [0, 0, 0] + [2] * 8, "col": [0, 1]}
    scores = np.where(ids.numpy() >= 0, -1.5, 0.0).astype(np.float32)
    alt = PromptAltTokens(
        tokens=TensorData.from_numpy(np.zeros((10, 3), dtype=np.int64)),
        logprobs=TensorData.from_numpy(np.full((10, 3), -2.0, dtype=np.float32)),
    )
    response = SampleResponse(
        sequences=[
            SampledSequence(
                tokens=[5, 6],
                logprobs=[-0.1, -0.2],
                stop_reason="length",
                topk_logprobs=[[(5, -0.1), (8, -2.0)], [(6, -0.2)]],
            )
        ],
        target_prompt_logprobs=TensorData.from_numpy(scores),
        prompt_alt_tokens=alt,
    )
    got = deserialize_sample_response(encode_sample_response(response, layout))
    assert got.target_prompt_logprobs.sparse_crow_indices == [0, 0, 0] + [2] * 8
    assert (got.target_prompt_logprobs.to_numpy() == scores).all()
    assert (
        deserialize_sample_response(encode_sample_response(response)).target_prompt_logprobs.to_numpy() == scores
    ).all()
    assert got.prompt_alt_tokens.tokens.to_numpy().shape == (10, 3) and got.prompt_alt_tokens.tokens.dtype == "int64"
    # A short top-k row is padded with the SDK's sentinel, which its list form drops again.
    assert got.sequences[0].topk_logprobs == [[(5, pytest.approx(-0.1)), (8, -2.0)], [(6, pytest.approx(-0.2))]]
    for bad, match in (
        (WireTensor(data=[2**70], dtype="int64", shape=[4, 1]), "not a token id"),
        (WireTensor(data=[1.5] * 4, dtype="int64", shape=[4, 1]), "1.5 is not a token id"),
        (WireTensor(data=[1] * 4, dtype="int64", shape=[3, 1]), r"must be int64 \[len\(prompt\) - 1 = 4, K\]"),
        (
            WireTensor(data=[1], dtype="int64", shape=[4, 1], sparse_crow_indices=[0, 1], sparse_col_indices=[0]),
            "not a valid sparse CSR",
        ),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            dense_target_ids(bad, 4)
