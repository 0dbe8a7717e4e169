"""moe family (moe_experts_shared, moe_experts) under the interpreter vs the op references.

Cases: FP4 routed experts (1x32 E8M0) + FP8 shared expert (128x128 E8M0), bf16 (dot_scaled path) and
fp32 (exact nibble-decode path); float experts; act="fp8"; an idle expert, a token whose slots are not
in expert order, and a hash-style duplicate-free routing. Tolerance: kernel_check.assert_matches — the
kernels round to x's dtype at every point the reference does (GEMM outputs, silu, product, weight,
each index_add_ step in ascending expert order, the final + shared), so what remains is fp32 summation
order inside each GEMM (1 bf16 ulp at a rounding boundary, which can propagate once: 2 ulps allowed).
act="fp8" reference: spec 13.1 applied to each GEMM input with `formats.fp8_qdq` (the registry's moe
ops do not declare `act` yet).
"""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch
import torch.nn.functional as F

from v4compile.codegen import kernels
from v4compile.formats import fp4_quant, fp8_block_quant, fp8_qdq
from v4compile.ir.registry import get_op
from v4compile.ops.basic import dequant_weight


def _experts(fmt, E, out_f, in_f, g):
    ws = [torch.randn(out_f, in_f, generator=g) * 0.08 for _ in range(E)]
    if fmt == "fp4":
        q = [fp4_quant(w, 32) for w in ws]
        return torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])
    return torch.stack(ws), None


def _shared(fmt, out_f, in_f, g, dtype):
    w = torch.randn(out_f, in_f, generator=g) * 0.08
    if fmt == "fp8":
        return fp8_block_quant(w, 128)
    return w.to(dtype), None


def _ref_act_fp8(args, attrs, dtype):
    """moe_experts_shared with every GEMM input rounded per spec 13.1 (the act="fp8" semantics)."""
    x = args["x"]
    flat = x.reshape(-1, x.shape[-1])
    idx = args["indices"].reshape(flat.shape[0], -1)
    wts = args["weights"].reshape(flat.shape[0], -1)
    L = attrs["limit"]
    out = torch.zeros_like(flat)

    def lin(h, w, s, blk):
        return F.linear(fp8_qdq(h, 128), dequant_weight(w, s, blk, dtype))

    def swi(g, u):
        return F.silu(g.clamp(max=L)) * u.clamp(min=-L, max=L)

    sc = (lambda s, e: None if s is None else s[e])
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        h = swi(lin(flat[tok], args["w1"][e], sc(args["w1_scale"], e), 32),
                lin(flat[tok], args["w3"][e], sc(args["w3_scale"], e), 32))
        out.index_add_(0, tok, lin(h, args["w2"][e], sc(args["w2_scale"], e), 32) * wts[tok, slot, None])
    hs = swi(lin(x, args["s1"], args["s1_scale"], 128), lin(x, args["s3"], args["s3_scale"], 128))
    return out.reshape(x.shape) + lin(hs, args["s2"], args["s2_scale"], 128)


def run(dtype, efmt="fp4", sfmt="fp8", act="native", op="moe_experts_shared", E=5, D=128, I=128, IS=128, k=2,
        B=2, T=3, seed=0, wrong=None, shared_act="native"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(B * T)]).reshape(B, T, k)  # E-1 idle
    idx[0, 0] = torch.tensor([3, 0, 1])[:k]  # slots not in ascending expert order
    wts = torch.rand(B, T, k, generator=g).to(dtype)
    w1, w1s = _experts(efmt, E, I, D, g)
    w3, w3s = _experts(efmt, E, I, D, g)
    w2, w2s = _experts(efmt, E, D, I, g)
    if efmt != "fp4":
        w1, w3, w2 = w1.to(dtype), w3.to(dtype), w2.to(dtype)
    args = {"x": x, "weights": wts, "indices": idx, "w1": w1, "w2": w2, "w3": w3, "w1_scale": w1s,
            "w2_scale": w2s, "w3_scale": w3s}
    attrs = {"limit": 1.5, "block": 32 if efmt == "fp4" else 128}
    if op == "moe_experts_shared":
        s1, s1s = _shared(sfmt, IS, D, g, dtype)
        s3, s3s = _shared(sfmt, IS, D, g, dtype)
        s2, s2s = _shared(sfmt, D, IS, g, dtype)
        args.update(s1=s1, s2=s2, s3=s3, s1_scale=s1s, s2_scale=s2s, s3_scale=s3s)
        attrs["shared_block"] = 128
        if "shared_act" in get_op(op).attrs:
            attrs["shared_act"] = shared_act
    if act == "fp8" and "act" not in get_op(op).attrs:
        ref = _ref_act_fp8(args, attrs, dtype)
    else:
        ref = kc.reference(op, args, {**attrs, **({"act": act} if act != "native" else {})})[0]
    y, _ = kc.poisoned((B, T, D), dtype)
    call_attrs = {**attrs, **({"act": act} if act != "native" else {})}
    if wrong:
        call_attrs["limit"] = 0.5
    calls = kernels.launch(op, args, call_attrs, {"y": y})
    kc.assert_matches(y, ref, f"{op} {efmt}/{sfmt} {dtype} act={act}", ulps=2)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_experts_fp8_shared(dtype):
    calls = run(dtype)
    assert [c.fn.__name__ if hasattr(c.fn, "__name__") else c.fn.fn.__name__ for c in calls] == [
        "moe_up_kernel", "moe_up_kernel", "moe_down_kernel", "moe_combine_kernel"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_experts_float_shared(dtype):
    # fp32: 18 tokens x 3 slots, several pair chunks per expert program and two token tiles in the combine
    run(dtype, efmt="float", sfmt="float", D=64, I=96, IS=80, k=3, E=6, T=9 if dtype == torch.float32 else 3)


@pytest.mark.parametrize("shared_act", ["native", "fp8"])
def test_act_fp8(shared_act):
    run(torch.bfloat16, act="fp8", shared_act=shared_act)


def test_moe_experts_without_shared():
    run(torch.bfloat16, op="moe_experts", efmt="float", D=64, I=48)


def test_wrong_limit_is_caught():
    with pytest.raises(AssertionError):
        run(torch.float32, efmt="float", sfmt="float", D=64, I=64, IS=64, wrong=True)
