"""ONNX lowerings (the `cpu` target), one module per kernel family, wired as the Triton kernels are
(`codegen/kernels`): an op's lowering is `lower_<op>` in `v4compile.codegen.onnx.<family>`, the family the
op names with `defop(kernel=...)` (`common` for ops without one: views, `rope`, the QAT roundings).

    lower_<op>(g, o, a, r) -> result or results

`g` is the graph being built (`graph.Graph`), `o` the operands by name (ONNX tensor names,
`Planes`, `RowList` or None; their IR types in `o.types`), `a` the attributes and `r` the IR result types.
A use of an op the cpu target does not cover raises NotImplementedError (one clear IRError at export).
A family module also holds the graph helpers only its lowerings use (`mhc.hc_pre`, `compress.compress`, ...);
the ones several families share are functions of the graph (`f(g, ...)`) in a module of their topic, called
through it (`quant.act_qdq(g, ...)`, so a test can patch one for every caller): `quant` (FP8 / FP4 rounding),
`rotary` (RoPE tables and rotation), `pool_rows` (pool planes' rows: addressing, reads, writes), `linear`
(weights read dense, GEMMs against them). `Graph` keeps only the ONNX primitives and shorthands; a module
here never imports the export driver (`codegen/onnx_export.py`), which dispatches into it.
"""

from __future__ import annotations

from collections.abc import Callable

from ...ir.types import TensorType
from .. import family_module
from . import quant

COMMON = "common"


def lowering(opdef) -> Callable | None:
    """The op's ONNX lowering, or None if its family has none."""
    module = family_module("onnx", opdef.kernel or COMMON)
    return getattr(module, f"lower_{opdef.name}", None) if module is not None else None


def gemm_input(g, what: str, a: dict, x: str, xt: TensorType) -> str:
    """The ONNX lowerings compute GEMMs in fp32: the activation as it is (act native) or as the FP8 GEMM
    sees it (act fp8: `formats.act_qdq`, 128-wide K blocks), times the weight dequantised to fp32; a bf16
    result is rounded once (the op's result, `onnx_export.lower_function`), as torch's bf16 GEMM does.
    FP8 activations of a bf16 activation are refused: the e4m3 grid's midpoints are bf16 values, so the
    quantiser flips on any last-bit difference from the reference's bf16 arithmetic upstream."""
    act = a.get("act", "native")
    if xt.dtype not in ("fp32", "bf16") or a.get("out_dtype", "") not in ("", "fp32", "bf16") or \
            (act == "fp8" and xt.dtype == "bf16"):
        raise NotImplementedError(f"{what} on {xt.dtype} act={act!r} out_dtype={a.get('out_dtype')!r} "
                                  "(cpu: fp32, or bf16 with native activations)")
    return quant.act_qdq(g, x, xt) if act == "fp8" else x


def native_only(a, o) -> None:
    """The ONNX lowerings store and read native planes (the `cpu` pipeline's pool format)."""
    if a["fmt"] != "native" or o.p1 is not None:
        raise NotImplementedError(f"pool format '{a['fmt']}' has no ONNX lowering (the cpu pipeline uses native)")
