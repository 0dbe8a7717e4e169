"""Fold the inverse RoPE of the attention output into the activation quantisation feeding `wo_a`.

Requires: `rope(o, pos, inverse=true)` whose only user is `grouped_out_proj` (the traced attention).
Guarantees: the two become `inv_rope_group_quant(o, pos)` + `grouped_out_proj`: one op rotates the
output's RoPE dims back and produces `wo_a`'s input in the GEMM's activation format. Option `quant`:
* `auto` (default): follow the GEMM's `act` attribute: `native` -> the op emits the rotated output;
  `fp8` -> it also quantises it (e4m3, one UE8M0 scale per 128 values of a group's K, spec 13.1) and the
  GEMM reads the scales. Either way numerics are bit-identical (the GEMM would quantise the same values);
* `none`: never quantise here (an `act="fp8"` GEMM then quantises its input itself);
* `fp8`: quantise whatever the GEMM's `act`, and make it `act="fp8"`: on a `native` GEMM values then
  move by FP8 rounding (~2^-4 relative) by design.
A GEMM whose groups' K is neither a multiple of 128 nor below it has blocks no uniform group of the
flattened heads describes: it keeps quantising itself.
Hits: `<func>.folded`, `<func>.quantized`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.errors import PassError
from v4compile.ir.core import Function

from .base import FunctionPass, register
from .rewrite import Namer, make_op, rebuild, tags_of, use_counts


@register
@dataclass(frozen=True)
class FoldInverseRopeWoAQuant(FunctionPass):
    name = "fold_inverse_rope_wo_a_quant"
    quant: str = "auto"

    def run(self, module):
        if self.quant not in ("auto", "none", "fp8"):
            raise PassError("fold_inverse_rope_wo_a_quant: quant must be auto, none or fp8", found=self.quant)
        return super().run(module)

    def rewrite(self, fn: Function):
        namer = Namer(fn)
        uses = use_counts(fn)
        users = fn.users()
        replace, n, nq = {}, 0, 0
        for op in fn.ops:
            if op.name != "rope" or not op.attrs["inverse"]:
                continue
            u = users.get(id(op.result), [])
            if uses.get(id(op.result)) != 1 or len(u) != 1 or u[0].name != "grouped_out_proj":
                continue
            proj = u[0]
            group = _quant_group(op.result.type, proj.attrs["groups"])
            want = proj.attrs["act"] == "fp8" if self.quant == "auto" else self.quant == "fp8"
            fp8 = want and group is not None
            attrs = {k: op.attrs[k] for k in ("dim", "theta", "yarn")}
            q = make_op(namer, "inv_rope_group_quant", {"x": op.operand("x"), "pos": op.operand("pos")},
                        {**attrs, "fmt": "fp8" if fp8 else "none", **({"group": group} if fp8 else {}),
                         **tags_of(op)}, op.loc, None if fp8 else [op.result])
            proj_attrs = dict(proj.attrs)
            if fp8:
                proj_attrs.update(act="fp8", out_dtype=proj.attrs["out_dtype"] or op.result.type.dtype)
            new_proj = make_op(namer, "grouped_out_proj", {"o": q.out("y"), "w": proj.operand("w"),
                                                           "scale": proj.operand("scale"),
                                                           "o_scale": q.out("scale") if fp8 else None},
                               proj_attrs, proj.loc, [proj.result])
            replace[id(op)] = q
            replace[id(proj)] = new_proj
            n += 1
            nq += fp8
        return rebuild(fn, replace), {"folded": n, "quantized": nq}


def _quant_group(t, groups: int) -> int | None:
    """Values per activation scale along the flattened heads that match the GEMM's 128-wide blocks of
    each group's K (None if no uniform group does)."""
    from v4compile.formats import ACT_BLOCK

    k = t.numel // (t.shape[0] * t.shape[1]) // groups
    if k % ACT_BLOCK == 0:
        return ACT_BLOCK
    return k if k < ACT_BLOCK else None
