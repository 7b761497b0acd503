"""`target_prompt_logprobs` in and out: the SDK's ids tensor (dense or sparse CSR, -1 = none) as the dense
matrix the worker scores, and the scores back in the request's own layout.

The SDK's cookbook sends it sparse (`TensorData.from_torch_sparse(ids, pad_value=-1)`: one row of
choice ids among many empty ones), and `SampleResponse.target_prompt_logprobs` has "the same shape and
layout" as the request, so the gateway keeps the request's CSR indices with the future and answers
with the scores of exactly the cells listed.
"""

from __future__ import annotations

import numpy as np
from tinker.types._pydantic_types.tensor_data import TensorData as TinkerTensorData

from treadle.errors import InvalidRequestError
from treadle.queue.sample_options import target_shape_error
from treadle.types import TensorData

FIELD = "target_prompt_logprobs"


def dense_target_ids(target: TinkerTensorData, rows: int) -> tuple[TensorData, dict | None]:
    """The ids as a dense int64 [rows, K] tensor (-1 where a sparse request lists nothing), and the
    request's CSR layout ({"crow", "col"}) when it was sparse. The shape is checked before anything is
    allocated; ops.SampleRequest checks the ids."""
    if (problem := target_shape_error(target.dtype, target.shape, rows)) is not None:
        raise InvalidRequestError(problem)
    shape = target.shape
    if len(target.data) > shape[0] * shape[1]:  # bounded before any per-value work
        raise InvalidRequestError(f"{FIELD}: {len(target.data)} values for shape {shape}")
    # A float, or an int past int64 (numpy would raise a bare OverflowError), is never a token id.
    if (bad := next((v for v in target.data if type(v) is not int or not -1 <= v < 2**63), None)) is not None:
        raise InvalidRequestError(f"{FIELD}: {bad!r:.40} is not a token id or -1")
    values = np.asarray(target.data, dtype=np.int64)
    if target.sparse_crow_indices is None:
        if values.size != shape[0] * shape[1]:
            raise InvalidRequestError(
                f"{FIELD}: shape {shape} holds {shape[0] * shape[1]} values but data has {values.size}"
            )
        return TensorData.from_numpy(values.reshape(shape)), None
    crow = np.asarray(target.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(target.sparse_col_indices or [], dtype=np.int64)
    if (
        crow.size != rows + 1
        or crow[0] != 0
        or (np.diff(crow) < 0).any()
        or crow[-1] != col.size
        or values.size != col.size
        or ((col < 0) | (col >= shape[1])).any()
    ):
        raise InvalidRequestError(
            f"{FIELD}: not a valid sparse CSR tensor of shape {shape} "
            f"({crow.size} row pointers, {col.size} column indices, {values.size} values)"
        )
    dense = np.full(shape, -1, dtype=np.int64)
    dense[_rows_of(crow), col] = values
    return TensorData.from_numpy(dense), {"crow": crow.tolist(), "col": col.tolist()}


def listed_scores(scores: np.ndarray, layout: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, crow, col): the scores of the cells a sparse request listed, in its CSR order."""
    crow, col = np.asarray(layout["crow"], dtype=np.int64), np.asarray(layout["col"], dtype=np.int64)
    return scores[_rows_of(crow), col], crow, col


def _rows_of(crow: np.ndarray) -> np.ndarray:
    """The row of each stored value of a CSR matrix."""
    return np.repeat(np.arange(crow.size - 1), np.diff(crow))
