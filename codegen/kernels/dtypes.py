"""Element types as the kernels and torch see them: Triton pointer types, IR dtypes, their sizes.

torch is imported by the functions that take tensors, not here: the AOT worker (codegen/aot.py) imports every
kernel family to compile it and never needs torch (~1.6 CPU s a worker)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ...ir.types import dtype_of

if TYPE_CHECKING:
    import torch

# IR dtype -> the Triton element type kernels read it as. e8m0 scale bytes and packed fp4 pairs are bytes.
IR_TRITON: dict[str, str] = {
    "fp32": "fp32", "bf16": "bf16", "fp8e4m3": "fp8e4nv", "e8m0": "u8", "fp4x2": "u8", "i32": "i32", "i64": "i64",
    "bool": "i1",
}
BYTES_OF = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8e4nv": 1, "u8": 1, "i8": 1, "i32": 4, "i64": 8, "i1": 1}


@functools.lru_cache(maxsize=None)
def torch_dtype(ty: str) -> torch.dtype:
    """The torch dtype a tensor of Triton element type `ty` ("bf16") is viewed as before launch (same element
    size)."""
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn,
            "u8": torch.uint8, "i8": torch.int8, "i32": torch.int32, "i64": torch.int64, "i1": torch.bool}[ty]


def typed_from(raw: torch.Tensor, ty: str) -> torch.Tensor:
    """Bytes from a kernel pointer on (1-D uint8) as the 1-D tensor of its pointer type `ty` ("*bf16")."""
    n = BYTES_OF[ty[1:]]
    return raw[: raw.numel() // n * n].view(torch_dtype(ty[1:]))


def ir_dtype(t: torch.Tensor) -> str:
    """The IR dtype of a tensor (int8: packed fp4 pairs; e8m0: scale bytes)."""
    import torch
    if t.dtype == torch.int8:
        return "fp4x2"
    if t.dtype == torch.float8_e8m0fnu:
        return "e8m0"
    return dtype_of(t)
