"""Protobuf in and out, with the message definitions the `tinker` package ships (`tinker_public_pb2`).

SDK 0.38 sends every forward_backward as a protobuf `ForwardBackwardRequest` and accepts
`ForwardBackwardOutput` and `SampleResponse` results only as protobuf. Tensors on both sides are raw
little-endian bytes, which is also treadle's own tensor wire format (`TensorData.to_wire`), so dense
tensors become arrays with one `np.frombuffer`, never Python lists.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb

from treadle.errors import InvalidRequestError
from treadle.gateway.sample_targets import listed_scores
from treadle.queue.ops import ForwardBackwardRequest, ForwardRequest
from treadle.types import (
    MAX_TENSOR_DIMS,
    MAX_TENSOR_VALUES,
    MAX_TOKENS_PER_SEQUENCE,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageChunk,
    ModelInput,
    SampleResponse,
    TensorData,
)

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


def forward_backward_request(
    msg: pb.ForwardBackwardRequest, data: list[Datum] | None = None, loss_aliases: dict[str, str] | None = None
) -> ForwardRequest:
    """treadle's typed forward (forward_only) or forward_backward request; tensors stay arrays.
    `loss_aliases` (the gateway's --loss_alias) serves an unserved loss name as the loss it maps to."""
    cls = ForwardRequest if msg.forward_only else ForwardBackwardRequest
    loss_fn, config = msg.loss_fn, _loss_config(msg) or None
    if loss_fn in (loss_aliases or {}):
        if config:  # the unserved loss's own parameters mean nothing to the loss that stands in for it
            raise InvalidRequestError(
                f"loss_fn_config: {sorted(config)} given for {loss_fn}, which this gateway serves as "
                f"{loss_aliases[loss_fn]} (--loss_alias); send no loss_fn_config, or pass loss_fn={loss_aliases[loss_fn]} with its own"
            )
        loss_fn = loss_aliases[loss_fn]
    return cls.build(data=decode_data(msg) if data is None else data, loss_fn=loss_fn, loss_fn_config=config)


def decode_data(msg: pb.ForwardBackwardRequest) -> list[Datum]:
    """The batch as treadle's Datums; a token, shape or sparse index the message cannot mean is an
    InvalidRequestError naming it (never a numpy error, which would be a 500)."""
    # Sparse tensors are the one place a small body becomes a large allocation: bound them all together.
    sparse = sum(
        math.prod(abs(d) for d in t.shape)
        for d in msg.data
        for t in d.loss_fn_inputs.values()
        if t.WhichOneof("encoding") == "sparse_csr"
    )
    if sparse > MAX_TENSOR_VALUES:
        raise InvalidRequestError(
            f"data: its sparse tensors hold {sparse} values once dense; at most {MAX_TENSOR_VALUES} (2^24) per request"
        )
    return [_datum(i, d) for i, d in enumerate(msg.data)]


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict:
    # v2 carries numbers and strings; the legacy map only numbers. The SDK writes both; prefer v2.
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


def _datum(index: int, datum: pb.Datum) -> Datum:
    chunks: list[EncodedTextChunk | ImageChunk] = []
    total = 0
    for c, chunk in enumerate(datum.model_input):
        field = f"data[{index}].model_input.chunks[{c}]"
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            tokens = _tokens(f"{field}.tokens", chunk.encoded_text.tokens)
            total += len(tokens)
            chunks.append(EncodedTextChunk.model_construct(tokens=tokens.tolist()))
        elif kind == "image":
            chunks.append(_image(field, chunk.image))
        else:
            raise InvalidRequestError(f"{field}: {kind} chunks are not supported; only encoded_text and image")
    if total > MAX_TOKENS_PER_SEQUENCE:
        raise InvalidRequestError(
            f"data[{index}].model_input: {total} tokens; at most {MAX_TOKENS_PER_SEQUENCE} (2^20)"
        )
    inputs = {name: _tensor(f"data[{index}].loss_fn_inputs.{name}", t) for name, t in datum.loss_fn_inputs.items()}
    try:
        return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs)
    except ValidationError as exc:  # a bound of the wire types (the number of loss inputs, ...)
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequestError(f"data[{index}].{where}: {err['msg']} (got {err.get('input')!r:.80})") from None


def _image(field: str, image: pb.ImageChunk) -> ImageChunk:
    """An image chunk as sent: its bytes, format and expected_tokens; the worker decodes and counts it."""
    if image.HasField("override_dimensions"):
        raise InvalidRequestError(f"{field}.override_dimensions: not supported; send the image at the size to use")
    try:
        return ImageChunk(
            data=image.data,
            format=image.format,  # type: ignore[arg-type]  # checked here: png or jpeg
            expected_tokens=image.expected_tokens if image.HasField("expected_tokens") else None,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequestError(f"{field}.{where}: {err['msg']} (got {err.get('input')!r:.80})") from None


def _tokens(field: str, raw: bytes) -> np.ndarray:
    ids = _array(field, raw, np.dtype("<i4"))
    bad = np.flatnonzero(ids < 0)  # int32 holds no id above 2^31-1: only negatives are out of range
    if bad.size:
        j = int(bad[0])
        raise InvalidRequestError(f"{field}[{j}]: {int(ids[j])} is not a token id; token ids are 0 to 2^31-1")
    return ids


def _array(field: str, raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidRequestError(f"{field}: {len(raw)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(field: str, tensor: pb.Tensor) -> TensorData:
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:  # proto3 enums are open: an unknown number has no name
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else tensor.dtype
        raise InvalidRequestError(f"{field}: dtype {name} is not supported; use float32 or int64")
    shape = _shape(field, list(tensor.shape)) or None
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raw = _densify_csr(field, tensor.sparse_csr, dtype, shape)
    else:
        raw = tensor.dense
    array = _array(field, raw, _NP[dtype])
    if shape is not None and math.prod(shape) != array.size:
        raise InvalidRequestError(
            f"{field}: shape {shape} holds {math.prod(shape)} values but the tensor has {array.size}"
        )
    return TensorData.from_numpy(array.reshape(shape) if shape is not None else array)


def _shape(field: str, shape: list[int]) -> list[int]:
    if len(shape) > MAX_TENSOR_DIMS:
        raise InvalidRequestError(f"{field}.shape: {len(shape)} dimensions; at most {MAX_TENSOR_DIMS}")
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"{field}.shape: {shape} has a negative dimension; dimensions are >= 0")
    if math.prod(shape) > MAX_TENSOR_VALUES:
        raise InvalidRequestError(
            f"{field}.shape: {shape} holds {math.prod(shape)} values; at most {MAX_TENSOR_VALUES} (2^24)"
        )
    return shape


def _densify_csr(field: str, csr: pb.SparseCsr, dtype: str, shape: list[int] | None) -> bytes:
    if shape is None or len(shape) != 2:
        raise InvalidRequestError(f"{field}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    rows, width = shape
    values = _array(f"{field}.sparse_csr.values", csr.values, _NP[dtype])
    crow = _array(f"{field}.sparse_csr.crow_indices", csr.crow_indices, np.dtype("<i8"))
    cols = _array(f"{field}.sparse_csr.col_indices", csr.col_indices, np.dtype("<i8"))
    # Offsets within [0, nnz] first, so their differences cannot overflow.
    if (
        crow.size != rows + 1
        or crow[0] != 0
        or crow[-1] != values.size
        or np.any((crow < 0) | (crow > values.size))
        or np.any(np.diff(crow) < 0)
    ):
        raise InvalidRequestError(
            f"{field}.sparse_csr.crow_indices: {crow.tolist()!s:.80}; {rows} rows need {rows + 1} "
            f"non-decreasing offsets from 0 to the {values.size} values"
        )
    if cols.size != values.size:
        raise InvalidRequestError(f"{field}.sparse_csr.col_indices: {cols.size} indices for {values.size} values")
    bad = np.flatnonzero((cols < 0) | (cols >= width))
    if bad.size:
        j = int(bad[0])
        raise InvalidRequestError(
            f"{field}.sparse_csr.col_indices[{j}]: {int(cols[j])} is outside 0 to {width - 1} (shape {shape})"
        )
    dense = np.zeros(shape, dtype=_NP[dtype])
    dense[np.repeat(np.arange(rows), np.diff(crow)), cols] = values
    return dense.tobytes()


# ---------------------------------------------------------------- results


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """treadle's forward/forward_backward output -> protobuf ForwardBackwardOutput (one ArrayRecord)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    # A record's tensors share one trailing shape: `(N,)` logprobs and a top-k cross_entropy's `(N, K)` ones
    # go in records of their own, one per run of datums alike (the SDK reads every record, in order).
    for _, run in itertools.groupby(out.loss_fn_outputs, key=_trailing_shapes):
        outputs = list(run)
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            record.fields[name].CopyFrom(_batched([o[name] for o in outputs]))
    return msg.SerializeToString()


def _trailing_shapes(output: dict[str, TensorData]) -> tuple:
    return tuple((name, tuple((t.shape or [])[1:])) for name, t in output.items())


def _batched(tensors: list[TensorData]) -> pb.BatchedTensor:
    """Per-datum tensors concatenated, with n+1 byte offsets; the leading dimension is each datum's own."""
    blobs = [np.ascontiguousarray(t.to_numpy(), dtype=_NP[t.dtype]).tobytes() for t in tensors]
    offsets = np.cumsum([0] + [len(b) for b in blobs], dtype="<i8")
    shape = tensors[0].shape or []
    dtype = pb.DTYPE_INT64 if tensors[0].dtype == "int64" else pb.DTYPE_FLOAT32
    return pb.BatchedTensor(
        data=b"".join(blobs), offsets=offsets.tobytes(), dtype=dtype, trailing_shape=list(shape[1:])
    )


def encode_sample_response(result: SampleResponse, target_layout: dict | None = None) -> bytes:
    """treadle's SampleResponse -> protobuf SampleResponse (prompt logprobs: f32, NaN for None).
    `target_layout`: the CSR indices of a sparse target_prompt_logprobs request, whose answer lists the same cells."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for seq in result.sequences:
        out = msg.sequences.add(
            stop_reason=_STOP[seq.stop_reason], tokens=np.asarray(seq.tokens, dtype="<i4").tobytes()
        )
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            _encode_topk(out.topk_sampled_logprobs, seq.topk_logprobs)
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(
            [math.nan if v is None else v for v in result.prompt_logprobs], dtype="<f4"
        ).tobytes()
    if result.topk_prompt_logprobs:
        _encode_topk(msg.topk_prompt_logprobs, result.topk_prompt_logprobs)
    if result.target_prompt_logprobs is not None:
        scores = result.target_prompt_logprobs.to_numpy()
        if target_layout is None:
            msg.target_prompt_logprobs.CopyFrom(_dense_tensor(scores))
        else:
            values, crow, col = listed_scores(scores, target_layout)
            msg.target_prompt_logprobs.CopyFrom(
                pb.Tensor(
                    sparse_csr=pb.SparseCsr(
                        values=values.astype("<f4").tobytes(),
                        crow_indices=crow.astype("<i8").tobytes(),
                        col_indices=col.astype("<i8").tobytes(),
                    ),
                    dtype=pb.DTYPE_FLOAT32,
                    shape=list(scores.shape),
                )
            )
    if result.prompt_alt_tokens is not None:
        alt = result.prompt_alt_tokens
        msg.prompt_alt_tokens.CopyFrom(
            pb.PromptAltTokens(
                tokens=_dense_tensor(alt.tokens.to_numpy()), logprobs=_dense_tensor(alt.logprobs.to_numpy())
            )
        )
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
