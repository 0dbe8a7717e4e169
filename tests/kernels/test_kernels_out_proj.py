"""out_proj family (`rope_out_proj_linear`: wo_a through its inverse RoPE, then wo_b) under the interpreter
against the launches it replaces: the rope_out_proj (grouped_gemm) and linear (gemm) kernels run one after the
other.

The fused op is one launch (`out_proj_kernel`: wo_a's programs, then wo_b's, ticketed phases), and its result
must be bit-identical to the two launches (each phase is the unfused launch's GEMM body with its tiles, splits
and roundings: nothing to tolerate) and match the op's reference within kernel_check.assert_matches. The
shapes split K in both phases (the split partials and arrival counters of both GEMMs share the launch's
scratch and semaphore). Every scratch starts as NaN and every counter must end at 0 (run_calls); deliberately
broken variants of the fused kernel are caught: wo_b programs on the wrong tiles, the phase counters left
set, wo_a's output read from the wrong place. That every wo_b program waits for every wo_a program is shown
on the source (the interpreter runs programs in ticket order, so a missing wait cannot fail there).
"""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import out_proj
from v4compile.formats import fp8_block_quant

ROT = {"dim": 32, "theta": 10000.0, "yarn": (16.0, 256, 32.0, 1.0)}


def case(dtype, wfmt, act, B=2, T=3, H=8, d=128, G=2, R=256, DM=96, seed=0):
    """wo_a [G * R, H * d / G] (K per group 512: split in two) and wo_b [DM, G * R] (K 512: split in two)."""
    g = torch.Generator().manual_seed(seed)
    o = (2 * torch.randn(B, T, H, d, generator=g)).to(dtype)
    pos = torch.randint(0, 300, (B, T), generator=g)
    pos[1, -1] = -1  # a padding lane
    ws = {}
    for n, shape in (("w", (G * R, H * d // G)), ("wb", (DM, G * R))):
        w = torch.randn(*shape, generator=g) * 0.05
        if wfmt == "fp8":
            ws[n], ws[n + "_s"] = fp8_block_quant(w, 128)
        else:
            ws[n], ws[n + "_s"] = w.to(dtype), None
    out_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype] if act == "fp8" else ""
    args = {"o": o, "pos": pos, "w": ws["w"], "scale": ws["w_s"], "wb": ws["wb"], "wb_scale": ws["wb_s"]}
    attrs = {**ROT, "groups": G, "block": 128, "act": act, "out_dtype": out_dtype, "block_b": 128, "act_b": act,
             "out_dtype_b": out_dtype}
    return args, attrs


def fused(args, attrs):
    B, T = args["o"].shape[:2]
    y, buf = kc.poisoned((B, T, args["wb"].shape[0]), args["o"].dtype, pad=3)
    calls = kernels.launch("rope_out_proj_linear", args, attrs, {"y": y})
    assert buf[..., -3:].float().isnan().all(), "the fused launch wrote past its row"
    return y, calls


def apart(args, attrs):
    """rope_out_proj's launch, then wo_b's linear launch on its output (as the program ran them)."""
    B, T = args["o"].shape[:2]
    a_attrs = {n: attrs[n] for n in ("dim", "theta", "yarn", "groups", "block", "act", "out_dtype")}
    z, _ = kc.poisoned((B, T, args["w"].shape[0]), args["o"].dtype)
    kernels.launch("rope_out_proj", {n: args[n] for n in ("o", "pos", "w", "scale")}, a_attrs, {"z": z})
    y, _ = kc.poisoned((B, T, args["wb"].shape[0]), args["o"].dtype)
    kernels.launch("linear", {"x": z, "w": args["wb"], "scale": args["wb_scale"]},
                   {"block": attrs["block_b"], "act": attrs["act_b"], "out_dtype": attrs["out_dtype_b"]}, {"y": y})
    return y


# fp32 (the debug numerics) and hf numerics on V4's FP8 weights at small shapes; official numerics (both inputs
# quantised FP8) at shapes that split K in both phases
@pytest.mark.parametrize("dtype,wfmt,act", [(torch.float32, "float", "native"), (torch.bfloat16, "fp8", "native"),
                                            (torch.bfloat16, "fp8", "fp8")])
def test_fused_equals_the_launches_apart(dtype, wfmt, act):
    split = act == "fp8"
    args, attrs = case(dtype, wfmt, act, **({} if split else {"H": 4, "d": 64, "R": 64}))
    y, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["out_proj_kernel"]
    ce = calls[0].constexprs
    if split:
        assert ce["A_SPLIT"] == 2 and ce["B_SPLIT"] == 2, "both phases must split K (shared scratch and counters)"
        assert calls[0].grid[0] == ce["PA"] + ce["PB"] == 2 * 2 * 2 + 1 * 2  # (N tiles x groups x splits) + (splits)
    assert torch.equal(y, apart(args, attrs)), "the fused launch differs from rope_out_proj + linear"
    ulps = 2 if act == "fp8" else 1  # wo_a's bf16 output quantised again for wo_b: a rounding flip moves a block
    kc.assert_matches(y, kc.reference("rope_out_proj_linear", args, attrs)[0], f"rope_out_proj_linear {act}",
                      ulps=ulps)


BROKEN = {
    # wo_b's programs run every other output tile twice: the others stay poison
    "wrong wo_b tile": ("_grid_program(v - PA,", "_grid_program((v - PA) // 2 * 2,", AssertionError),
    # the phase counters are never reset: the next call would start at the wrong ticket
    "ticket kept": ("tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)", "pass", kernels.CodegenError),
    # wo_b reads wo_a's output as the attention output (the wrong buffer)
    "wrong input": ("_grid_program(v - PA, z_ptr,", "_grid_program(v - PA, o_ptr,", AssertionError),
}


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_broken_fused_kernel_is_caught(fault, monkeypatch, tmp_path):
    old, new, error = BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, out_proj, "out_proj_kernel", old, new)
    args, attrs = case(torch.float32, "float", "native", H=4, d=64, R=64, DM=160)  # wo_b: 2 N tiles, no split
    ref = kc.reference("rope_out_proj_linear", args, attrs)[0]
    with pytest.raises(error):
        y, _ = fused(args, attrs)
        kc.assert_matches(y, ref, fault)


def test_every_wo_b_program_waits_for_every_wo_a_program():
    """The wait cannot be shown wrong by running it (the interpreter runs programs in ticket order), so the
    kernel's source is checked: wo_a's programs publish after their GEMM; wo_b's wait for all PA of them
    before theirs; the phase counters are reset only by the last program to finish."""
    import inspect
    src = inspect.getsource(out_proj.out_proj_kernel.fn)
    at = src.index
    assert at("_grid_program(v, o_ptr") < at("publish(phase_ptr + WO_A_DONE)") \
        < at("wait_for(phase_ptr + WO_A_DONE, PA)") < at("_grid_program(v - PA, z_ptr")
    assert at("_grid_program(v - PA, z_ptr") < at("last_to_arrive(phase_ptr + FINISHED, PA + PB)") \
        < at("tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)")



# ---- sparse_attention_out_proj: the decode attention (its split merge included) as the first phase

def attn_case(kind, fmt, dtype, starts, counts, H, d, wfmt, act, G=2, R=64, DM=160):
    """sparse_attention's operands (test_kernels_sparse_attention._operands: a decode step, one lane padding
    when its count is 0) and the projection's: wo_a [G * R, H * d / G], wo_b [DM, G * R]."""
    from test_kernels_sparse_attention import _operands
    args, attrs = _operands(kind, fmt, dtype, starts, counts, 1, H, d, 8, seed=3)
    p_args, p_attrs = case(args["q"].dtype, wfmt, act, B=len(starts), T=1, H=H, d=d, G=G, R=R, DM=DM, seed=4)
    args.update(w=p_args["w"], w_scale=p_args["scale"], wb=p_args["wb"], wb_scale=p_args["wb_scale"])
    return args, {**attrs, **p_attrs, "dim": 8}


def attn_fused(args, attrs):
    B = args["q"].shape[0]
    y, buf = kc.poisoned((B, 1, args["wb"].shape[0]), args["q"].dtype, pad=3)
    calls = kernels.launch("sparse_attention_out_proj", args, attrs, {"y": y})
    assert buf[..., -3:].float().isnan().all(), "the fused launch wrote past its row"
    return y, calls


def attn_apart(args, attrs):
    """The sparse_attention launch, then rope_out_proj's and wo_b's on its output."""
    from v4compile.ir.registry import get_op
    a_args = {n: args.get(n) for n in get_op("sparse_attention").operand_names}
    a_attrs = {n: v for n, v in attrs.items() if n in get_op("sparse_attention").attrs}
    o, _ = kc.poisoned(args["q"].shape, args["q"].dtype)
    kernels.launch("sparse_attention", a_args, a_attrs, {"out": o})
    return apart({"o": o, "pos": args["pos"], "w": args["w"], "scale": args["w_scale"], "wb": args["wb"],
                  "wb_scale": args["wb_scale"]}, attrs)


ATTN_CASES = {  # kind, fmt, dtype, starts, counts, H, d; weights, act; splits of the attention (MIN_SPLIT_ROWS)
    # HCA, FP8 pool, bf16, official numerics (FP8 wo_a / wo_b inputs): split-KV (4 splits of 18 rows), its
    # merge in the launch; a padding lane
    "hca-fp8-split": (("hca", "fp8", "bf16", [255, 30, 5], [1, 1, 0], 4, 64), ("fp8", "fp8"), 16),
    # CSA, native pool, fp32, float weights: the one-pass attention (the production split plan: one split)
    "csa-native-one-pass": (("csa", "native", "fp32", [200, 7], [1, 1], 4, 64), ("float", "native"), None),
}


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_tail_equals_the_launches_apart(name, monkeypatch):
    """`sparse_attention_out_proj`: one launch, bit-identical to the attention's launch and the projection's
    two run one after the other; the fp32 case also within kernel_check.assert_matches of the op's reference
    (the bf16 attention's own tolerance is test_kernels_sparse_attention's; here the launches apart are the
    authority, each checked against its reference in its own test)."""
    from v4compile.codegen.kernels import sparse_attention as sa
    attn, (wfmt, act), rows = ATTN_CASES[name]
    if rows:
        monkeypatch.setattr(sa, "MIN_SPLIT_ROWS", rows)
    args, attrs = attn_case(*attn, wfmt, act)
    y, calls = attn_fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["attn_out_proj_kernel"]
    ce = calls[0].constexprs
    assert (ce["NS"] > 1) == bool(rows), ce["NS"]
    assert calls[0].grid[0] == ce["PS"] + ce["PA"] + ce["PB"] and ce["PS"] == len(attn[3]) * ce["HB"] * ce["NS"]
    assert torch.equal(y, attn_apart(args, attrs)), "the fused launch differs from the three launches apart"
    if attn[2] == "fp32":
        kc.assert_matches(y, kc.reference("sparse_attention_out_proj", args, attrs)[0], name)


ATTN_BROKEN = {
    # every attention program runs split 0: the other splits' partials stay poison, the merge reads them
    "attention split": ("_attention_phase", "split_program(v // (HB * NS), v // NS % HB, v % NS,",
                        "split_program(v // (HB * NS), v // NS % HB, 0,", AssertionError),
    # wo_a reads the attention's query instead of its output
    "wo_a input": ("attn_out_proj_kernel", "_grid_program(v - PS, o_ptr,", "_grid_program(v - PS, q_ptr,",
                   AssertionError),
    # the phase counters are never reset: the next call would start at the wrong ticket
    "ticket kept": ("attn_out_proj_kernel", "tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)", "pass",
                    kernels.CodegenError),
}


@pytest.mark.parametrize("fault", sorted(ATTN_BROKEN))
def test_broken_attention_tail_is_caught(fault, monkeypatch, tmp_path):
    from v4compile.codegen.kernels import sparse_attention as sa
    fn, old, new, error = ATTN_BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, out_proj, fn, old, new)
    monkeypatch.setattr(sa, "MIN_SPLIT_ROWS", 16)
    args, attrs = attn_case("hca", "native", "fp32", [255, 30], [1, 1], 4, 64, "float", "native")
    ref = kc.reference("sparse_attention_out_proj", args, attrs)[0]
    with pytest.raises(error):
        y, _ = attn_fused(args, attrs)
        kc.assert_matches(y, ref, fault)


def test_every_phase_of_the_attention_tail_waits_for_the_one_before():
    """As above, on the source: the attention's programs publish after their work (a split group's merge
    included), wo_a's wait for all PS of them, wo_b's for all PA of wo_a's."""
    import inspect
    src = inspect.getsource(out_proj.attn_out_proj_kernel.fn)
    at = src.index
    assert at("_attention_phase(v,") < at("publish(phase_ptr + ATTN_DONE)") \
        < at("wait_for(phase_ptr + ATTN_DONE, PS)") < at("_grid_program(v - PS, o_ptr")
    assert at("_grid_program(v - PS, o_ptr") < at("publish(phase_ptr + WO_A_DONE)") \
        < at("wait_for(phase_ptr + WO_A_DONE, PA)") < at("_grid_program(v - PS - PA, z_ptr")
    assert at("_grid_program(v - PS - PA, z_ptr") < at("last_to_arrive(phase_ptr + FINISHED, PS + PA + PB)")

# ---- AOT: V4-Pro's decode specialisation compiles for both targets, matrix instructions, no spills

def v4pro_calls(M=8, act="fp8"):
    """rope_out_proj_linear as `v4compile ir dump --preset v4-pro --weights none --func decode --stage program
    --decode-batch 8 --dtype bf16 --numerics official` has it: FP8 wo_a [16384, 4096] in 16 groups, FP8 wo_b
    [7168, 16384], 128x128 E8M0 scales; official numerics quantise both GEMMs' inputs (act fp8)."""
    from test_kernels_moe import _ta
    ops = dict(o=_ta((M, 1, 128, 512), "bf16"), pos=_ta((M, 1), "i64"), w=_ta((16384, 4096), "fp8e4m3"),
               scale=_ta((128, 32), "e8m0"), wb=_ta((7168, 16384), "fp8e4m3"), wb_scale=_ta((56, 128), "e8m0"))
    attrs = {**ROT, "dim": 64, "groups": 16, "block": 128, "act": act, "acc": "fp32", "out_dtype": "bf16" if act == "fp8" else "",
             "block_b": 128, "act_b": act, "out_dtype_b": "bf16" if act == "fp8" else ""}
    return out_proj.specialise("rope_out_proj_linear", ops, {"y": _ta((M, 1, 7168), "bf16")}, attrs)


def v4pro_attention_calls(M=8):
    """sparse_attention_out_proj as the same dump has it on a CSA layer (layer 2): 8 lanes, 128 heads of 512,
    FP8 pool planes (448 e4m3 NoPE + 7 E8M0 scales + 64 bf16 RoPE), 127 window + 1024 selected rows (split-KV:
    4 splits); wo_a's input native (act_b fp8: wo_b's quantised)."""
    from test_kernels_moe import _ta
    n = 316160
    ops = dict(q=_ta((M, 1, 128, 512), "bf16"), kv=_ta((M, 1, 512), "bf16"), pos=_ta((M, 1), "i64"),
               sink=_ta((128,), "fp32"), slot=_ta((M,), "i32"), block_table=_ta((M, 16), "i32"),
               win_indptr=_ta((M + 1,), "i32"), win_indices=_ta((M * 127,), "i32"), comp_indptr=_ta((M + 1,), "i32"),
               comp_indices=_ta((M * 1024,), "i32"), p0=_ta((n, 448), "fp8e4m3"), p1=_ta((n, 7), "e8m0"),
               p2=_ta((n, 64), "bf16"), w=_ta((16384, 4096), "fp8e4m3"), w_scale=_ta((128, 32), "e8m0"),
               wb=_ta((7168, 16384), "fp8e4m3"), wb_scale=_ta((56, 128), "e8m0"))
    attrs = {**ROT, "dim": 64, "groups": 16, "block": 128, "act": "native", "acc": "fp32", "out_dtype": "",
             "block_b": 128, "act_b": "fp8", "out_dtype_b": "", "window": 128, "scale": 512 ** -0.5, "win_base": 256,
             "comp_base": 62, "fmt": "fp8", "slot_rows": 7808, "n_rows": n, "ratio": 4, "block_tokens": 256,
             "envelope_rows": 1982, "comp_rows": 1024}
    return out_proj.specialise("sparse_attention_out_proj", ops, {"y": _ta((M, 1, 7168), "bf16")}, attrs)


@pytest.mark.slow
def test_aot_v4pro_decode(tmp_path, monkeypatch):
    """Both V4-Pro decode kernels compile for gfx950 and sm_90a with matrix instructions and no spills."""
    from v4compile.codegen import aot
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path / "cache"))
    (proj,), (tail,) = v4pro_calls(), v4pro_attention_calls()
    ce = proj.constexprs
    assert (ce["PA"], ce["PB"]) == (8 * 16 * 2, 56 * 4)  # wo_a: 8 N tiles x 16 groups x 2 splits; wo_b 56 x 4
    assert tail.constexprs["PS"] == 8 * 4 * 4  # lanes x head blocks x splits
    rows = aot.compile_calls([proj, tail], ["gfx950", "sm_90a"], tmp_path / "out", jobs=2)
    for r in rows:
        assert r["spills"] == 0, f"{r['name']} {r['target']}: spills"
        assert r["mma_instructions"] > 0, f"{r['name']} {r['target']}: no matrix instructions"
    print({(r["name"][:8], r["target"]): (r["regs"], r["spills"], r["mma_instructions"], r["occupancy"]) for r in rows})


def test_each_phase_rereads_hit_the_cache_when_that_phase_fits():
    """A launch of phases that each wait for the whole phase before (`KernelCall.phases`): a phase's re-reads
    are hits when that phase's footprint fits the cache share, whatever the launch's whole footprint.
    V4-Pro's decode call: wo_a's phase (64 MiB of weights) and wo_b's (112 MiB) each fit gfx950's 128 MiB
    share, together they do not; neither fits sm_90a's 25 MB."""
    import dataclasses
    from v4compile.codegen.roofline import hbm_bytes

    (call,) = v4pro_calls()
    (a_moved, a_reread), (b_moved, b_reread) = call.phases
    assert a_reread > 0 and b_reread > 0
    assert hbm_bytes(call, "gfx950") == call.bytes_moved - call.reread_bytes
    assert hbm_bytes(dataclasses.replace(call, phases=()), "gfx950") == call.bytes_moved  # the whole launch: misses
    assert hbm_bytes(call, "sm_90a") == call.bytes_moved
    with pytest.raises(ValueError, match="do not sum"):
        dataclasses.replace(call, phases=((a_moved, a_reread), (b_moved, 0)))
