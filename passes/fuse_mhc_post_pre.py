"""Fuse every mHC seam: a sub-layer's `hc_post` and the next sub-layer's `hc_pre` become one
`mhc_post_pre` launch, with the next sub-layer's RMSNorm (attn_norm / ffn_norm) folded in.

Requires: a traced module (after the GEMM merges or not).
Guarantees:
* every `hc_post` whose streams feed an `hc_pre` becomes, with it, one `mhc_post_pre` (tagged with the
  `hc_pre`'s layer, roles joined) — except the seams of layer 0 (`layer` tag 0), as the seed describes (its attention pre has no post to fold; its attention post and FFN
  pre stay separate). V4-Pro: 2 x 60 = 120 seams;
* an `hc_pre` left unfused (layer 0's two) still absorbs its RMSNorm: `hc_pre_norm`;
* decision: the last layer's FFN `hc_post` folds into `hc_head` (`mhc_post_head`) when the final streams
  have no other user (they do when an MTP draft reads them), saving one launch per step;
* result values keep their names; numerics are bit-identical (the fused references compose the
  originals).
Hits: `<func>.seams`, `<func>.pre_norm`, `<func>.post_head`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, tags_of


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    namer, users, uses = rw.namer, rw.users, rw.uses
    hits = {"seams": 0, "pre_norm": 0, "post_head": 0}

    def norm_of(pre) -> object | None:
        """The weighted rms_norm that is the only user of an hc_pre's collapsed output."""
        norm = rw.sole_user(pre.out("y"), "rms_norm")
        return norm if norm is not None and norm.operand("weight") is not None else None

    def pre_attrs(pre, norm) -> dict:
        return {**pre.attrs, "norm_eps": norm.attrs["eps"] if norm is not None else 1e-6}

    def pre_operands(pre, norm) -> dict:
        return {"fn": pre.operand("fn"), "base": pre.operand("base"), "scale": pre.operand("scale"),
                "norm": norm.operand("weight") if norm is not None else None}

    fused_pres: set[int] = set()
    for op in fn.ops:
        if op.name != "hc_post":
            continue
        out = op.out("streams_out")
        nxt = [u for u in users.get(id(out), []) if u.name == "hc_pre" and u.operand("streams") is out]
        if nxt and nxt[0].attrs.get("layer") != 0:  # layer 0's own seam stays separate
            pre = nxt[0]
            norm = norm_of(pre)
            y_next = norm.result if norm is not None else pre.out("y")
            post_in = {k: op.operand(k) for k in ("y", "streams", "post", "comb")}
            new = make_op(namer, "mhc_post_pre", {**post_in, **pre_operands(pre, norm)},
                          {**pre_attrs(pre, norm), **tags_of(pre, role=join_roles(op, pre))}, pre.loc,
                          [out, y_next, pre.out("post"), pre.out("comb")])
            rw.replace(op, new, absorbed=[pre] + ([norm] if norm is not None else []))
            fused_pres.add(id(pre))
            hits["seams"] += 1
            continue
        head = [u for u in users.get(id(out), []) if u.name == "hc_head"]
        if head and uses.get(id(out)) == 1:
            h = head[0]
            post_in = {k: op.operand(k) for k in ("y", "streams", "post", "comb")}
            new = make_op(namer, "mhc_post_head", {**post_in, **{k: h.operand(k) for k in ("fn", "base", "scale")}},
                          {**h.attrs, **tags_of(h, role=join_roles(op, h))}, h.loc, [h.result])
            rw.replace(op, new, absorbed=[h])
            hits["post_head"] += 1
    for op in fn.ops:
        if op.name == "hc_pre" and id(op) not in fused_pres:
            norm = norm_of(op)
            if norm is None:
                continue
            rw.replace(op, make_op(namer, "hc_pre_norm", {"streams": op.operand("streams"), **pre_operands(op, norm)},
                                   pre_attrs(op, norm), op.loc, [norm.result, op.out("post"), op.out("comb")]),
                       absorbed=[norm])
            hits["pre_norm"] += 1
    return rw.done(hits)


FuseMhcPostPre = function_pass("fuse_mhc_post_pre", fuse_function)
