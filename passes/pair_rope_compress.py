"""Launch a layer's query prologue and its compressor together.

Requires: `fuse_qkv_norm_rope` (the decode window-ring write inside `qkv_norm_rope`) and `pair_compressors`
(a CSA layer's two compressors already one `compress_pair`), when the pipeline has them.
Guarantees: in a decode step (one token per sequence), each `qkv_norm_rope` that writes the window ring and the
same layer's compressor (`compress_paged`: HCA; `compress_pair`: CSA) that writes the same pool become one
`qkv_rope_compress` / `qkv_rope_compress_pair` at the later one's place (one launch fewer per layer: V4-Pro
61 a step, in every layout), when
* they read the same positions and slots, and the one's pool planes are the other's only (the SSA thread
  of the pool is all that orders them: no other operand of the later one is computed by the earlier one,
  and nothing else reads the pool between them);
* the rows they write are disjoint, checked from their attributes: the window rows of slot s,
  `n_rows - (s + 1) * slot_rows + layer_row + p % window`, lie in the slots' region `[n_rows - n_slots *
  slot_rows, n_rows)` (`layer_row + window <= slot_rows`; n_slots is the compressor's state-ring count), the
  compressed rows `block * envelope_rows + layer_offset + w % (block_tokens / ratio)` below it (the layer's
  rows fit its envelope, and the region below the slots is whole envelopes: the pool's blocks, `pool.py`);
  neither op reads a pool row (the compressor reads its state rings, the prologue only activations), so the
  two write-only halves commute;
* no op outside lies between them on a data path (`Rewrite.can_fuse`).
Each half keeps its operands, attributes and result values (the intermediate pool version disappears with
its one use), so numerics are identical: the kernel runs the two ops' program bodies on disjoint program-id
ranges of one launch. Prefill chunks write no window row from `qkv_norm_rope` and keep their launches.
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function, Op
from v4compile.ir.semantics import TAGS
from v4compile.ops.rope_compress import ROPE_COMPRESS

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of

FUSED = {"compress_paged": "qkv_rope_compress", "compress_pair": "qkv_rope_compress_pair"}


def rows_disjoint(qkv: Op, comp: Op) -> bool:
    """Whether the window rows `qkv` writes and the compressed rows `comp` writes can never meet (the argument in
    the module docstring, from the ops' attributes and the pool planes' and state rings' shapes)."""
    h = "_0" if comp.name == "compress_pair" else ""  # a pair's half 0 writes the main pool
    a, c = qkv.attrs, comp.attrs
    n_rows = qkv.operand("p0").type.shape[0]
    n_slots = comp.operand(f"state_kv{h}").type.shape[0]
    below = n_rows - n_slots * a["slot_rows"]  # the first row of the slots' region
    env = c[f"envelope_rows{h}"]
    return (a["n_rows"] == n_rows and a["window"] >= 1 and a["layer_row"] >= 0
            and a["layer_row"] + a["window"] <= a["slot_rows"] and below >= 0 and below % env == 0
            and c[f"layer_offset{h}"] >= 0 and c[f"layer_offset{h}"] + c[f"block_tokens{h}"] // c[f"ratio{h}"] <= env)


def reads_another_result(first: Op, second: Op, between: list) -> bool:
    """Whether `second` reads a result of `first` other than the pool planes `between` them."""
    made = {id(r) for r in first.results} - {id(v) for v in between}
    return any(id(v) in made for v in second.operands if v is not None)


def pool(op: Op, results: bool = False) -> list:
    """The main pool planes `op` reads (or, `results`, writes): p0 .. p2, None where absent."""
    h = "_0" if op.name == "compress_pair" else ""
    if results:
        return [op.out(f"q{i}{h}") for i in range(3)]
    return [op.operand(f"p{i}{h}") for i in range(3)]


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    index = {id(op): i for i, op in enumerate(fn.ops)}
    comps = {}  # (id(a main pool plane a compressor reads or writes), its layer) -> the compressor
    for op in fn.ops:
        if op.name in FUSED:
            for v in (*pool(op), *pool(op, True)):
                if v is not None:
                    comps[id(v), op.attrs.get("layer")] = op
    for qkv in fn.ops:
        if qkv.name != "qkv_norm_rope" or qkv.operand("p0") is None or qkv.operand("q").type.shape[1] != 1:
            continue
        layer = qkv.attrs.get("layer")
        comp = comps.get((id(qkv.out("q0")), layer)) or comps.get((id(qkv.operand("p0")), layer))
        if comp is None or rw.gone(comp) or id(comp) in rw.replaced or any(
                qkv.operand(n) is not comp.operand(n) for n in ("pos", "slot")):
            continue  # another layer's, already fused, or another chunk
        first, second = (qkv, comp) if index[id(qkv)] < index[id(comp)] else (comp, qkv)
        between, reads = pool(first, True), pool(second)
        if [id(v) for v in between] != [id(v) for v in reads] or any(
                v is not None and rw.uses.get(id(v)) != 1 for v in between):
            continue  # the earlier one's pool planes are not the later one's alone
        if reads_another_result(first, second, between):
            continue
        if not rows_disjoint(qkv, comp) or not rw.can_fuse(second, absorbed=[first]):
            continue
        rc = ROPE_COMPRESS[FUSED[comp.name]]
        operands = {k: v for k, v in operands_of(qkv).items() if k not in ("p0", "p1", "p2")}
        operands.update({rc.operand_map[k]: v for k, v in operands_of(comp).items() if k not in rc.c_planes})
        operands.update({f"p{i}": v for i, v in enumerate(pool(first))})  # the pool before both writes
        qkv_res = dict(qkv.named_results())
        results = [qkv_res[n] for n in ("q_out", "kv_out", "qi_out") if n in qkv_res]
        results += [v for n, v in comp.named_results() if n not in rc.c_plane_results]
        results += [v for v in pool(second, True) if v is not None]  # the pool after both
        attrs = {k: v for k, v in qkv.attrs.items() if not k.startswith("_") and k not in ("variant", *TAGS)}
        attrs.update({f"c_{k}": v for k, v in comp.attrs.items() if not k.startswith("_") and k not in TAGS})
        attrs.update(tags_of(qkv, role=join_roles(qkv, comp)))
        rw.replace(second, make_op(rw.namer, FUSED[comp.name], operands, attrs, qkv.loc, results), absorbed=[first])
    return rw.done("fused")


PairRopeCompress = function_pass("pair_rope_compress", fuse_function, after={
    "fuse_qkv_norm_rope": "it fuses the window-ring write into qkv_norm_rope first",
    "pair_compressors": "a CSA layer's compressors are one compress_pair launch first",
})
