"""Fold the inverse RoPE of the attention output into the activation quantisation feeding `wo_a`.

Requires: `rope(o, pos, inverse=true)` whose only user is `grouped_out_proj` (the traced attention).
Guarantees: the two become `inv_rope_group_quant(o, pos)` + `grouped_out_proj`: one op rotates the
output's RoPE dims back and produces `wo_a`'s input in the activation format. Option `quant`:
* `none` (default, the hf / official numerics, whose GEMMs read activations as they are): the op emits
  the rotated output; numerics bit-identical;
* `fp8`: it also quantises to e4m3 with one UE8M0 scale per 128 values (spec 13.1, the FP8-activation
  GEMM path) and `grouped_out_proj` reads the scales; values then move by FP8 rounding (~2^-4 relative)
  by design.
Hits: `<func>.folded`.
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
    quant: str = "none"

    def run(self, module):
        if self.quant not in ("none", "fp8"):
            raise PassError("fold_inverse_rope_wo_a_quant: quant must be none or fp8", found=self.quant)
        return super().run(module)

    def rewrite(self, fn: Function):
        namer = Namer(fn)
        uses = use_counts(fn)
        users = fn.users()
        replace, n = {}, 0
        for op in fn.ops:
            if op.name != "rope" or not op.attrs["inverse"]:
                continue
            u = users.get(id(op.result), [])
            if uses.get(id(op.result)) != 1 or len(u) != 1 or u[0].name != "grouped_out_proj":
                continue
            proj = u[0]
            attrs = {k: op.attrs[k] for k in ("dim", "theta", "yarn")}
            q = make_op(namer, "inv_rope_group_quant", {"x": op.operand("x"), "pos": op.operand("pos")},
                        {**attrs, "fmt": self.quant, **tags_of(op)}, op.loc,
                        None if self.quant == "fp8" else [op.result])
            o_scale = q.out("scale") if self.quant == "fp8" else None
            new_proj = make_op(namer, "grouped_out_proj", {"o": q.out("y"), "w": proj.operand("w"),
                                                           "scale": proj.operand("scale"), "o_scale": o_scale},
                               {**proj.attrs, "out_dtype": op.result.type.dtype if o_scale is not None else ""},
                               proj.loc, [proj.result])
            replace[id(op)] = q
            replace[id(proj)] = new_proj
            n += 1
        return rebuild(fn, replace), {"folded": n}
