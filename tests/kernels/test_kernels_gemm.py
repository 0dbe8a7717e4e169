"""GEMM family (linear, norm_linear, linear_pair) under the Triton interpreter against the op references.

Tolerances: see kernel_check.assert_matches (fp32 summation order only; bf16 within 1 ulp).
act="fp8" is checked against spec 13.1 written with the project's own helper (`formats.fp8_qdq`: per
token, per 128 K values, UE8M0 scale, RTNE e4m3) feeding the op reference, unless the registry already
declares `act` (then the registry reference itself is used).
"""

from __future__ import annotations

import kernel_check as kc  # sets TRITON_INTERPRET=1 before any kernel module is imported
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.formats import fp4_quant, fp8_block_quant, fp8_qdq
from v4compile.ir.registry import get_op


def _weights(fmt: str, n: int, k: int, g: torch.Generator, wdtype=torch.float32):
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "float":
        return w.to(wdtype), None, 128
    if fmt == "fp8":
        q, s = fp8_block_quant(w, 128)
        return q, s, 128
    if fmt == "fp8-f32scale":
        q, s = fp8_block_quant(w, 128)
        return q, torch.exp2(s.float() - 127) * 1.0, 128
    q, s = fp4_quant(w, 32)
    return q, s, 32


def _ref(op: str, args: dict, attrs: dict, act: str) -> torch.Tensor:
    if act == "fp8" and "act" not in get_op(op).attrs:
        args = dict(args)
        if op == "norm_linear":
            x = kc.reference("rms_norm", {"x": args.pop("x"), "weight": args.pop("norm")}, {"eps": attrs["eps"]})[0]
            return kc.reference("linear", {**args, "x": fp8_qdq(x, 128)}, {"block": attrs["block"]})[0]
        args["x"] = fp8_qdq(args["x"], 128)
        return kc.reference(op, args, attrs)[0]
    return kc.reference(op, args, {**attrs, "act": act})[0]


def run_case(op, fmt, xdtype, act="native", M=(1, 3), N=80, K=256, pad=0, xstride_pad=0, seed=0, wdtype=None,
             mutate=None):
    g = torch.Generator().manual_seed(seed)
    w, s, block = _weights(fmt, N, K, g, wdtype or xdtype)
    xb = torch.randn(*M, K + xstride_pad, generator=g).to(xdtype)
    x = xb[..., xstride_pad:]  # a strided view that does not start at the buffer's base
    args = {"x": x, "w": w, "scale": s}
    attrs = {"block": block}
    if op == "norm_linear":
        args["norm"] = (1.0 + 0.1 * torch.randn(K, generator=g)).to(xdtype)
        attrs["eps"] = 1e-6
    ref = _ref(op, args, attrs, act)
    y, buf = kc.poisoned((*M, N), xdtype, pad)
    call_attrs = {**attrs, **({"act": act} if act != "native" else {})}
    if mutate is None:
        calls = kernels.launch(op, args, call_attrs, {"y": y})
    else:
        calls = kernels.specialise_tensors(op, args, call_attrs, {"y": y})
        for c in calls:
            mutate(c)
        kernels.run_calls(calls, args, {"y": y})
    if pad:
        assert buf[..., N:].float().isnan().all(), "kernel wrote outside its (strided) result"
    kc.assert_matches(y, ref, f"{op} {fmt} {xdtype} act={act}")
    return calls


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["float", "fp8", "fp4"])
def test_linear_native(fmt, xdtype):
    run_case("linear", fmt, xdtype, N=80 if fmt != "fp8" else 200, K=256 if fmt == "fp4" else 320, pad=3)


def test_linear_mixed_weight_dtype_and_fp32_scales():
    run_case("linear", "float", torch.bfloat16, wdtype=torch.float32, N=33, K=100)
    run_case("linear", "fp8-f32scale", torch.bfloat16, N=130, K=256)


@pytest.mark.parametrize("fmt", ["float", "fp8", "fp4"])
def test_linear_act_fp8(fmt):
    run_case("linear", fmt, torch.bfloat16, act="fp8", N=144, K=256)


def test_linear_many_tokens_strided_input():
    calls = run_case("linear", "fp8", torch.bfloat16, M=(2, 35), N=96, K=256, xstride_pad=5, pad=2)
    assert calls[0].grid[1] == 2 and "x_ptr" in calls[0].unaligned


@pytest.mark.parametrize("fmt,xdtype,act", [("fp8", torch.bfloat16, "native"), ("float", torch.float32, "native"),
                                            ("fp8", torch.bfloat16, "fp8"), ("fp4", torch.float32, "native")])
def test_norm_linear(fmt, xdtype, act):
    run_case("norm_linear", fmt, xdtype, act=act, N=72, K=256)


def test_fp32_logits_out_dtype():
    """The head: bf16 activations, fp32 logits (out_dtype="fp32" once the registry has it): the kernel
    follows the result's dtype; the reference's bf16 result must be within 1 bf16 ulp of it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(50, 128, generator=g) * 0.05).to(torch.bfloat16)
    y, _ = kc.poisoned((2, 1, 50), torch.float32)
    kernels.launch("linear", {"x": x, "w": w, "scale": None}, {"block": 128}, {"y": y})
    ref = x.float() @ w.float().T
    kc.assert_matches(y, ref, "fp32 logits")


@pytest.mark.parametrize("wrong", ["k", "eps", "scale"])
def test_wrong_kernel_is_caught(wrong):
    def mutate(c):
        if wrong == "k":
            c.constexprs["K"] -= 32  # drops the last K columns
        elif wrong == "eps":
            c.constexprs["EPS"] = 0.5
        else:
            c.constexprs["S_RS"] += 1  # reads the wrong scale row
    op = "norm_linear" if wrong == "eps" else "linear"
    with pytest.raises(AssertionError):
        run_case(op, "fp8", torch.bfloat16, N=200, K=256, mutate=mutate)


def test_names_are_deterministic_and_unique():
    x = kernels.TensorArg.of(torch.zeros(1, 4, 256, dtype=torch.bfloat16))
    w8, s8 = fp8_block_quant(torch.randn(256, 256), 128)
    from v4compile.codegen.kernels import gemm
    y = kernels.TensorArg.of(torch.zeros(1, 4, 256, dtype=torch.bfloat16))
    ops = {"x": x, "w": kernels.TensorArg.of(w8), "scale": kernels.TensorArg.of(s8)}
    a = gemm.specialise("linear", ops, {"y": y}, {"block": 128})[0]
    b = gemm.specialise("linear", ops, {"y": y}, {"block": 128})[0]
    c = gemm.specialise("linear", ops, {"y": y}, {"block": 128, "act": "fp8"})[0]
    assert a.name == b.name and a.name != c.name
    assert a.signature()["x_ptr"] == "*bf16" and a.signature()["M"] == "constexpr"


@pytest.mark.parametrize("op,fmt,xdtype", [("linear", "fp8", torch.bfloat16), ("norm_linear", "float", torch.float32),
                                            ("linear", "fp4", torch.bfloat16)])
def test_split_k(op, fmt, xdtype):
    """Few output tiles and a long K: the K range is split over programs (fp32 partials in scratch) and the
    last program of each tile to arrive adds the partials in split order, in the same call (run_calls
    also checks the arrival counters are left zero)."""
    calls = run_case(op, fmt, xdtype, N=72, K=640, pad=2)
    assert len(calls) == 1 and calls[0].constexprs["SPLIT"] == 2
    assert [p[1] for p in calls[0].pointers if p[0] in ("part_ptr", "sem_ptr")] == ["scratch", "semaphore"]


@pytest.mark.parametrize("old,new,error", [
    ("last_to_arrive(sem_ptr + tile, SPLIT)", "last_to_arrive(sem_ptr + tile, SPLIT + 1)", kernels.CodegenError),  # no program reduces (nor resets)
    ("tl.store(sem_ptr + tile, 0)", "pass", kernels.CodegenError),  # counters left set: the next call breaks
    ("for s in range(SPLIT):", "for s in range(SPLIT - 1):", AssertionError),  # a partial left out
])
def test_split_k_broken_reduction_is_caught(monkeypatch, tmp_path, old, new, error):
    from v4compile.codegen.kernels import gemm
    kc.install_broken_kernel(monkeypatch, tmp_path, gemm, "gemm_program", old, new)
    with pytest.raises(error):
        run_case("linear", "fp8", torch.bfloat16, N=72, K=640, pad=2)


# ---- linear_pair: two GEMMs of one input in one launch ---------------------------------------------

def run_pair(K=640, N0=72, N1=40, xdtype=torch.bfloat16, M=(2, 3)):
    """An FP8 GEMM with FP8 activations (split K: 2) and a float one with native activations (split K: 2)
    of one x: each half against its own `linear` reference; results poisoned first (padded rows stay NaN)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*M, K, generator=g).to(xdtype)
    w0, s0, _ = _weights("fp8", N0, K, g)
    w1, _, _ = _weights("float", N1, K, g, xdtype)
    args = {"x": x, "w0": w0, "w1": w1, "scale0": s0, "scale1": None}
    attrs = {"act0": "fp8", "act1": "native"}
    refs = kc.reference("linear_pair", args, attrs)
    assert torch.equal(refs[0], kc.reference("linear", {"x": x, "w": w0, "scale": s0}, {"act": "fp8"})[0])
    y0, b0 = kc.poisoned((*M, N0), xdtype, 2)
    y1, b1 = kc.poisoned((*M, N1), xdtype, 2)
    calls = kernels.launch("linear_pair", args, attrs, {"y0": y0, "y1": y1})
    assert b0[..., N0:].float().isnan().all() and b1[..., N1:].float().isnan().all()
    kc.assert_matches(y0, refs[0], "linear_pair y0 (fp8)")
    kc.assert_matches(y1, refs[1], "linear_pair y1 (float)")
    return calls


def test_linear_pair_scratch_regions_do_not_overlap():
    """Both halves split K in two and reduce in-launch; the second half's partials and counters start where
    the first half's end. (The interpreter runs
    programs one by one, so halves sharing a region would pass the numerics above: this is checked here.)"""
    (call,) = run_pair()
    ce, (m0, m1) = call.constexprs, (2 * 3, 2 * 3)
    assert ce["SPLIT0"] == 2 and ce["SPLIT1"] == 2
    part0 = ce["SPLIT0"] * m0 * ce["NT0"]
    tiles0 = -(-ce["N0"] // ce["BN0"]) * -(-m0 // ce["BM"])
    assert (ce["PART1"], ce["SEM1"]) == (part0, tiles0)
    assert call.scratch_bytes == {"gemm_partial": 4 * (part0 + ce["SPLIT1"] * m1 * ce["NT1"]),
                                  "gemm_arrivals": 4 * (tiles0 + -(-ce["N1"] // ce["BN1"]) * -(-m1 // ce["BM"]))}


# (Faults that move a program's tile out of its half write out of bounds: not faults to run on the host.)
def test_linear_pair_broken_half_is_caught(monkeypatch, tmp_path):
    from v4compile.codegen.kernels import gemm
    kc.install_broken_kernel(monkeypatch, tmp_path, gemm, "gemm_pair_kernel", "ACT1, CDT1", "ACT0, CDT1")
    with pytest.raises(AssertionError, match="y1"):  # the second GEMM takes the first's FP8 activations
        run_pair()
