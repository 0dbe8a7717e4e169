"""Run the attention's first GEMMs and the norm GEMM that reads one of their outputs as one launch:
`linear_pair(x) -> y0, y1` (or one `linear(x) -> y0` of a weight) and the `norm_linear` of (a `split` column
range of) y0 or y1 become one `pair_norm_linear`. V4: the merged `wqkv_a` (+ the compressor / indexer
`x_gemm`) and q_norm + the merged `wq_b` (the q_a columns of `wqkv_a`): one launch fewer per layer. (With
dense weights every GEMM of the attention input stacks into one `linear`: the same fusion, without y1.)

Requires: `pair_sibling_gemms` (the `linear_pair`) and `fuse_norm_linear` (the `norm_linear`) have run; a
`norm_linear` whose input is a `linear_pair` result, or a weight `linear`'s, or a column range of one through
`split`s (the merged GEMM's views), in the same layer.
Guarantees: the pair (or linear) becomes one `pair_norm_linear` in its place (the first GEMMs' operands then
the norm GEMM's, both attribute sets (a linear's as the pair's first side), `src` / `col` naming the columns
the norm GEMM reads, the first GEMMs' layer tag, roles joined), its results their values and the
`norm_linear`'s (names kept); the `norm_linear` is absorbed; the `split`s stay (other ops read their views).
Its kernel runs the norm GEMM as the phase after the programs that write y<src>
(`codegen/kernels/attn_front.py`). Numerics bit-identical (the
reference is the composition). Both functions (prefill's launch is the same kernel).
Partitioned modules (`--ep`, `--tp`, `--dp`): the seam after the MoE reads the collective's output
(`mhc_post_pre_add`, from `fuse_moe_mhc`), so no MoE launch can take it; where the x it returns has one user,
the next attention's `pair_norm_linear`, the two become one `mhc_add_pair_norm_linear` in the front's place (the
seam's operands, its fn / base / scale / norm and attributes as `in_*`, then the front's), its results the
seam's streams / post / comb and the front's (names kept); x never leaves the op, whose kernel runs the seam as
the launch's first phase. Numerics bit-identical (the reference is the composition). Hits `<func>.seam`, a key
present only where it fired (single-device modules keep their hits as they were).
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import WEIGHT, Function
from v4compile.ir.registry import get_op

from .base import function_pass
from .fuse_mhc_moe import seam_before
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of


def pair_columns(rw: Rewrite, v) -> tuple[object, int, int] | None:
    """(the `linear_pair` or weight `linear` op, which of its results, the first column) that value `v` is,
    through `split`s."""
    col = 0
    op = rw.producer(v)
    while op is not None and op.name == "split":
        col += 0 if v is op.results[0] else op.attrs["at"]
        v = op.operand("x")
        op = rw.producer(v)
    if op is None or op.name not in ("linear_pair", "linear"):
        return None
    if op.operand("w0" if op.name == "linear_pair" else "w").kind != WEIGHT:
        return None
    return op, list(op.results).index(v), col


def first_gemms(op) -> tuple[dict, dict]:
    """The `pair_norm_linear` operands and attributes of a `linear_pair`, or of a `linear` as its first side."""
    if op.name == "linear_pair":
        return operands_of(op), {n: v for n, v in op.attrs.items() if n in get_op(op.name).attrs}
    return ({"x": op.operand("x"), "w0": op.operand("w"), "scale0": op.operand("scale")},
            {"acc": op.attrs["acc"], **{f"{k}0": op.attrs[k] for k in ("block", "act", "out_dtype")}})


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    fused: set[int] = set()
    for op in fn.ops:
        if op.name != "norm_linear":
            continue
        found = pair_columns(rw, op.operand("x"))
        if found is None:
            continue
        pair, src, col = found
        if id(pair) in fused or pair.attrs.get("layer") != op.attrs.get("layer"):
            continue
        fused.add(id(pair))
        operands, attrs = first_gemms(pair)
        operands.update({n: v for n, v in operands_of(op).items() if n != "x"})
        attrs.update({k: op.attrs[k] for k in ("eps", "block", "act", "out_dtype")}, src=src, col=col)
        attrs.update(tags_of(pair, role=join_roles(pair, op)))
        rw.replace(pair, make_op(rw.namer, "pair_norm_linear", operands, attrs, pair.loc, [*pair.results, op.result]),
                   absorbed=[op])
    fn, hits = rw.done("fused")
    fn, seams = _fold_seam(fn)
    return fn, {**hits, "seam": seams} if seams else hits


def _fold_seam(fn: Function) -> tuple[Function, int]:
    """The seam after a partitioned MoE and the next attention's front: one `mhc_add_pair_norm_linear`."""
    rw = Rewrite(fn)
    for front in fn.ops:
        if front.name != "pair_norm_linear":
            continue
        found = seam_before(rw, front, "mhc_post_pre_add", ("y", "y2", "streams", "post", "comb"))
        if found is None:
            continue
        seam, operands, seam_attrs = found
        operands.update({n: v for n, v in operands_of(front).items() if n != "x"})
        attrs = {n: v for n, v in front.attrs.items() if n in get_op(front.name).attrs}
        attrs.update(seam_attrs, **tags_of(front, role=join_roles(seam, front)))
        results = [seam.out("streams_out"), seam.out("post_next"), seam.out("comb_next"), *front.results]
        rw.replace(front, make_op(rw.namer, "mhc_add_pair_norm_linear", operands, attrs, front.loc, results),
                   absorbed=[seam])
    return rw.done()[0], rw.count


FuseAttnFront = function_pass("fuse_attn_front", fuse_function, after={
    "pair_sibling_gemms": "it fuses pair_sibling_gemms' op",
    "fuse_norm_linear": "it fuses fuse_norm_linear's op",
})
