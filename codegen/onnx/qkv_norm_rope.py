"""ONNX lowerings of the `qkv_norm_rope` kernel family: qkv_norm_rope."""

from __future__ import annotations

from . import pool_rows, quant, rotary


def lower_qkv_norm_rope(g, o, a, r):
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    if a["q_mean"] != "fp32" and o.types["q"].dtype != "fp32":  # in fp32 both statistics are the same maths
        raise NotImplementedError("qkv_norm_rope q_mean=\"dtype\" on a non-fp32 input (cpu: fp32)")
    rot = dict(dim=a["dim"], theta=a["theta"], yarn=tuple(a["yarn"]))
    # fused rotations (`rotary.rotate`): kv's FP8 rounding takes only the unrotated channels, which stay exact
    qo = rotary.rotate(g, g.rms(o.q, None, a["eps"], o.types["q"].shape[-1]), o.types["q"], pos, 2, **rot, fused=True)
    kvo = rotary.rotate(g, g.rms(o.kv, o.norm, a["eps"]), o.types["kv"], pos, 2, **rot, fused=True)
    if a.get("kv_round_dims", 0):
        kvo = quant.fp8_round(g, kvo, o.types["kv"], a["kv_round_dims"], a.get("kv_round_block", 64))
    out = [qo, kvo]
    if o.qi is not None:
        qio = rotary.rotate(g, o.qi, o.types["qi"], pos, 2, **rot, fused=a.get("qi_round", "none") != "fp4")
        out.append(quant.hadamard_fp4(g, qio, o.types["qi"], 32) if a.get("qi_round", "none") == "fp4" else qio)
    if o.p0 is not None:
        if a["fmt"] != "native" or o.p1 is not None:
            raise NotImplementedError("qkv_norm_rope: the ONNX lowering writes native pool planes only")
        out.append(pool_rows.window_write(g, o.p0, kvo, o.types["kv"], pos, g.as_i64(o.slot, o.types["slot"].dtype), a))
    return out
