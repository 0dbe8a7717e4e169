"""No V4-Pro kernel spills: the specialisations that did (issue 40; the verify projection of `--draft-tokens 3`
and the CSA layer's decode prologue-with-compressors launch after it), compiled ahead of time as the V4-Pro compile has them, spill nothing on the target that spilled, and with the launch shape they had before they
spill again (the check can fail). A representative set, not the whole compile: a cold AOT of V4-Pro's ~100
kernel x target pairs takes minutes; these share the default kernel cache, warm in CI as for every AOT test
that does. The whole set is checked by `compile -o` itself, which exits 1 on any spill."""

from __future__ import annotations

import dataclasses

import pytest

from test_kernels_moe import _ta
from test_kernels_out_proj import ROT
from v4compile.codegen import aot
from v4compile.codegen.kernels import compress, out_proj, rope_compress


def prefill_out_proj():
    """V4-Pro's prefill projection (a 64-token chunk): wo_a FP8 [16384, 4096] in 16 groups reading the
    attention output natively through its inverse RoPE, wo_b FP8 [7168, 16384] on FP8-quantised input."""
    return _v4pro_out_proj((1, 64))


def verify_out_proj():
    """The same projection in a verify step of `--draft-tokens 3` at decode bucket 8: 8 sequences x 4 lanes,
    32 tokens, the BM = 32 tile (255 registers and 104 B spilled on sm_90a with its 4 warps)."""
    return _v4pro_out_proj((8, 4))


def _v4pro_out_proj(T):
    ops = dict(o=_ta((*T, 128, 512), "bf16"), pos=_ta(T, "i64"), w=_ta((16384, 4096), "fp8e4m3"),
               scale=_ta((128, 32), "e8m0"), wb=_ta((7168, 16384), "fp8e4m3"), wb_scale=_ta((56, 128), "e8m0"))
    attrs = {**ROT, "dim": 64, "groups": 16, "block": 128, "act": "native", "acc": "fp32", "out_dtype": "",
             "block_b": 128, "act_b": "fp8", "out_dtype_b": ""}
    (c,) = out_proj.specialise("rope_out_proj_linear", ops, {"y": _ta((*T, 7168), "bf16")}, attrs)
    return c


def decode_hca_compress():
    """V4-Pro's HCA compressor in a batch-8 decode step: 512-wide rows, 128-token windows, FP8 pool planes
    (448 e4m3 NoPE + 7 E8M0 scales + 64 bf16 RoPE)."""
    n, B, S = 316160, 8, 8
    ops = dict(kv=_ta((B, 1, 512), "bf16"), gate=_ta((B, 1, 512), "bf16"), ape=_ta((128, 512), "fp32"),
               norm=_ta((512,), "bf16"), state_kv=_ta((S, 128, 512), "bf16"), state_gate=_ta((S, 128, 512), "fp32"),
               pos=_ta((B, 1), "i64"), slot=_ta((B,), "i32"), block_table=_ta((B, 16), "i32"),
               p0=_ta((n, 448), "fp8e4m3"), p1=_ta((n, 7), "e8m0"), p2=_ta((n, 64), "bf16"))
    attrs = {"ratio": 128, "overlap": False, "eps": 1e-6, "rope_dim": 64, "theta": 160000.0,
             "yarn": (16.0, 256, 32.0, 1.0), "round": "fp8", "block_tokens": 256, "envelope_rows": 1982,
             "layer_offset": 0, "fmt": "fp8"}
    (c,) = compress.specialise("compress_paged", ops, {}, attrs)
    return c


def decode_csa_rope_compress():
    """V4-Pro's CSA layer at decode batch 8 in one launch (`qkv_rope_compress_pair`): the query prologue (128 heads
    of 512, the indexer's 64 x 128 query, the window-ring write into the FP8 planes), the attention compressor
    (ratio 4, overlapping, FP8 rows) and the indexer's (FP4 rows). 12 scalar registers spilled on gfx950 with
    4 warps (its ~30 pointer arguments at the SGPR cap)."""
    n, ni, B, S = 316160, 245760, 8, 8
    half = lambda dk, s: dict(kv=_ta((B, 1, 2 * dk), "bf16"), gate=_ta((B, 1, 2 * dk), "bf16"),  # noqa: E731
                              ape=_ta((4, 2 * dk), "fp32"), norm=_ta((dk,), "bf16"),
                              state_kv=_ta((S, 8, 2 * dk), "fp32"), state_gate=_ta((S, 8, 2 * dk), "fp32"))
    ops = dict(q=_ta((B, 1, 128, 512), "bf16"), kv=_ta((B, 1, 512), "bf16"), norm=_ta((512,), "bf16"),
               pos=_ta((B, 1), "i64"), qi=_ta((B, 1, 64, 128), "bf16"), slot=_ta((B,), "i32"),
               **{f"c_{k}_0": v for k, v in half(512, S).items()}, **{f"c_{k}_1": v for k, v in half(128, S).items()},
               c_p0_1=_ta((ni, 64), "fp4x2"), c_p1_1=_ta((ni, 4), "e8m0"), c_p2_1=None,
               c_block_table=_ta((B, 16), "i32"), p0=_ta((n, 448), "fp8e4m3"), p1=_ta((n, 7), "e8m0"),
               p2=_ta((n, 64), "bf16"))
    rot = {"theta": 160000.0, "yarn": (16.0, 65536, 32.0, 1.0)}
    comp = {"ratio": 4, "overlap": True, "eps": 1e-6, "rope_dim": 64, **rot, "block_tokens": 256}
    attrs = {"eps": 1e-6, "dim": 64, **rot, "kv_round_dims": 448, "kv_round_block": 64, "qi_round": "fp4",
             "q_mean": "dtype", "window": 128, "slot_rows": 7808, "n_rows": n, "layer_row": 256, "fmt": "fp8",
             **{f"c_{k}_{i}": v for i in (0, 1) for k, v in comp.items()},
             "c_round_0": "fp8", "c_envelope_rows_0": 1982, "c_layer_offset_0": 62, "c_fmt_0": "fp8",
             "c_round_1": "fp4", "c_envelope_rows_1": 1920, "c_layer_offset_1": 0, "c_fmt_1": "fp4"}
    res = {"q_out": ops["q"], "kv_out": ops["kv"], "qi_out": ops["qi"]}
    (c,) = rope_compress.specialise("qkv_rope_compress_pair", ops, res, attrs)
    return c


@pytest.mark.slow
@pytest.mark.parametrize("build, target", [(prefill_out_proj, "gfx950"), (verify_out_proj, "sm_90a"),
                                           (decode_hca_compress, "sm_90a"), (decode_csa_rope_compress, "gfx950")],
                         ids=["out_proj-prefill-gfx950", "out_proj-verify-sm_90a", "compress-hca-decode-sm_90a",
                              "rope-compress-csa-decode-gfx950"])
def test_no_spills_where_v4pro_spilled(tmp_path, build, target):
    call = build()
    assert call.per_target.get(target), f"{call.name}: no launch shape of its own on {target}"
    before = dataclasses.replace(call, name=call.name + "_before", per_target={})  # the launch shape that spilled
    rows = {r["name"]: r for r in aot.compile_calls([call, before], [target], tmp_path, jobs=2)}
    fixed, old = rows[call.name], rows[before.name]
    assert fixed["spills"] == 0, f"{call.name} ({target}) spills {fixed['spills']}"
    assert fixed["mma_instructions"] > 0 or build in (decode_hca_compress, decode_csa_rope_compress)  # no dot
    assert old["spills"] > 0, "the old launch shape no longer spills: this test checks nothing"
