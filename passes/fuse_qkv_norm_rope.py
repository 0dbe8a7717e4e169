"""Fuse the attention's query / key prologue into one op: q norm + RoPE, kv norm + RoPE (+ official FP8
rounding), the indexer query's RoPE (+ Hadamard / FP4 rounding), and in decode the window-ring write.

Requires: the traced prologue of each layer (`rope(rms_norm(q, none))`, `rope(rms_norm(kv, w))`
[`fp8_round`], the indexer's `rope(qi)` [`hadamard_fp4_round`], at one position input), after or before
`lower_sparse_attention`.
Guarantees: per layer one `qkv_norm_rope`. In a one-token function (decode) on the pool, the layer's
`pool_write_window` folds in too: the row is written before the attention reads the pool, which is safe
because a query's window CSR lists positions before it only and the ring slot it overwrites held
position t - window, which that query no longer sees; the pool planes are re-threaded accordingly.
Result names kept; numerics identical.
Hits: `<func>.fused`, `<func>.window_writes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.ir.core import Function

from .base import FunctionPass, register
from .rewrite import Namer, make_op, use_counts

PLANE_OPERANDS = {"pool_write_window": (3, 0), "compress_paged": (9, 2)}  # first plane operand, first plane result


def _layer(loc: str) -> str:
    return ".".join(loc.split(".")[:2])


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    namer = Namer(fn)
    prod = fn.producers()
    uses = use_counts(fn)
    users = fn.users()

    def sole_user(v, name):
        u = users.get(id(v), [])
        return u[0] if uses.get(id(v)) == 1 and len(u) == 1 and u[0].name == name else None

    # Collect each layer's pieces.
    groups: dict[str, dict] = {}
    for op in fn.ops:
        if op.name != "rope" or op.attrs["inverse"]:
            continue
        src = prod.get(id(op.operands[0]))
        g = groups.setdefault(_layer(op.loc), {})
        if src is not None and src.name == "rms_norm" and uses.get(id(src.result)) == 1:
            key = "q" if src.operands[1] is None else "kv"
            g[key] = (src, op)
        elif op.loc.endswith(".indexer"):
            g["qi"] = (None, op)
    fused_at: dict[int, object] = {}  # id(last constituent op) -> group
    drop: set[int] = set()
    for key, g in groups.items():
        if "q" not in g or "kv" not in g:
            continue
        qn, qr = g["q"]
        kn, kr = g["kv"]
        if qr.operands[1] is not kr.operands[1] or qr.attrs != kr.attrs:
            continue
        members = [qn, qr, kn, kr]
        kv_out = kr.result
        rnd = sole_user(kv_out, "fp8_round")
        if rnd is not None:
            members.append(rnd)
            kv_out = rnd.result
        qi_out = qi_round = None
        if "qi" in g and g["qi"][1].operands[1] is qr.operands[1] and g["qi"][1].attrs == qr.attrs:
            qir = g["qi"][1]
            members.append(qir)
            qi_out = qir.result
            h = sole_user(qi_out, "hadamard_fp4_round")
            if h is not None:
                members.append(h)
                qi_out, qi_round = h.result, h
        write = None
        if kv_out.type.shape[1] == 1:
            w = [u for u in users.get(id(kv_out), []) if u.name == "pool_write_window"]
            write = w[0] if w else None
        g.update(members=members, kv_out=kv_out, qi_out=qi_out, qi_round=qi_round, write=write, rnd=rnd)
        last = max(members, key=fn.ops.index)
        fused_at[id(last)] = g
        drop.update(id(m) for m in members)
        if write is not None:
            drop.add(id(write))

    mapping: dict[int, object] = {}

    def sub(v):
        while v is not None and id(v) in mapping:
            v = mapping[id(v)]
        return v

    main = [v for v in fn.inputs if v.name in ("pool.main", "pool.nope", "pool.nope_scale", "pool.rope")]
    hits = {"fused": 0, "window_writes": 0}
    ops = []
    for op in fn.ops:
        g = fused_at.get(id(op))
        if g is not None:
            qn, qr = g["q"]
            kn, kr = g["kv"]
            w = g["write"]
            attrs = {"eps": qn.attrs["eps"], **{k: qr.attrs[k] for k in ("dim", "theta", "yarn")}}
            if g["rnd"] is not None:
                attrs.update(kv_round_dims=g["rnd"].attrs["dims"], kv_round_block=g["rnd"].attrs["block"])
            if g["qi_round"] is not None:
                attrs["qi_round"] = "fp4"
            operands = [sub(qn.operands[0]), sub(kn.operands[0]), kn.operands[1], qr.operands[1]]
            operands.append(sub(g["members"][4 + (g["rnd"] is not None)].operands[0]) if g["qi_out"] is not None
                            else None)
            results = [qr.result, g["kv_out"]] + ([g["qi_out"]] if g["qi_out"] is not None else [])
            if w is not None:
                operands += [sub(w.operands[2]), *main]
                attrs.update({k: w.attrs[k] for k in ("window", "slot_rows", "n_rows", "layer_row", "fmt")})
            new = make_op(namer, "qkv_norm_rope", operands, attrs, qr.loc)
            for old, newv in zip(results, new.results):
                mapping[id(old)] = newv
            if w is not None:
                planes = list(new.results[len(results):])
                for old, newv in zip(main, planes):
                    mapping[id(old)] = newv  # later readers of the pool see the written ring
                for old_out, old_in in zip(w.results, w.operands[3:]):
                    if old_in is not None:
                        mapping[id(old_out)] = old_in  # the removed write passes the planes through
                main = planes
                hits["window_writes"] += 1
            ops.append(new)
            hits["fused"] += 1
            continue
        if id(op) in drop:
            continue
        operands = tuple(sub(v) for v in op.operands)
        op = op.replace(operands=operands) if operands != op.operands else op
        if op.name in PLANE_OPERANDS:
            first, res = PLANE_OPERANDS[op.name]
            if list(operands[first:first + len(main)]) == main:
                main = list(op.results[res:res + len(main)])
        ops.append(op)
    outputs = [(n, sub(v)) for n, v in fn.outputs]
    return Function(fn.name, list(fn.inputs), ops, outputs, dict(fn.attrs)), hits


@register
@dataclass(frozen=True)
class FuseQkvNormRope(FunctionPass):
    name = "fuse_qkv_norm_rope"

    def rewrite(self, fn):
        return fuse_function(fn)
