"""Elementwise family: `add` (with broadcasting) and `swiglu` (clamped SwiGLU of the experts).

Any operand may be a strided or broadcast view: each element's offset comes from its 4-D index and the
operand's element strides (0 on broadcast axes). Math in fp32; the result is rounded where the reference
rounds (swiglu in bf16 rounds silu's output before the product, as torch does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, dims4, pad4, ptr, unaligned
from .pdl import pdl_enter

BLOCK = 1024


@triton.jit
def _offsets(idx, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
             S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr):
    i3 = idx % D3
    i2 = (idx // D3) % D2
    i1 = (idx // (D3 * D2)) % D1
    i0 = idx // (D3 * D2 * D1)
    return i0.to(tl.int64) * S0 + i1 * S1 + i2 * S2 + i3 * S3


@triton.jit
def binary_kernel(a_ptr, b_ptr, y_ptr, NUMEL: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                  A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
                  B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,
                  Y0: tl.constexpr, Y1: tl.constexpr, Y2: tl.constexpr, Y3: tl.constexpr,
                  OP: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < NUMEL
    a = tl.load(a_ptr + _offsets(idx, D1, D2, D3, A0, A1, A2, A3), mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + _offsets(idx, D1, D2, D3, B0, B1, B2, B3), mask=ok, other=0.0).to(tl.float32)
    if OP == "add":
        y = a + b
    else:
        g = tl.minimum(a, LIMIT)
        u = tl.minimum(tl.maximum(b, -LIMIT), LIMIT)
        s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = s * u
    tl.store(y_ptr + _offsets(idx, D1, D2, D3, Y0, Y1, Y2, Y3), y.to(y_ptr.dtype.element_ty), mask=ok)


def binary_call(op: str, a: TensorArg, b: TensorArg, y: TensorArg, names: tuple[str, str, str], limit: float = 0.0
                ) -> KernelCall:
    shape = y.shape
    d = pad4(shape)
    ce = dict(NUMEL=y.type.numel, D1=d[1], D2=d[2], D3=d[3])
    for p, t in (("A", a), ("B", b), ("Y", y)):
        for i, s in enumerate(dims4(t, shape)):
            ce[f"{p}{i}"] = s
    ce.update(OP=op, LIMIT=float(limit), BLOCK=BLOCK)
    pointers = [ptr("a_ptr", "operand", names[0], a), ptr("b_ptr", "operand", names[1], b),
                ptr("y_ptr", "result", names[2], y)]
    return KernelCall(call_name(f"ew_{op}", ce, "x".join(map(str, shape)) + f"_{y.dtype}"), binary_kernel, ce,
                      pointers, (triton.cdiv(max(y.type.numel, 1), BLOCK), 1, 1), num_warps=4,
                      unaligned=unaligned({"a_ptr": a, "b_ptr": b, "y_ptr": y}),
                      bytes_moved=a.type.nbytes + b.type.nbytes + y.type.nbytes)


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name == "add":
        return [binary_call("add", operands["a"], operands["b"], results["y"], ("a", "b", "y"))]
    if op_name == "swiglu":
        return [binary_call("swiglu", operands["gate"], operands["up"], results["y"], ("gate", "up", "y"),
                            attrs["limit"])]
    raise KeyError(f"elementwise family has no op '{op_name}'")
