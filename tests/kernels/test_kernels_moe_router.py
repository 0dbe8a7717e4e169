"""moe_router family (`moe_router_experts_shared`: router + shared expert + routed experts) under the
interpreter against the two ops it replaces, the router and moe_experts_shared kernels run apart.

Decode-sized P (scan mode): the router is the first phase of the routed up launch, so the op makes two
calls, and y must be bit-identical to the router's and moe's kernels run one after the other (same
arithmetic in the same order, nothing to tolerate) and match the op's reference within
kernel_check.assert_matches (2 bf16 ulps as in test_kernels_moe). Prefill-sized P (grouped mode): the
router keeps its own launch (four calls, the same kernels as apart), checked against the reference. Learned and hash routing, fp32 and bf16 (a bf16 router: the bias sum in bf16),
FP4 / FP8 and float weights. Every scratch starts as NaN and every counter must end at 0 (run_calls), and
deliberately broken variants of the fused kernel are caught: router programs that route the wrong row
block (a token block left unrouted), the ticket counter left set, routed programs that run another
expert's pairs (odd experts never run). That the routed programs wait for the router is shown on the source (the interpreter runs
programs in ticket order, so a missing wait cannot fail there). The gfx950 binary of the fused kernel takes
only the parameters its call describes (the router phase is inlined there: a noinline call would add AMDGPU's
hidden kernel arguments), and the AOT stage refuses a binary that takes hidden arguments.
"""

from __future__ import annotations

import json

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import moe_router
from test_kernels_moe import expert_args


def case(dtype, hashed, efmt="fp4", sfmt="fp8", E=5, D=64, I=64, IS=64, k=2, B=2, T=5, seed=0, fp32=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    args = {"x": x, "gate": (torch.randn(E, D, generator=g) * 0.2).to(dtype), "bias": None, "tid2eid": None,
            "ids": None}
    if hashed:
        args["tid2eid"] = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(9)])  # E - 1 idle
        args["ids"] = torch.randint(0, 9, (B, T), generator=g)
        args["ids"][-1, -1] = -1  # padding
    else:
        args["bias"] = torch.randn(E, generator=g) * 0.5
    args.update(expert_args(efmt, sfmt, E, D, I, IS, g, dtype))
    attrs = {"limit": 1.5, "block": 32 if efmt == "fp4" else 128, "shared_block": 128, "route_weight": "before_w2",
             "k": k, "route_scale": 2.5, "fp32": fp32}
    return args, attrs


def apart(args, attrs):
    """y from the router kernel, then the moe_experts_shared kernels on its results."""
    x, k = args["x"], attrs["k"]
    r_attrs = {n: attrs[n] for n in ("k", "route_scale", "fp32")}
    wts, _ = kc.poisoned((*x.shape[:-1], k), torch.float32 if attrs["fp32"] else x.dtype)
    idx, _ = kc.poisoned((*x.shape[:-1], k), torch.int64)
    kernels.launch("router", {"x": x, "w": args["gate"], **{n: args[n] for n in ("bias", "tid2eid", "ids")}},
                   r_attrs, {"weights": wts, "indices": idx})
    m_args = {n: v for n, v in args.items() if n not in ("gate", "bias", "tid2eid", "ids")}
    y, _ = kc.poisoned(x.shape, x.dtype)
    kernels.launch("moe_experts_shared", {**m_args, "weights": wts, "indices": idx},
                   {n: v for n, v in attrs.items() if n not in r_attrs}, {"y": y})
    return y


def fused(args, attrs):
    y, _ = kc.poisoned(args["x"].shape, args["x"].dtype)
    calls = kernels.launch("moe_router_experts_shared", args, attrs, {"y": y})
    return y, calls


@pytest.mark.parametrize("dtype,hashed,fmts,fp32", [
    (torch.float32, False, ("float", "float"), False),
    (torch.bfloat16, True, ("fp4", "fp8"), False),
    (torch.bfloat16, False, ("float", "float"), True),  # official numerics: an fp32 router on bf16 activations
], ids=["fp32-learned-float", "bf16-hash-fp4", "bf16-learned-float-fp32router"])
def test_fused_decode_equals_the_ops_apart(dtype, hashed, fmts, fp32):
    args, attrs = case(dtype, hashed, *fmts, fp32=fp32)
    y, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["moe_router_up_kernel", "moe_down_kernel"]
    assert calls[0].grid[0] == 1 + 1 + 5 * 1  # NR router blocks + ST shared tiles + E x RT routed tiles
    assert torch.equal(y, apart(args, attrs)), "the fused launches differ from the router + moe kernels"
    kc.assert_matches(y, kc.reference("moe_router_experts_shared", args, attrs)[0], "moe_router_experts_shared",
                      ulps=2)


def test_grouped_prefill_keeps_the_router_launch():
    args, attrs = case(torch.float32, False, "float", "float", B=1, T=33, k=2)  # P = 66 > SCAN_MAX_PAIRS
    y, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["router_kernel", "moe_group_kernel", "moe_up_kernel", "moe_down_kernel"]
    kc.assert_matches(y, kc.reference("moe_router_experts_shared", args, attrs)[0], "grouped", ulps=2)


BROKEN = {
    # every router program routes the first row block (T = 20 tokens: 2 blocks of BR = 16): the last tokens'
    # routing stays poison
    "unrouted block": ("_route_phase(v,", "_route_phase(v * 0,", AssertionError),
    # the ticket counter is never reset: the next call of the program would start at the wrong ticket
    "ticket kept": ("tl.store(phase_ptr, 0)", "pass", kernels.CodegenError),
    # the routed programs map to the wrong experts: odd experts never run (their h rows stay poison)
    "wrong expert": ("_up(w // RT, w % RT,", "_up(w // RT // 2 * 2, w % RT,", AssertionError),
}


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_broken_fused_kernel_is_caught(fault, monkeypatch, tmp_path):
    old, new, error = BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, moe_router, "moe_router_up_kernel", old, new)
    args, attrs = case(torch.float32, True, "float", "float", B=1, T=20)
    ref = kc.reference("moe_router_experts_shared", args, attrs)[0]
    with pytest.raises(error):
        y, _ = fused(args, attrs)
        kc.assert_matches(y, ref, fault)


def test_routed_programs_wait_for_every_router_program():
    """The wait cannot be shown wrong by running it (the interpreter runs programs in ticket order), so the
    kernel is checked to wait for all NR router programs before the routed programs' work, and the
    router programs to publish after theirs."""
    import inspect
    src = inspect.getsource(moe_router.moe_router_up_kernel.fn)
    route, pub = src.index("_route_phase(v,"), src.index("publish(phase_ptr + 1)")
    wait, routed = src.index("wait_for(phase_ptr + 1, NR)"), src.index("_up(w // RT")
    assert route < pub < wait < routed


@pytest.mark.slow
def test_gfx950_binary_takes_only_the_calls_parameters(tmp_path, monkeypatch):
    """The router phase is a noinline call on sm_90a only (kernels/__init__.py: CALLS_PARAM): called on gfx950, the kernel
    grows AMDGPU's hidden kernel arguments behind the pointers the call describes (the launch's parameter
    array would not cover them; the fake HIP driver refuses the launch); the AOT stage records them."""
    from v4compile.codegen import aot

    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path / "cache"))
    args, attrs = case(torch.float32, True, "float", "float")
    _, calls = fused(args, attrs)
    rows = aot.compile_calls(calls[:1], ["gfx950"], tmp_path / "ok", jobs=1)
    side = json.loads((tmp_path / "ok" / rows[0]["sidecar"]).read_text())
    assert side["constexprs"]["CALLS"] is False and b"hidden_" not in (tmp_path / "ok" / rows[0]["path"]).read_bytes()
    assert rows[0]["hidden_args"] == 0, rows[0]
    monkeypatch.setattr(aot, "uses_calls", lambda target: True)  # the call kept on gfx950: the fault shows
    rows = aot.compile_calls(calls[:1], ["gfx950"], tmp_path / "called", jobs=1)
    assert rows[0]["hidden_args"] > 0 and b"hidden_" in (tmp_path / "called" / rows[0]["path"]).read_bytes()
