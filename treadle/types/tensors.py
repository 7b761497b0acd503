"""TensorData: a flat tensor that travels as raw little-endian bytes (`model_dump(context=WIRE)`), never as a pickle."""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any, Literal, Sequence

import numpy as np
from pydantic import Field, PrivateAttr, model_serializer, model_validator

from treadle.types.base import INT64_MAX, INT64_MIN, MAX_TENSOR_DIMS, _Request

DType = Literal["int64", "float32"]
_NP_DTYPES = {"int64": np.dtype("<i8"), "float32": np.dtype("<f4")}

# model_dump(context=WIRE) writes tensors in their compact wire form (raw bytes, base64'd once).
WIRE = {"wire": True}


class TensorData(_Request):
    """A flat tensor with a dtype and an optional shape (Tinker's `TensorData`).

    The values live in a numpy array; `data` (Tinker's list field) is built only when something reads
    it. On the wire a tensor is `{"dtype", "shape", "b64"}`: its raw little-endian bytes, decoded with
    one `np.frombuffer`, so a batch never turns into Python lists between the client and the engine.
    """

    data: list[int] | list[float] = Field(description="Flattened values, row-major (made from the array on first use).")
    dtype: DType = Field(description="`int64` or `float32`.")
    shape: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_TENSOR_DIMS, description="Shape; None means 1-D."
    )
    _array: np.ndarray | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_wire_form(cls, value: Any, handler) -> "TensorData":
        if isinstance(value, dict) and "b64" in value:
            return cls._from_wire_dict(value)
        return handler(value)

    @model_validator(mode="after")
    def _check_shape(self) -> "TensorData":
        if self._array is not None:  # came off the wire: its shape was checked against the bytes
            return self
        if self.shape is not None and math.prod(self.shape) != len(self.data):
            raise ValueError(f"shape {self.shape} holds {math.prod(self.shape)} values but data has {len(self.data)}")
        if self.dtype == "int64":  # numpy would raise a bare OverflowError later, far from the field
            j = next((j for j, v in enumerate(self.data) if not INT64_MIN <= v <= INT64_MAX), None)
            if j is not None:
                raise ValueError(f"data[{j}]: {self.data[j]} is outside int64 (-2^63 to 2^63-1)")
        return self

    @model_serializer(mode="wrap")
    def _serialize(self, handler, info):
        if info.context and info.context.get("wire"):
            return self.to_wire()
        self.data  # noqa: B018 - materialise the list before the default serializer reads the fields
        return handler(self)

    def __getattr__(self, name: str) -> Any:
        if name == "data":  # built from the array on first read, then kept
            private = self.__pydantic_private__ or {}
            values = private["_array"].reshape(-1).tolist()
            vars(self)["data"] = values
            return values
        return super().__getattr__(name)  # pyright: ignore[reportAttributeAccessIssue] (pydantic defines it)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorData):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and np.array_equal(self.to_numpy(), other.to_numpy())
        )

    @classmethod
    def _of(cls, array: np.ndarray, dtype: DType, shape: list[int] | None) -> "TensorData":
        tensor = cls.model_construct(dtype=dtype, shape=shape)
        tensor._array = array
        return tensor

    @classmethod
    def _from_wire_dict(cls, wire: dict) -> "TensorData":
        dtype, shape = wire.get("dtype"), wire.get("shape")
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_NP_DTYPES)}")
        if shape is not None and not (
            isinstance(shape, list) and len(shape) <= MAX_TENSOR_DIMS and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise ValueError(f"shape: {shape!r:.80} is not a list of at most {MAX_TENSOR_DIMS} dimensions >= 0")
        try:
            array = np.frombuffer(base64.b64decode(wire["b64"], validate=True), dtype=_NP_DTYPES[dtype])
        except (binascii.Error, ValueError, TypeError) as exc:
            raise ValueError(f"b64: not the raw bytes of a {dtype} tensor ({exc})") from None
        if shape is not None and math.prod(shape) != array.size:
            raise ValueError(f"shape {shape} holds {math.prod(shape)} values but the bytes hold {array.size}")
        return cls._of(array, dtype, shape)

    # numpy / torch / lists
    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorData":
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        # A copy: the caller may keep writing into its array after handing it over.
        return cls._of(np.array(array, dtype=_NP_DTYPES[dtype], copy=True), dtype, list(array.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> "TensorData":
        return cls.from_numpy(tensor.detach().cpu().numpy())

    @classmethod
    def from_list(cls, values: Sequence[Any], dtype: DType | None = None) -> "TensorData":
        if dtype is None:
            dtype = (
                "int64"
                if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
                else "float32"
            )
        try:
            array = np.asarray(values, dtype=_NP_DTYPES[dtype])
        except OverflowError:  # a ValueError, so a validator reports it as the field's error
            bad = next((v for v in values if not INT64_MIN <= v <= INT64_MAX), None)
            raise ValueError(f"{bad} is outside int64 (-2^63 to 2^63-1)") from None
        return cls.from_numpy(array)

    def to_numpy(self) -> np.ndarray:
        """The values as an array of `shape` (read-only when it came off the wire)."""
        if self._array is None:
            self._array = np.asarray(self.data, dtype=_NP_DTYPES[self.dtype])
        return self._array.reshape(self.shape) if self.shape is not None else self._array.reshape(-1)

    def to_torch(self) -> Any:
        import torch

        return torch.from_numpy(self.to_numpy().copy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def to_wire(self) -> dict:
        raw = np.ascontiguousarray(self.to_numpy(), dtype=_NP_DTYPES[self.dtype]).tobytes()
        return {"dtype": self.dtype, "shape": self.shape, "b64": base64.b64encode(raw).decode("ascii")}
