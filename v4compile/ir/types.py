"""IR value types: a static shape and one of a small set of dtypes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# IR dtype name -> torch dtype. `fp4x2` is two e2m1 values per byte (stored as int8); `e8m0` is a
# power-of-two scale byte.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8e4m3": torch.float8_e4m3fn,
    "e8m0": torch.float8_e8m0fnu,
    "fp4x2": torch.int8,
    "i32": torch.int32,
    "i64": torch.int64,
    "bool": torch.bool,
}
BYTES = {"fp32": 4, "bf16": 2, "fp8e4m3": 1, "e8m0": 1, "fp4x2": 1, "i32": 4, "i64": 8, "bool": 1}
FLOAT_DTYPES = ("fp32", "bf16")
INT_DTYPES = ("i32", "i64")


def dtype_of(t: torch.Tensor) -> str:
    for name, dt in DTYPES.items():
        if t.dtype == dt and name != "fp4x2":
            return name
    if t.dtype == torch.uint8:
        return "e8m0"
    raise TypeError(f"no IR dtype for torch dtype {t.dtype}")


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown IR dtype {self.dtype!r}")
        if not all(isinstance(s, int) and s >= 0 for s in self.shape):
            raise ValueError(f"shape must be non-negative ints, got {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * BYTES[self.dtype]

    def with_shape(self, *shape: int) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    def matches(self, t: torch.Tensor) -> bool:
        return tuple(t.shape) == self.shape and (DTYPES[self.dtype] == t.dtype or
                                                 (self.dtype == "e8m0" and t.dtype == torch.uint8))


def T(dtype: str, *shape: int) -> TensorType:
    return TensorType(tuple(int(s) for s in shape), dtype)
