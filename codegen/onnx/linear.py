"""Weights as the cpu target's graphs read them: dense fp32, the stored tensor itself or one the runtime
derives from it once at load (an expert of a stacked weight, a quantised or bf16 weight as fp32:
`codegen/onnx_weights.py`), and `linear`, the GEMM against one."""

from __future__ import annotations

from ...errors import IRError
from ...ir.types import TensorType


def weight(g, w: str, wt: TensorType, scale: str | None = None, block: int | None = None,
           index: int | None = None) -> tuple[str, TensorType]:
    """The graph input that holds weight `w` (expert `index` of it) as dense fp32, and its type: `w`
    itself, or a tensor the runtime derives from it once at load (`onnx_weights`)."""
    from ..onnx_weights import QUANTISED, derived_name, entry

    if wt.dtype not in ("fp32", "bf16", *QUANTISED) or (scale is None) != (wt.dtype not in QUANTISED):
        raise IRError("the ONNX (cpu) target takes fp32, bf16, FP8 or FP4 weights (scaled iff quantised)",
                      found=f"{wt.dtype}{' with' if scale else ' without'} a scale")
    if index is None and wt.dtype == "fp32":
        return w, wt
    name = derived_name(w, index, wt.dtype != "fp32")
    if name not in g.derived:
        g.derived[name] = entry(w, wt.dtype, wt.shape, index, scale, block)
    return name, TensorType(tuple(g.derived[name]["shape"]), "fp32")


def linear(g, x: str, xt: TensorType, w: str, wt: TensorType, scale: str | None = None,
           block: int | None = None) -> str:
    """`x W^T` for a 2-D weight `[out, in]` (dense fp32 as the graph sees it): one Gemm over the
    flattened rows."""
    w, wt = weight(g, w, wt, scale, block)
    if xt.rank == 2:
        return g.op("Gemm", x, w, transB=1)
    if wt.numel < 65536:  # small weights: one node, no reshapes
        return g.matmul_t(x, w)
    # large weights: Gemm, whose constant B ONNX Runtime pre-packs once (transposed B included)
    y = g.op("Gemm", g.reshape(x, (-1, xt.shape[-1])), w, transB=1)
    return g.reshape(y, (*xt.shape[:-1], wt.shape[0]))
