"""inv_rope_quant family: `inv_rope_group_quant` — the inverse interleaved RoPE of the attention output's
last `dim` channels of every head, then (fmt="fp8") the activation quantisation feeding `wo_a`: one UE8M0
scale per `group` values of the flattened heads, q = e4m3(clamp(y / s)).

The rotation is `rotary.inverse_rope` (bit for bit the reference's angles). Grid: (tokens, chunks of the
flattened heads, each a whole number of quantisation groups).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, unaligned
from .gemm import FP8_MAX, _pow2_ceil
from .pdl import pdl_enter
from .rotary import inverse_rope, rope_constants


@triton.jit
def inv_rope_quant_kernel(x_ptr, pos_ptr, y_ptr, s_ptr,
                          T: tl.constexpr, HD: tl.constexpr, D: tl.constexpr, DIM: tl.constexpr,
                          X_BS: tl.constexpr, X_TS: tl.constexpr, X_HS: tl.constexpr,
                          Y_BS: tl.constexpr, Y_TS: tl.constexpr, Y_HS: tl.constexpr,
                          P_BS: tl.constexpr, P_TS: tl.constexpr, S_BS: tl.constexpr, S_TS: tl.constexpr,
                          FREQS: tl.constexpr, SIGN: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    b = row // T
    t = row % T
    f = tl.program_id(1) * (NG * GROUP) + tl.arange(0, NG * GROUP)
    ok = f < HD
    h = f // D
    c = f % D
    xrow = x_ptr + b.to(tl.int64) * X_BS + t * X_TS
    x = tl.load(xrow + h * X_HS + c, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(xrow + h * X_HS + (c ^ 1), mask=ok, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + b * P_BS + t * P_TS).to(tl.float32)
    y = inverse_rope(x, partner, c, pos, D, DIM, FREQS, SIGN, x_ptr.dtype.element_ty)
    yrow = y_ptr + b.to(tl.int64) * Y_BS + t * Y_TS + h * Y_HS + c
    if s_ptr is None:
        tl.store(yrow, y, mask=ok)
    else:
        yg = tl.reshape(y.to(tl.float32), [NG, GROUP])
        s = _pow2_ceil(tl.maximum(tl.max(tl.abs(yg), axis=1), 1e-4) / FP8_MAX)
        inv = ((254 << 23) - s.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        q = tl.minimum(tl.maximum(yg * inv[:, None], -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
        tl.store(yrow, tl.reshape(q, [NG * GROUP]), mask=ok)
        gi = tl.program_id(1) * NG + tl.arange(0, NG)
        tl.store(s_ptr + b.to(tl.int64) * S_BS + t * S_TS + gi, s, mask=gi < HD // GROUP)


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "inv_rope_group_quant":
        raise KeyError(f"inv_rope_quant family has no op '{op_name}'")
    x, pos, y, s = operands["x"], operands["pos"], results["y"], results.get("scale")
    if x.type.rank != 4 or x.strides[-1] != 1 or y.strides[-1] != 1:
        raise ValueError(f"inv_rope_group_quant: x must be [B, T, H, d] with contiguous heads, got {x.shape} {x.strides}")
    B, T, H, D = x.shape
    group = attrs["group"]
    HD = H * D
    fmt = attrs.get("fmt", "none")
    if fmt == "fp8" and (HD % group or group & (group - 1)):
        raise ValueError(f"inv_rope_group_quant: groups of {group} must tile H*d = {HD}")
    G = group if fmt == "fp8" else 128
    NG = max(1, min(8, triton.next_power_of_2(triton.cdiv(HD, G))))
    ce = dict(T=T, HD=HD, D=D, X_BS=x.strides[0], X_TS=x.strides[1], X_HS=x.strides[2],
              Y_BS=y.strides[0], Y_TS=y.strides[1], Y_HS=y.strides[2], P_BS=pos.strides[0], P_TS=pos.strides[1],
              S_BS=s.strides[0] if s is not None else 0, S_TS=s.strides[1] if s is not None else 0,
              GROUP=G, NG=NG, **rope_constants(attrs))
    pointers = [ptr("x_ptr", "operand", "x", x), ptr("pos_ptr", "operand", "pos", pos), ptr("y_ptr", "result", "y", y)]
    if fmt == "fp8":
        pointers.append(ptr("s_ptr", "result", "scale", s))
    else:
        ce["s_ptr"] = None
    return [KernelCall(call_name("inv_rope_quant", ce, f"b{B}_t{T}_h{H}_d{D}_{fmt}_{x.dtype}"), inv_rope_quant_kernel,
                       ce, pointers, (B * T, triton.cdiv(HD, NG * G), 1), num_warps=4,
                       unaligned=unaligned({"x_ptr": x, "pos_ptr": pos, "y_ptr": y, "s_ptr": s}),
                       bytes_moved=x.type.nbytes + y.type.nbytes + (s.type.nbytes if s is not None else 0))]
