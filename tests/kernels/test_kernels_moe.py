"""moe family (moe_experts_shared, moe_experts) under the interpreter vs the op references.

Cases: FP4 routed experts (1x32 E8M0) + FP8 shared expert (128x128 E8M0), bf16 (dot_scaled path) and
fp32 (exact nibble-decode path); float experts; act="fp8"; an idle expert, a token whose slots are not
in expert order, and a hash-style duplicate-free routing. Tolerance: kernel_check.assert_matches — the
kernels round to x's dtype at every point the reference does (GEMM outputs, silu, product, weight,
each index_add_ step in ascending expert order, the final + shared), so what remains is fp32 summation
order inside each GEMM (1 bf16 ulp at a rounding boundary, which can propagate once: 2 ulps allowed).
act="fp8" reference: spec 13.1 applied to each GEMM input with `formats.fp8_qdq` (the registry's moe
ops do not declare `act` yet). route_weight "before_w2" (official: the weight inside w2's activation
quantisation) matches the reference the same way, and a kernel run with the other order is caught.

Grouping (prefill-sized P, the grouping launch): hash and learned routing from the router reference with
idle experts and experts of more than one BM tile, the same tolerances, and bit-identical to the in-register
scan path; a wrong grouping kernel is caught; instrumented interpreter loads show every active expert's
weights are read once per BM pairs routed to it (and a kernel cut into smaller tiles is caught); the
V4-Pro prefill specialisations compile for gfx950 and sm_90a with matrix instructions and no gfx950 spills.
"""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch
import torch.nn.functional as F


from v4compile.codegen import kernels
from v4compile.codegen.kernels import moe
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
        B=2, T=3, seed=0, wrong=None, shared_act="native", route="after_w2"):
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
    attrs = {"limit": 1.5, "block": 32 if efmt == "fp4" else 128, "route_weight": route}
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
    if wrong == "route":
        call_attrs["route_weight"] = "after_w2" if route == "before_w2" else "before_w2"
    elif wrong:
        call_attrs["limit"] = 0.5
    calls = kernels.launch(op, args, call_attrs, {"y": y})
    kc.assert_matches(y, ref, f"{op} {efmt}/{sfmt} {dtype} act={act}", ulps=2)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_experts_fp8_shared(dtype):
    calls = run(dtype)
    assert [c.fn.__name__ if hasattr(c.fn, "__name__") else c.fn.fn.__name__ for c in calls] == [
        "moe_up_kernel", "moe_down_kernel"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_experts_float_shared(dtype):
    # fp32: 18 tokens x 3 slots, several pair chunks per expert program and two token tiles in the combine
    run(dtype, efmt="float", sfmt="float", D=64, I=96, IS=80, k=3, E=6, T=9 if dtype == torch.float32 else 3)


@pytest.mark.parametrize("shared_act", ["native", "fp8"])
def test_act_fp8(shared_act):
    run(torch.bfloat16, act="fp8", shared_act=shared_act)


def test_moe_experts_without_shared():
    run(torch.bfloat16, op="moe_experts", efmt="float", D=64, I=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_weight_before_w2(dtype):
    # official order: the weight scales w2's input inside its 1x128 quantisation (FP4 experts, act fp8)
    run(dtype, act="fp8", shared_act="fp8", route="before_w2")


@pytest.mark.parametrize("route", ["after_w2", "before_w2"])
def test_wrong_route_weight_is_caught(route):
    # the kernel run with the other order misses the reference (weights from rand: not powers of two)
    with pytest.raises(AssertionError):
        run(torch.float32, act="fp8", route=route, wrong="route")


def test_wrong_limit_is_caught():
    with pytest.raises(AssertionError):
        run(torch.float32, efmt="float", sfmt="float", D=64, I=64, IS=64, wrong=True)


# ---- grouping: prefill-like shapes where many pairs share an expert ------------------------------------
# P = 29 tokens x 3 slots = 87 pairs (> SCAN_MAX_PAIRS, so the grouping launch runs; not a multiple of BM),
# E = 7 experts (not a power of two), experts 3 and 6 never routed, some experts with more than BM pairs
# (two tiles). The routing comes from the router op's reference, hash (tid2eid[ids], a 4-row table so
# tokens share expert sets) or learned (top-k of s + bias, the bias favouring experts 0 and 1).

def _routing(kind, x, E, k, g):
    M = x.shape[0] * x.shape[1]
    if kind == "hash":
        pool = torch.tensor([0, 1, 2, 4, 5])
        table = torch.stack([pool[torch.randperm(5, generator=g)[:k]] for _ in range(4)])
        ids = torch.randint(0, 4, (x.shape[0], x.shape[1]), generator=g)
        args = {"x": x, "w": (torch.randn(E, x.shape[-1], generator=g) * 0.2).to(x.dtype), "bias": None,
                "tid2eid": table, "ids": ids}
    else:
        bias = torch.tensor([4.0, 4.0, 0.0, -100.0, 0.0, 0.0, -100.0])
        args = {"x": x, "w": (torch.randn(E, x.shape[-1], generator=g) * 0.2).to(x.dtype), "bias": bias,
                "tid2eid": None, "ids": None}
    wts, idx = kc.reference("router", args, {"k": k, "route_scale": 2.5})
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    assert counts[3] == counts[6] == 0 and (counts[[0, 1, 2, 4, 5]] > 0).all() and counts.max() > moe.BM, counts
    return wts, idx


def expert_args(efmt, sfmt, E, D, I, IS, g, dtype) -> dict:
    """The routed experts (w1, w3 [E, I, D], w2 [E, D, I]) and the shared expert (s1, s3 [IS, D], s2 [D, IS])
    with their scales, as moe_experts_shared takes them."""
    w1, w1s = _experts(efmt, E, I, D, g)
    w3, w3s = _experts(efmt, E, I, D, g)
    w2, w2s = _experts(efmt, E, D, I, g)
    if efmt != "fp4":
        w1, w3, w2 = w1.to(dtype), w3.to(dtype), w2.to(dtype)
    s1, s1s = _shared(sfmt, IS, D, g, dtype)
    s3, s3s = _shared(sfmt, IS, D, g, dtype)
    s2, s2s = _shared(sfmt, D, IS, g, dtype)
    return {"w1": w1, "w2": w2, "w3": w3, "w1_scale": w1s, "w2_scale": w2s, "w3_scale": w3s, "s1": s1, "s2": s2,
            "s3": s3, "s1_scale": s1s, "s2_scale": s2s, "s3_scale": s3s}


def prefill_case(dtype, routing="hash", efmt="fp4", sfmt="fp8", E=7, D=64, I=96, IS=64, k=3, B=1, T=29, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    wts, idx = _routing(routing, x, E, k, g)
    args = {"x": x, "weights": wts, "indices": idx, **expert_args(efmt, sfmt, E, D, I, IS, g, dtype)}
    attrs = {"limit": 1.5, "block": 32 if efmt == "fp4" else 128, "shared_block": 128}
    return args, attrs


def launch_calls(args, attrs, patch=None, op="moe_experts_shared"):
    """Poisoned y from the op's calls; `patch(calls)` may swap a call's kernel first."""
    y, _ = kc.poisoned(args["x"].shape, args["x"].dtype)
    calls = kernels.specialise_tensors(op, args, attrs, {"y": y})
    if patch:
        patch(calls)
    kernels.run_calls(calls, args, {"y": y})
    return y, calls


# (bf16, hash, FP4 / FP8) runs in test_weights_read_once_per_tile, with the same numerics check
@pytest.mark.parametrize("dtype,routing,fmts", [(torch.float32, "hash", ("fp4", "fp8")),
                                                (torch.bfloat16, "learned", ("fp4", "fp8")),
                                                (torch.float32, "learned", ("float", "float")),
                                                (torch.bfloat16, "hash", ("float", "float"))],
                         ids=["fp32-hash-fp4", "bf16-learned-fp4", "fp32-learned-float", "bf16-hash-float"])
def test_grouped_prefill(dtype, routing, fmts, monkeypatch):
    args, attrs = prefill_case(dtype, routing, *fmts)
    y, calls = launch_calls(args, attrs)
    assert [c.kernel_name for c in calls] == ["moe_group_kernel", "moe_up_kernel",
                                              "moe_down_kernel"]
    kc.assert_matches(y, kc.reference("moe_experts_shared", args, attrs)[0], f"grouped {fmts} {routing} {dtype}",
                      ulps=2)
    # the in-register scan walks the same lists: bit-identical results, one launch fewer
    monkeypatch.setattr(moe, "SCAN_MAX_PAIRS", 10 ** 9)
    ys, scalls = launch_calls(args, attrs)
    assert [c.kernel_name for c in scalls][0] == "moe_up_kernel"
    assert torch.equal(y, ys), "grouped and scan paths differ"


def test_grouped_act_fp8():
    args, attrs = prefill_case(torch.bfloat16, "learned")
    attrs = {**attrs, "act": "fp8", "shared_act": "fp8"}
    y, calls = launch_calls(args, attrs)
    assert calls[0].kernel_name == "moe_group_kernel"
    kc.assert_matches(y, kc.reference("moe_experts_shared", args, attrs)[0], "grouped act=fp8", ulps=2)


def test_grouped_moe_experts_without_shared():
    args, attrs = prefill_case(torch.bfloat16, "hash", efmt="float")
    args = {n: args[n] for n in ("x", "weights", "indices", "w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")}
    y, calls = launch_calls(args, attrs, op="moe_experts")
    assert calls[0].kernel_name == "moe_group_kernel"
    kc.assert_matches(y, kc.reference("moe_experts", args, attrs)[0], "grouped moe_experts", ulps=2)


# Faults of moe_group_kernel, each one edit of its source (kernel_check.install_broken_kernel)
OFF_BY_ONE = (  # `<=` for `<` in the offsets: expert e gets the range of expert e + 1
    "off += tl.sum((eq[None, :] < e[:, None]).to(tl.int32), axis=1)\n        tl.store(grp_ptr + e, off, mask=e <= E)",
    "off += tl.sum((eq[None, :] <= e[:, None]).to(tl.int32), axis=1)\n"
    "        tl.store(grp_ptr + e, tl.minimum(off, P), mask=e <= E)")
UNSTABLE = (  # the pairs of each expert in descending pair id
    "before = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None]))",
    "before = ((eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (q[None, :] > p[:, None]))) "
    "& (q[None, :] < P)")


def test_wrong_grouping_is_caught(monkeypatch, tmp_path):
    args, attrs = prefill_case(torch.float32, "hash", "float", "float")
    ref = kc.reference("moe_experts_shared", args, attrs)[0]
    # Pair order inside an expert's list is NOT a fault: rows are written by pair id, so a descending
    # order gives the very same bits (the combine order comes from the expert ids, not from the list).
    y_ok, _ = launch_calls(args, attrs)
    kc.install_broken_kernel(monkeypatch, tmp_path, moe, "_group_block", *UNSTABLE)
    y_uns, _ = launch_calls(args, attrs)
    assert torch.equal(y_ok, y_uns)
    kc.assert_matches(y_ok, ref, "grouped")
    monkeypatch.undo()
    kc.install_broken_kernel(monkeypatch, tmp_path, moe, "_group_block", *OFF_BY_ONE)
    y, _ = launch_calls(args, attrs)
    with pytest.raises(AssertionError):
        kc.assert_matches(y, ref, "off-by-one offsets")


# ---- structure: each active expert's weights are read once per BM pairs routed to it --------------------

def _weight_reads(args, attrs, monkeypatch, names=("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale")):
    """Run the op under the interpreter counting, for every element of the named weights, how many times a
    kernel loaded it (masked-off lanes not counted); returns name -> [E, elements per expert] counts."""
    with kc.counted_loads(monkeypatch, {n: args[n] for n in names}) as counts:
        y, calls = launch_calls(args, attrs)
    kc.assert_matches(y, kc.reference("moe_experts_shared", args, attrs)[0], "counted run", ulps=2)
    E = args["w1"].shape[0]
    return {n: c.reshape(E, -1) for n, c in counts.items()}, calls


def _assert_once_per_tile(reads, idx, E, bm=16):
    tiles = (torch.bincount(idx.reshape(-1), minlength=E) + bm - 1) // bm
    for n, c in reads.items():
        for e in range(E):
            got = sorted(set(c[e].tolist()))
            assert got == [int(tiles[e])], f"{n} of expert {e}: elements read {got} times, want {int(tiles[e])}"


@pytest.mark.parametrize("scan", [False, True])
def test_weights_read_once_per_tile(scan, monkeypatch):
    """bf16 activations, FP4 experts (the dot_scaled path: one load per weight byte and scale per tile).
    Experts 3 and 6 idle (0 reads), one or two tiles for the others: never one read per chunk of pairs."""
    args, attrs = prefill_case(torch.bfloat16, "hash")
    if scan:
        monkeypatch.setattr(moe, "SCAN_MAX_PAIRS", 10 ** 9)
    reads, calls = _weight_reads(args, attrs, monkeypatch)
    assert (calls[0].kernel_name == "moe_group_kernel") != scan
    _assert_once_per_tile(reads, args["indices"], 7)


def test_weight_rereads_are_caught(monkeypatch):
    """The same check on kernels cut into 8-pair tiles (an expert with 9..16 pairs reads its weights twice)."""
    args, attrs = prefill_case(torch.bfloat16, "hash")
    monkeypatch.setattr(moe, "BM", 8)
    reads, _ = _weight_reads(args, attrs, monkeypatch)
    with pytest.raises(AssertionError, match="read"):
        _assert_once_per_tile(reads, args["indices"], 7)


@pytest.mark.parametrize("wrong", [None, lambda E, k, t, ep=1: float(min(E, t * k)),
                                           lambda E, k, t, ep=1: float(E)],
                         ids=["model", "broken-one-read-per-pair", "broken-every-expert"])
def test_modeled_cost_counts_active_experts_once(monkeypatch, wrong):
    """Modeled bytes of the routed launches: the expected active experts' weights once (so a prefill chunk
    models fewer weight bytes than one read per pair, and a decode step about one expert per pair), and MMA
    rows that bound the padded rows, all against counts over sampled uniform routings (tests/routing_sample:
    within 5 standard errors). The broken variants miscount the experts and must fail the same checks."""
    import contextlib

    from routing_sample import sampled_routing
    from v4compile.codegen.kernels import TensorArg

    if wrong is not None:
        monkeypatch.setattr(moe, "expected_active_experts", wrong)
    checks = pytest.raises(AssertionError) if wrong is not None else contextlib.nullcontext()
    with checks:
        args, attrs = prefill_case(torch.bfloat16, "hash")
        y = torch.empty_like(args["x"])
        calls = {c.kernel_name + ("_shared" if c.constexprs.get("MODE") == "all" else ""): c
                 for c in kernels.specialise_tensors("moe_experts_shared", args, attrs, {"y": y})}
        E, k, M = 7, 3, 29
        per = sum(TensorArg.of(args[n]).type.nbytes for n in ("w1", "w3", "w1_scale", "w3_scale")) / E
        up = calls["moe_up_kernel"]
        # the same launch runs the shared expert over every token: its weights and its read of x, its FLOPs
        shared = sum(TensorArg.of(args[n]).type.nbytes for n in ("s1", "s3", "s1_scale", "s3_scale")
                     if args.get(n) is not None) + args["x"].nbytes
        active = (up.bytes_moved - shared - args["x"].nbytes - M * k * 96 * 2) / per
        rows = (up.flops - 4 * M * args["s1"].shape[0] * 64) / (4 * 96 * 64)
        (a_mean, a_se), (r_mean, r_se) = sampled_routing(E, k, M, moe.BM)
        assert abs(active - a_mean) <= 5 * a_se + 1 / per, (active, a_mean)
        assert r_mean - 5 * r_se <= rows <= M * k + E * (moe.BM - 1), (rows, r_mean)  # bounds the padded rows
        for tokens, lo, hi in ((2, 11.5, 12), (64, 240, 246)):  # V4-Pro decode (2 tokens), a prefill chunk of 64
            a_model, _ = moe._routed_work(384, 6, tokens)
            (a_mean, a_se), _ = sampled_routing(384, 6, tokens, samples=400)
            assert abs(a_model - a_mean) <= 5 * a_se + 1e-9 and lo < a_model <= hi, (tokens, a_model, a_mean)


# ---- AOT: the V4-Pro prefill specialisations compile for both targets, matrix instructions, no gfx950 spills

def _ta(shape, dt):
    from v4compile.codegen.kernels import TensorArg
    from v4compile.ir.types import TensorType
    st, s = [], 1
    for n in reversed(shape):
        st.append(s)
        s *= n
    return TensorArg(TensorType(tuple(shape), dt), tuple(reversed(st)))


def v4pro_calls(M, E=384, k=6, D=7168, I=3072, dt="bf16"):
    """moe_experts_shared as `v4compile ir dump --preset v4-pro --weights none --stage final --func prefill
    --batch 1 --chunk 64 --dtype bf16` has it: FP4 routed experts (1x32 E8M0), FP8 shared (128x128 E8M0)."""
    ops = dict(x=_ta((1, M, D), dt), weights=_ta((1, M, k), dt), indices=_ta((1, M, k), "i64"),
               w1=_ta((E, I, D // 2), "fp4x2"), w3=_ta((E, I, D // 2), "fp4x2"), w2=_ta((E, D, I // 2), "fp4x2"),
               w1_scale=_ta((E, I, D // 32), "e8m0"), w3_scale=_ta((E, I, D // 32), "e8m0"),
               w2_scale=_ta((E, D, I // 32), "e8m0"), s1=_ta((I, D), "fp8e4m3"), s3=_ta((I, D), "fp8e4m3"),
               s2=_ta((D, I), "fp8e4m3"), s1_scale=_ta((I // 128, D // 128), "e8m0"),
               s3_scale=_ta((I // 128, D // 128), "e8m0"), s2_scale=_ta((D // 128, I // 128), "e8m0"))
    return moe.specialise("moe_experts_shared", ops, {"y": _ta((1, M, D), dt)},
                          {"limit": 10.0, "block": 32, "shared_block": 128, "act": "native", "shared_act": "native",
                           "route_weight": "after_w2"})


@pytest.mark.slow
def test_aot_v4pro_prefill_grouped(tmp_path, monkeypatch):
    from v4compile.codegen import aot
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path / "cache"))
    calls = [c for c in v4pro_calls(64) if c.kernel_name in ("moe_group_kernel", "moe_up_kernel", "moe_down_kernel")
             and c.constexprs.get("MODE") != "all"]
    assert [c.kernel_name for c in calls] == ["moe_group_kernel", "moe_up_kernel", "moe_down_kernel"]
    assert calls[0].grid == (6 + 7, 1, 1) and calls[0].scratch_bytes["grp"] == (385 + 384) * 4
    rows = aot.compile_calls(calls, ["gfx950", "sm_90a"], tmp_path / "out", jobs=2)
    for r in rows:
        if r["target"] == "gfx950":
            assert r["spills"] == 0, f"{r['name']}: gfx950 goal is 0 spills"
        if not r["name"].startswith("moe_group"):
            assert r["mma_instructions"] > 0, f"{r['name']} {r['target']}: no matrix instructions"


def test_mode_by_shape():
    """Decode-sized P ranks in registers (2 calls: up with the shared up, down with the combine); above
    SCAN_MAX_PAIRS one grouping
    launch is added and the routed kernels read grp instead of the expert ids."""
    dec, pre = v4pro_calls(10), v4pro_calls(11)  # P = 60 and 66 pairs
    assert [c.kernel_name for c in dec] == ["moe_up_kernel", "moe_down_kernel"]
    assert "grp" not in dec[0].scratch_bytes and dec[0].constexprs["MODE"] == "scan" and dec[0].constexprs["PB"] == 64
    assert [c.kernel_name for c in pre][:2] == ["moe_group_kernel", "moe_up_kernel"]
    assert pre[1].constexprs["MODE"] == "grouped" and pre[1].constexprs["idx_ptr"] is None
    assert [p[2] for p in pre[1].pointers if p[1] == "scratch"] == ["grp", "h", "hs"]  # hs: the shared expert


@pytest.mark.parametrize("old,new,error", [
    # no expert program combines (nor resets its counter)
    ("last_to_arrive(sem_ptr + n_tile, E)", "last_to_arrive(sem_ptr + n_tile, E + 1)", kernels.CodegenError),
    # the last program combines the wrong D tile (D = 256: two tiles)
    ("_combine_column(n_tile,", "_combine_column(n_tile * 0,", AssertionError),
    # the counter is left set: the next call of the program would combine early
    ("tl.store(sem_ptr + n_tile, 0)", "pass", kernels.CodegenError),
])
def test_broken_combine_arrival_is_caught(monkeypatch, tmp_path, old, new, error):
    """The shared down + combine runs in the last expert program of each D tile to arrive."""
    kc.install_broken_kernel(monkeypatch, tmp_path, moe, "moe_down_kernel", old, new)
    with pytest.raises(error):
        run(torch.float32, D=256)


def test_broken_shared_up_is_caught(monkeypatch, tmp_path):
    """The shared expert's gate / up runs in programs (E, I tile) of the routed up launch; a kernel that
    skips its last I tile leaves that part of hs unwritten (NaN scratch) and is caught."""
    kc.install_broken_kernel(monkeypatch, tmp_path, moe, "moe_up_kernel", "if nt * S_BN < S_I:",
                             "if nt * S_BN < S_I - S_BN:")
    with pytest.raises(AssertionError):
        run(torch.float32, IS=256)
