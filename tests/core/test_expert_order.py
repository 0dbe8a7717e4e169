"""Where the routing weight enters a routed expert (`v4-reference.md` 10, 13.1), checked against a float64
implementation written here from the spec, not from the project's code.

Official numerics (DeepSeek's code) multiply the routing weight into w2's fp32 input, so the weight sits
inside w2's 1x128 activation quantisation: `w2(act_quant(w * h))`; transformers multiply w2's output,
`w2(act_quant(h)) * w`. The two differ unless w is a power of two, so the inputs here are hand-made: routing
weights that are not powers of two, activations whose 128-blocks and elements span magnitudes, FP4 expert
weights exactly on the e2m1 grid (so the float64 weights are the checkpoint's, with no rounding of ours).

Tolerance RTOL = 1e-5 of the output's max: the op runs fp32 GEMMs on values the float64 version holds
exactly (e4m3 x power of two, e2m1 x power of two), so they differ by fp32 rounding of the GEMM sums, the
SwiGLU and the weight product (~K * 2^-24 relative, K = 256; measured 6e-8). The other order misses by
> 100x the tolerance (measured 3.8e-2 of the output's max).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from v4compile.formats import fp4_dequant, fp4_quant
from v4compile.ops.moe import moe_experts

pytestmark = pytest.mark.isa  # exact on torch's CPU kernels: CI runs it again under a second instruction set

RTOL = 1e-5
L = 10.0  # swiglu_limit
D, INTER, E = 256, 256, 3
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---- the independent float64 implementation (spec 10, 13.1) ------------------------------------------

def e4m3(v: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3fn value, ties to even (|v| <= 448 here): 3 mantissa bits, exponents down
    to -6, subnormal step 2^-9."""
    a = np.abs(v)
    _, ex = np.frexp(np.where(a > 0, a, 1.0))  # a = m 2^ex, m in [0.5, 1)
    step = np.exp2(np.maximum(ex - 1, -6) - 3)
    return np.sign(v) * np.round(a / step) * step  # np.round: half to even


def act_quant(v: np.ndarray) -> np.ndarray:
    """Spec 13.1 on one row, dequantised: per 128-block s = 2^ceil(log2(max(amax, 1e-4) / 448)),
    q = e4m3(clamp(v / s, -448, 448)); returns q * s."""
    out = np.empty_like(v)
    for b in range(0, v.size, 128):
        blk = v[b:b + 128]
        r = max(float(np.abs(blk).max()), 1e-4) / 448.0
        m, ex = math.frexp(r)  # ceil(log2 r), exact
        s = 2.0 ** (ex - 1 if m == 0.5 else ex)
        out[b:b + 128] = e4m3(np.clip(blk / s, -448.0, 448.0)) * s
    return out


def silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def expert(x: np.ndarray, w: float, W1: np.ndarray, W2: np.ndarray, W3: np.ndarray, order: str) -> np.ndarray:
    """One routed expert with its routing weight; `order` "official": w2(act_quant(w h)), "hf": w2(act_quant(h)) w."""
    xq = act_quant(x)
    h = silu(np.minimum(W1 @ xq, L)) * np.clip(W3 @ xq, -L, L)
    if order == "official":
        return W2 @ act_quant(w * h)
    return (W2 @ act_quant(h)) * w


def mix(x, weights, indices, W1, W2, W3, order):
    """y_t = sum_k Expert_{indices[t, k]}(x_t) weighted by weights[t, k] (spec 10, no shared expert)."""
    return np.stack([sum(expert(x[t], weights[t, j], W1[e], W2[e], W3[e], order) for j, e in enumerate(row))
                     for t, row in enumerate(indices)])


# ---- hand-made inputs ------------------------------------------------------------------------------------

def activations(n: int, seed: int) -> np.ndarray:
    """Rows whose 128-blocks have different magnitudes and whose elements span 5 decades inside a block."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, D)) * 10.0 ** r.uniform(-3, 2, (n, D))
    x[:, 128:] *= 0.02
    return x


def fp4_experts(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """E experts on the e2m1 grid: each 1x32 block has a power-of-two scale and holds +-6 once, so packing
    is exact. Returns the packed weight, its E8M0 scales and the float64 values."""
    r = np.random.default_rng(seed)
    vals = np.array(E2M1)[r.integers(0, 8, (E, out_f, in_f))] * r.choice([-1.0, 1.0], (E, out_f, in_f))
    vals[:, :, ::32] = 6.0 * r.choice([-1.0, 1.0], (E, out_f, in_f // 32))
    w = vals * np.repeat(2.0 ** r.integers(-8, -4, (E, out_f, in_f // 32)), 32, axis=2)
    packed = [fp4_quant(torch.tensor(w[e], dtype=torch.float32), 32) for e in range(E)]
    for e, (q, s) in enumerate(packed):
        assert np.array_equal(fp4_dequant(q, s, 32).double().numpy(), w[e])  # the inputs are what we think
    return torch.stack([q for q, _ in packed]), torch.stack([s for _, s in packed]), w


@pytest.fixture(scope="module")
def case():
    W1q, W1s, W1 = fp4_experts(INTER, D, 1)
    W3q, W3s, W3 = fp4_experts(INTER, D, 2)
    W2q, W2s, W2 = fp4_experts(D, INTER, 3)
    x = activations(5, 0)
    # routing weights as the router makes them (s / sum(s) * route_scale): none a power of two
    weights = np.array([[0.37, 1.13], [0.9, 0.61], [1.41, 0.09], [0.77, 0.73], [1.2, 0.3]])
    indices = np.array([[2, 0], [0, 1], [1, 2], [0, 2], [1, 0]])  # slots not in expert order, every expert used
    args = dict(x=torch.tensor(x, dtype=torch.float32), weights=torch.tensor(weights, dtype=torch.float32),
                indices=torch.tensor(indices), w1=W1q, w2=W2q, w3=W3q, w1_scale=W1s, w2_scale=W2s, w3_scale=W3s)
    # the float64 side takes the fp32 inputs the op sees
    return args, dict(x=args["x"].double().numpy(), weights=args["weights"].double().numpy(), indices=indices,
                      W1=W1, W2=W2, W3=W3)


def rel(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.abs(got.double().numpy() - want).max() / np.abs(want).max())


def op(args, route_weight, **over):
    a = {**args, **over}
    return moe_experts(a["x"], a["weights"], a["indices"], a["w1"], a["w2"], a["w3"], a["w1_scale"], a["w2_scale"],
                       a["w3_scale"], limit=L, block=32, act="fp8", route_weight=route_weight)


def test_the_inputs_exercise_the_order(case):
    """The two orders differ on these inputs (else nothing below could fail): by far more than RTOL."""
    _, f = case
    assert not np.any(np.log2(f["weights"]) == np.round(np.log2(f["weights"])))
    diff = np.abs(mix(**f, order="official") - mix(**f, order="hf")).max() / np.abs(mix(**f, order="hf")).max()
    assert diff > 100 * RTOL, diff


def test_the_e4m3_rounding_here_is_the_formats():
    """The float64 rounding above agrees with torch's e4m3fn cast (what the hardware conversion does)."""
    r = np.random.default_rng(7)
    v = np.clip(r.standard_normal(20000) * np.exp2(r.uniform(-14, 9, 20000)), -448, 448)
    assert np.array_equal(e4m3(v), torch.tensor(v).to(torch.float8_e4m3fn).double().numpy())


def test_one_expert_official_order(case):
    args, f = case
    x0, w0, e0 = f["x"][0], f["weights"][0, 0], f["indices"][0, 0]
    want = expert(x0, w0, f["W1"][e0], f["W2"][e0], f["W3"][e0], "official")
    one = dict(x=args["x"][:1], weights=args["weights"][:1, :1], indices=args["indices"][:1, :1])
    assert rel(op(args, "before_w2", **one)[0], want) < RTOL
    assert rel(op(args, "after_w2", **one)[0], want) > 100 * RTOL  # the old order misses


def test_expert_mix_official_order(case):
    args, f = case
    want = mix(**f, order="official")
    assert rel(op(args, "before_w2"), want) < RTOL
    assert rel(op(args, "after_w2"), want) > 100 * RTOL


def test_expert_mix_hf_order(case):
    """`after_w2` is HF's order, also exact to its own float64 model (the attribute selects, not breaks)."""
    args, f = case
    assert rel(op(args, "after_w2"), mix(**f, order="hf")) < RTOL


def test_triton_kernel_official_order(case):
    """The Triton MoE kernels (interpreter) on the same inputs, against the same float64 model."""
    from v4compile.codegen import kernels

    args, f = case
    want = mix(**f, order="official")
    for route, ok in (("before_w2", True), ("after_w2", False)):
        y = torch.full(args["x"].shape, float("nan"))
        kernels.launch("moe_experts", args, {"limit": L, "block": 32, "act": "fp8", "route_weight": route}, {"y": y})
        assert (rel(y, want) < RTOL) == ok, (route, rel(y, want))


def test_the_tracer_sets_the_order_from_the_numerics_mode():
    """And the router's numerics: official routes in fp32 (spec 15 item 7) and without HF's 1e-20 in the
    denominator (item 14); the q norm's mean (item 10)."""
    from v4compile.config import preset
    from v4compile.trace import TraceOptions, trace

    for numerics, want, eps in (("official", "before_w2", 0.0), ("hf", "after_w2", 1e-20)):
        m = trace(preset("tiny"), TraceOptions(numerics=numerics, batch=1, chunk=4, decode_batch=1, capacity=32))
        ops = [op for fn in m.functions.values() for op in fn.ops]
        got = {op.attrs["route_weight"] for op in ops if op.name == "moe_experts"}
        assert got == {want}, (numerics, got)
        assert {(op.attrs["denom_eps"], op.attrs["fp32"]) for op in ops if op.name == "router"} == {(eps, eps == 0.0)}
        # and the per-head q norm's statistic (item 10): in the activation dtype under official
        assert {op.attrs["mean"] for op in ops if op.name == "rms_norm" and op.operand("weight") is None} == \
            {"dtype" if numerics == "official" else "fp32"}
