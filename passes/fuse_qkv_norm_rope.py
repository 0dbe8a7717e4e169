"""Fuse the attention's query / key prologue into one op: q norm + RoPE, kv norm + RoPE (+ official FP8
rounding), the indexer query's RoPE (+ Hadamard / FP4 rounding), and in decode the window-ring write.

Requires: the traced prologue of each layer (`rope(rms_norm(q, none))`, `rope(rms_norm(kv, w))`
[`fp8_round`], the indexer's `rope(qi)` [`hadamard_fp4_round`] with role `attn.indexer`, at one position
input, grouped by the `layer` tag), after or before `lower_sparse_attention`.
Guarantees: per layer one `qkv_norm_rope`. In a one-token function (decode) on the pool, the layer's
`pool_write_window` folds in too: the row is written before the attention reads the pool, which is safe
because a query's window CSR lists positions before it only and the ring slot it overwrites held
position t - window, which that query no longer sees; the pool planes are re-threaded accordingly
(through the ops' `tied` traits: no table of plane operands, no pool input names).
Result names kept; numerics identical.
Hits: `<func>.fused`, `<func>.window_writes`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op

from .base import function_pass
from .rewrite import Rewrite, has_role, join_roles, make_op, planes, tags_of


def thread_roots(fn: Function) -> dict[int, int]:
    """id(value) -> id of the function input it is an in-place version of, following every op's `tied`
    trait (pool planes and state rings form such chains)."""
    root: dict[int, int] = {}
    for op in fn.ops:
        tied = get_op(op.name).tied
        for rname, oname in tied.items():
            o, r = op.operand(oname), op.out(rname)
            if o is not None and r is not None:
                root[id(o)] = root.get(id(o), id(o))
                root[id(r)] = root[id(o)]
    return root


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)  # the matching (the emission below threads the pool planes' in-place versions itself)
    namer, users, sole_user = rw.namer, rw.users, rw.sole_user

    # Collect each layer's pieces.
    groups: dict[int, dict] = {}
    for op in fn.ops:
        if op.name != "rope" or op.attrs["inverse"] or "layer" not in op.attrs:
            continue
        src = rw.producer(op.operand("x"), "rms_norm", only_use=True)
        g = groups.setdefault(op.attrs["layer"], {})
        if has_role(op, "attn.indexer"):
            g["qi"] = (None, op)
        elif src is not None:
            key = "q" if src.operand("weight") is None else "kv"
            g[key] = (src, op)
    fused_at: dict[int, object] = {}  # id(last constituent op) -> group
    drop: set[int] = set()
    for key, g in groups.items():
        if "q" not in g or "kv" not in g:
            continue
        qn, qr = g["q"]
        kn, kr = g["kv"]
        if qr.operand("pos") is not kr.operand("pos") or qr.attrs != kr.attrs:
            continue
        members = [qn, qr, kn, kr]
        kv_out = kr.result
        rnd = sole_user(kv_out, "fp8_round")
        if rnd is not None:
            members.append(rnd)
            kv_out = rnd.result
        qi_out = qi_round = qir = None
        if "qi" in g and g["qi"][1].operand("pos") is qr.operand("pos") and all(
                g["qi"][1].attrs[k] == qr.attrs[k] for k in ("dim", "theta", "yarn", "inverse")):
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
        g.update(members=members, kv_out=kv_out, qi_out=qi_out, qir=qir, qi_round=qi_round, write=write, rnd=rnd)
        last = max(members, key=fn.ops.index)
        fused_at[id(last)] = g
        drop.update(id(m) for m in members)
        if write is not None:
            drop.add(id(write))

    # Pool planes are updated in place (`tied`): every read of a plane reads its latest version, so the
    # window write moved up into the prologue is seen by the ops after it, and its old results (now gone)
    # resolve to the latest version too.
    root = thread_roots(fn)
    latest: dict[int, object] = {}
    mapping: dict[int, object] = {}

    def sub(v):
        while v is not None and id(v) in mapping:
            v = mapping[id(v)]
        if v is not None and id(v) in root:
            v = latest.get(root[id(v)], v)
        return v

    values = {id(v): v for v in fn.inputs} | {id(r): r for op in fn.ops for r in op.results}

    def current(v):
        """The latest in-place version, as of the ops emitted so far, of the plane `v` is a version of: the
        fused op may sit before writes that came first in the unfused order (e.g. an HCA layer's compressor
        write), and must then take the plane as it is at its own place."""
        if id(v) in root:
            return latest.get(root[id(v)], values[root[id(v)]])
        return sub(v)

    def note(op):
        for rname, oname in get_op(op.name).tied.items():
            o, r = op.operand(oname), op.out(rname)
            if o is not None and r is not None and id(o) in root:
                root[id(r)] = root[id(o)]
                latest[root[id(o)]] = r

    hits = {"fused": 0, "window_writes": 0}
    ops = []
    for op in fn.ops:
        g = fused_at.get(id(op))
        if g is not None:
            qn, qr = g["q"]
            kn, kr = g["kv"]
            w = g["write"]
            attrs = {"eps": qn.attrs["eps"], "q_mean": qn.attrs["mean"],
                     **{k: qr.attrs[k] for k in ("dim", "theta", "yarn")},
                     **tags_of(qr, role=join_roles(*(m for m in (qr, g["qir"]) if m is not None)))}
            if g["rnd"] is not None:
                attrs.update(kv_round_dims=g["rnd"].attrs["dims"], kv_round_block=g["rnd"].attrs["block"])
            if g["qi_round"] is not None:
                attrs["qi_round"] = "fp4"
            operands = {"q": sub(qn.operand("x")), "kv": sub(kn.operand("x")), "norm": kn.operand("weight"),
                        "pos": qr.operand("pos"), "qi": sub(g["qir"].operand("x")) if g["qir"] is not None else None}
            results = [qr.result, g["kv_out"]] + ([g["qi_out"]] if g["qi_out"] is not None else [])
            if w is not None:
                operands["slot"] = sub(w.operand("slot"))
                for k, p in enumerate(planes(w, "p")):
                    operands[f"p{k}"] = current(p)
                attrs.update({k: w.attrs[k] for k in ("window", "slot_rows", "n_rows", "layer_row", "fmt")})
            new = make_op(namer, "qkv_norm_rope", operands, attrs, qr.loc)
            for old, newv in zip(results, new.results):
                mapping[id(old)] = newv
            note(new)
            if w is not None:
                hits["window_writes"] += 1
            ops.append(new)
            hits["fused"] += 1
            continue
        if id(op) in drop:
            continue
        operands = tuple(sub(v) for v in op.operands)
        op = op.replace(operands=operands) if operands != op.operands else op
        note(op)
        ops.append(op)
    outputs = [(n, sub(v)) for n, v in fn.outputs]
    return Function(fn.name, list(fn.inputs), ops, outputs, dict(fn.attrs)), hits


FuseQkvNormRope = function_pass("fuse_qkv_norm_rope", fuse_function, after={
    "lower_sparse_attention": "in decode it folds the window write the lowering makes",
})
