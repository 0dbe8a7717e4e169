"""No V4-Pro kernel spills: the specialisations that did (issue 40; the verify projection of `--draft-tokens 3`
after it), compiled ahead of time as the V4-Pro compile has them, spill nothing on the target that spilled, and with the launch shape they had before they
spill again (the check can fail). A representative set, not the whole compile: a cold AOT of V4-Pro's ~100
kernel x target pairs takes minutes; these share the default kernel cache, warm in CI as for every AOT test
that does. The whole set is checked by `compile -o` itself, which exits 1 on any spill."""

from __future__ import annotations

import dataclasses

import pytest

from test_kernels_moe import _ta
from test_kernels_out_proj import ROT
from v4compile.codegen import aot
from v4compile.codegen.kernels import compress, out_proj


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


@pytest.mark.slow
@pytest.mark.parametrize("build, target", [(prefill_out_proj, "gfx950"), (verify_out_proj, "sm_90a"),
                                           (decode_hca_compress, "sm_90a")],
                         ids=["out_proj-prefill-gfx950", "out_proj-verify-sm_90a", "compress-hca-decode-sm_90a"])
def test_no_spills_where_v4pro_spilled(tmp_path, build, target):
    call = build()
    assert call.per_target.get(target), f"{call.name}: no launch shape of its own on {target}"
    before = dataclasses.replace(call, name=call.name + "_before", per_target={})  # the launch shape that spilled
    rows = {r["name"]: r for r in aot.compile_calls([call, before], [target], tmp_path, jobs=2)}
    fixed, old = rows[call.name], rows[before.name]
    assert fixed["spills"] == 0, f"{call.name} ({target}) spills {fixed['spills']}"
    assert fixed["mma_instructions"] > 0 or build is decode_hca_compress  # the compressor has no dot
    assert old["spills"] > 0, "the old launch shape no longer spills: this test checks nothing"
