"""Element types as the kernels and torch see them: Triton pointer types, IR dtypes, their sizes."""

from __future__ import annotations

import torch

from ...ir.types import dtype_of

# Triton pointer element type -> the torch dtype a tensor is viewed as before launch (same element size).
TRITON_TORCH: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn,
    "u8": torch.uint8, "i8": torch.int8, "i32": torch.int32, "i64": torch.int64, "i1": torch.bool,
}
# IR dtype -> the Triton element type kernels read it as. e8m0 scale bytes and packed fp4 pairs are bytes.
IR_TRITON: dict[str, str] = {
    "fp32": "fp32", "bf16": "bf16", "fp8e4m3": "fp8e4nv", "e8m0": "u8", "fp4x2": "u8", "i32": "i32", "i64": "i64",
    "bool": "i1",
}
BYTES_OF = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8e4nv": 1, "u8": 1, "i8": 1, "i32": 4, "i64": 8, "i1": 1}


def typed_from(raw: torch.Tensor, ty: str) -> torch.Tensor:
    """Bytes from a kernel pointer on (1-D uint8) as the 1-D tensor of its pointer type `ty` ("*bf16")."""
    n = BYTES_OF[ty[1:]]
    return raw[: raw.numel() // n * n].view(TRITON_TORCH[ty[1:]])


def ir_dtype(t: torch.Tensor) -> str:
    """The IR dtype of a tensor (int8: packed fp4 pairs; e8m0: scale bytes)."""
    if t.dtype == torch.int8:
        return "fp4x2"
    if t.dtype == torch.float8_e8m0fnu:
        return "e8m0"
    return dtype_of(t)
