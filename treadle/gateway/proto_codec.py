"""Protobuf in and out, with the message definitions the `tinker` package ships (`tinker_public_pb2`).

SDK 0.38 sends every forward_backward as a protobuf `ForwardBackwardRequest` and accepts
`ForwardBackwardOutput` and `SampleResponse` results only as protobuf. Tensors on both sides are raw
little-endian bytes, which is also treadle's own tensor wire format (`TensorData.to_wire`), so dense
tensors become arrays with one `np.frombuffer`, never Python lists.
"""

from __future__ import annotations

import math

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from treadle.errors import InvalidRequestError
from treadle.gateway.sample_targets import listed_scores
from treadle.queue.ops import ForwardBackwardRequest, ForwardRequest
from treadle.types import Datum, ForwardBackwardOutput, ModelInput, SampleResponse, TensorData

PROTO_MEDIA_TYPE = "application/x-protobuf"

_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
_NP = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}
_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# ---------------------------------------------------------------- requests


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError derives from Exception only
        raise InvalidRequestError(f"body: not a protobuf ForwardBackwardRequest ({exc})") from None
    return msg


def forward_backward_request(msg: pb.ForwardBackwardRequest) -> ForwardRequest:
    """treadle's typed forward (forward_only) or forward_backward request; tensors stay arrays."""
    cls = ForwardRequest if msg.forward_only else ForwardBackwardRequest
    return cls.build(data=[_datum(i, d) for i, d in enumerate(msg.data)], loss_fn=msg.loss_fn,
                     loss_fn_config=_loss_config(msg) or None)


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict:
    # v2 carries numbers and strings; the legacy map only numbers. The SDK writes both; prefer v2.
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


def _datum(index: int, datum: pb.Datum) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(f"data[{index}].model_input: {kind} chunks are not supported; only encoded_text")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {name: _tensor(f"data[{index}].loss_fn_inputs.{name}", t) for name, t in datum.loss_fn_inputs.items()}
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _tensor(field: str, tensor: pb.Tensor) -> TensorData:
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequestError(f"{field}: dtype {pb.DType.Name(tensor.dtype)} is not supported; use float32 or int64")
    shape = list(tensor.shape) or None
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raw = _densify_csr(field, tensor.sparse_csr, dtype, shape)
    else:
        raw = tensor.dense
    if len(raw) % _NP[dtype].itemsize:
        raise InvalidRequestError(f"{field}: {len(raw)} bytes is not a whole number of {dtype} values")
    array = np.frombuffer(raw, dtype=_NP[dtype])
    if shape is not None and math.prod(shape) != array.size:
        raise InvalidRequestError(f"{field}: shape {shape} holds {math.prod(shape)} values but the tensor has {array.size}")
    return TensorData.from_numpy(array.reshape(shape) if shape is not None else array)


def _densify_csr(field: str, csr: pb.SparseCsr, dtype: str, shape: list[int] | None) -> bytes:
    if shape is None or len(shape) != 2:
        raise InvalidRequestError(f"{field}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    values = np.frombuffer(csr.values, dtype=_NP[dtype])
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    cols = np.frombuffer(csr.col_indices, dtype="<i8")
    dense = np.zeros(shape, dtype=_NP[dtype])
    for row in range(shape[0]):
        start, end = int(crow[row]), int(crow[row + 1])
        dense[row, cols[start:end]] = values[start:end]
    return dense.tobytes()


# ---------------------------------------------------------------- results


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """treadle's forward/forward_backward output -> protobuf ForwardBackwardOutput (one ArrayRecord)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    if out.loss_fn_outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(out.loss_fn_outputs))
        for name in out.loss_fn_outputs[0]:
            record.fields[name].CopyFrom(_batched([o[name] for o in out.loss_fn_outputs]))
    return msg.SerializeToString()


def _batched(tensors: list[TensorData]) -> pb.BatchedTensor:
    """Per-datum tensors concatenated, with n+1 byte offsets; the leading dimension is each datum's own."""
    blobs = [np.ascontiguousarray(t.to_numpy(), dtype=_NP[t.dtype]).tobytes() for t in tensors]
    offsets = np.cumsum([0] + [len(b) for b in blobs], dtype="<i8")
    shape = tensors[0].shape or []
    dtype = pb.DTYPE_INT64 if tensors[0].dtype == "int64" else pb.DTYPE_FLOAT32
    return pb.BatchedTensor(data=b"".join(blobs), offsets=offsets.tobytes(), dtype=dtype, trailing_shape=list(shape[1:]))


def encode_sample_response(result: SampleResponse, target_layout: dict | None = None) -> bytes:
    """treadle's SampleResponse -> protobuf SampleResponse (prompt logprobs: f32, NaN for None).
    `target_layout`: the CSR indices of a sparse target_prompt_logprobs request, whose answer lists the same cells."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for seq in result.sequences:
        out = msg.sequences.add(stop_reason=_STOP[seq.stop_reason], tokens=np.asarray(seq.tokens, dtype="<i4").tobytes())
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            _encode_topk(out.topk_sampled_logprobs, seq.topk_logprobs)
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if v is None else v for v in result.prompt_logprobs], dtype="<f4").tobytes()
    if result.topk_prompt_logprobs:
        _encode_topk(msg.topk_prompt_logprobs, result.topk_prompt_logprobs)
    if result.target_prompt_logprobs is not None:
        scores = result.target_prompt_logprobs.to_numpy()
        if target_layout is None:
            msg.target_prompt_logprobs.CopyFrom(_dense_tensor(scores))
        else:
            values, crow, col = listed_scores(scores, target_layout)
            msg.target_prompt_logprobs.CopyFrom(pb.Tensor(
                sparse_csr=pb.SparseCsr(values=values.astype("<f4").tobytes(), crow_indices=crow.astype("<i8").tobytes(),
                                        col_indices=col.astype("<i8").tobytes()),
                dtype=pb.DTYPE_FLOAT32, shape=list(scores.shape)))
    if result.prompt_alt_tokens is not None:
        alt = result.prompt_alt_tokens
        msg.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(tokens=_dense_tensor(alt.tokens.to_numpy()),
                                                          logprobs=_dense_tensor(alt.logprobs.to_numpy())))
    return msg.SerializeToString()


def _dense_tensor(array: np.ndarray) -> pb.Tensor:
    """A float32 or int64 array as a dense protobuf Tensor (raw little-endian bytes and its shape)."""
    dtype = pb.DTYPE_INT64 if np.issubdtype(array.dtype, np.integer) else pb.DTYPE_FLOAT32
    raw = np.ascontiguousarray(array, dtype="<i8" if dtype == pb.DTYPE_INT64 else "<f4").tobytes()
    return pb.Tensor(dense=raw, dtype=dtype, shape=list(array.shape))


def _encode_topk(msg: pb.TopkLogprobs, rows: list) -> None:
    """N x K row-major; a missing row (position 0) or a short one is padded with (0, -99999.0)."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), -99999.0, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, logprob
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)
