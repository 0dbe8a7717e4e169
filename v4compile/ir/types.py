"""IR value types: a static shape and one of a small set of dtypes.

Torch is imported only when a torch dtype is asked for (`DTYPES[name]`), so that reading, printing and
verifying IR does not load it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_NAMES = ("fp32", "bf16", "fp8e4m3", "e8m0", "fp4x2", "i32", "i64", "bool")
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp8e4m3": "float8_e4m3fn", "e8m0": "float8_e8m0fnu",
                "fp4x2": "int8", "i32": "int32", "i64": "int64", "bool": "bool"}


class _TorchDtypes(Mapping):
    """IR dtype name -> torch dtype. `fp4x2` is two e2m1 values per byte (stored as int8); `e8m0` is a
    power-of-two scale byte."""

    def __getitem__(self, name: str) -> Any:
        import torch

        return getattr(torch, _TORCH_NAMES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_NAMES)

    def __len__(self) -> int:
        return len(DTYPE_NAMES)

    def __contains__(self, name: object) -> bool:
        return name in _TORCH_NAMES


DTYPES = _TorchDtypes()
BYTES = {"fp32": 4, "bf16": 2, "fp8e4m3": 1, "e8m0": 1, "fp4x2": 1, "i32": 4, "i64": 8, "bool": 1}
FLOAT_DTYPES = ("fp32", "bf16")
INT_DTYPES = ("i32", "i64")


def dtype_of(t: Any) -> str:
    import torch

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

    def matches(self, t: Any) -> bool:
        import torch

        return tuple(t.shape) == self.shape and (DTYPES[self.dtype] == t.dtype or
                                                 (self.dtype == "e8m0" and t.dtype == torch.uint8))


def T(dtype: str, *shape: int) -> TensorType:
    return TensorType(tuple(int(s) for s in shape), dtype)
