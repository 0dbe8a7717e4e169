"""Shared machinery of the GEMM-merging passes: several `linear`s of one input become one `linear` on a
weight concatenated along its output rows, followed by `split`s that give back the original results
(same names, so later ops are untouched and `ir diff` shows the change).

Weights are merged at compile time: the merged weight's sources are the members' sources in order, and
`load_ir_weights` concatenates them along the first axis (scales likewise). Quantised weights merge only
when every member but the last has a row count that is a multiple of the scale block, so that the
concatenated scale grid is exactly the members' grids stacked.
"""

from __future__ import annotations

from v4compile.ir.core import WEIGHT, Function, Module, Op, Value
from v4compile.ir.types import TensorType

from .rewrite import Namer, join_roles, make_op, new_module, prune_weights, tags_of


def merged_name(names: list[str], suffix: str) -> str:
    """The members' common module path + suffix: `layers.3.attn.wq_a.weight` + `layers.3.attn.wkv.weight`
    -> `layers.3.attn.<suffix>.weight`."""
    parts = [n.split(".")[:-2] for n in names]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    return ".".join(common + [suffix, "weight"])


# GEMM attributes every member of a merged group must share (the numerics of the one merged GEMM).
SHARED_ATTRS = ("block", "act", "acc", "out_dtype")


def can_merge(ops: list[Op]) -> bool:
    ws = [op.operand("w") for op in ops]
    if any(w is None or w.kind != WEIGHT for w in ws):
        return False
    if len({(w.type.dtype, w.type.shape[1:]) for w in ws}) != 1:
        return False
    if len({op.operand("scale") is None for op in ops}) != 1:
        return False
    if len({tuple(op.attrs.get(k) for k in SHARED_ATTRS) for op in ops}) != 1:
        return False
    if len({op.attrs.get("layer") for op in ops}) != 1:
        return False
    if ops[0].operand("scale") is not None:
        block = ops[0].attrs["block"]
        if ws[0].type.dtype == "fp8e4m3" and any(w.type.shape[0] % block for w in ws[:-1]):
            return False
    return True


def merge_linears(fn: Function, groups: list[list[Op]], weights: dict[str, Value], suffix_of) -> tuple[Function, int]:
    """Replace each group of linears (same input) by one merged linear + splits. Returns the new function
    and the number of groups merged; new weights are added to `weights`. The merged GEMM and its splits
    carry the members' joined role."""
    namer = Namer(fn)
    first_of = {id(g[0]): g for g in groups}
    drop = {id(op) for g in groups for op in g[1:]}
    ops: list[Op] = []
    for op in fn.ops:
        if id(op) in drop:
            continue
        group = first_of.get(id(op))
        if group is None:
            ops.append(op)
            continue
        ws = [g.operand("w") for g in group]
        scales = [g.operand("scale") for g in group]
        name = merged_name([w.name for w in ws], suffix_of(group))
        rows = sum(w.type.shape[0] for w in ws)
        w = weights.get(name) or Value(name, TensorType((rows, *ws[0].type.shape[1:]), ws[0].type.dtype), WEIGHT,
                                       tuple(s for w in ws for s in w.sources))
        weights[name] = w
        s = None
        if scales[0] is not None:
            sname = name[: -len(".weight")] + ".scale"
            srows = sum(x.type.shape[0] for x in scales)
            s = weights.get(sname) or Value(sname, TensorType((srows, *scales[0].type.shape[1:]), scales[0].type.dtype),
                                            WEIGHT, tuple(src for x in scales for src in x.sources))
            weights[sname] = s
        loc = group[0].loc
        tags = tags_of(group[0], role=join_roles(*group))
        merged = make_op(namer, "linear", {"x": group[0].operand("x"), "w": w, "scale": s},
                         {**group[0].attrs, **tags}, loc)
        ops.append(merged)
        rest = merged.result
        for k, g in enumerate(group[:-1]):
            n = g.result.type.shape[-1]
            if k == len(group) - 2:
                ops.append(make_op(namer, "split", {"x": rest}, {"at": n, **tags}, loc, [g.result, group[-1].result]))
            else:
                tail = namer.value(rest.type.with_shape(*rest.type.shape[:-1], rest.type.shape[-1] - n))
                ops.append(make_op(namer, "split", {"x": rest}, {"at": n, **tags}, loc, [g.result, tail]))
                rest = tail
    return Function(fn.name, list(fn.inputs), ops, list(fn.outputs), dict(fn.attrs)), len(groups)


def merge_module(module: Module, groups_of, suffix_of) -> tuple[Module, dict[str, int]]:
    """The module with every function's GEMM groups merged (`merge_linears`), the weights they replace
    pruned. `groups_of(fn) -> (groups, extra hits)`; hits: `<func>.merged` and the extra ones."""
    weights = dict(module.weights)
    funcs, hits = {}, {}
    for fname, fn in module.functions.items():
        groups, extra = groups_of(fn)
        funcs[fname], hits[f"{fname}.merged"] = merge_linears(fn, groups, weights, suffix_of)
        hits.update({f"{fname}.{k}": v for k, v in extra.items()})
    return prune_weights(new_module(module, funcs, weights)), hits
