"""The optimisation passes: numerics of every pass, V4-Pro hit counts and report, the memory plan, the
paged pool's formats, and `compile --check-numerics`.

Numerics tolerance: each pass must keep the interpreted logits within 1e-5 relative to the logit scale
of the reference (fp32). The passes are exact rewrites, so the remaining difference is fp32 summation
order (~2e-6 absolute on logits of magnitude ~4 here, i.e. ~5e-7 relative); 1e-5 leaves room for that
and is far below any real defect (a wrong row or missed mask moves logits by > 1e-2).
"""

from __future__ import annotations

import json

import pytest
import torch

from bad_input_util import cli_in_process
from conftest import dense_weights, make_model
from v4compile.config import preset
from v4compile.harness import IRRunner, Scenario, ir_logits, reference_logits
from v4compile.ir.core import WEIGHT
from v4compile.ir.registry import get_op
from v4compile.ir.types import DTYPES
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.passes.numerics import NumericsCheck
from v4compile.pool import PoolGeometry
from v4compile.cli.report import build_report, launch_counts
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource, load_ir_weights

OPTS = dict(batch=2, chunk=16, decode_batch=2, capacity=160)
RTOL = 1e-5


@pytest.fixture(scope="module", params=["hf", "official"])
def run(request):
    """The default pipeline on tiny with a numerics check after every pass."""
    numerics = request.param
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(numerics=numerics, **OPTS))
    sc = Scenario.make(cfg.vocab_size, 2, 100, 32, seed=4)  # 25 CSA rows per 100 tokens > index_topk 4
    check = NumericsCheck(make_model("tiny", numerics=numerics), DenseSource(dense_weights("tiny")), sc, 16, 1e-4)
    res = PassManager(DEFAULT_PIPELINE, PipelineOptions(verify_each=True, check_numerics=check)).run(m)
    scale = max(float(t.abs().max()) for t in check.expected)
    return numerics, m, res, check, scale


def topk_drops(m, weights, scenario) -> dict[str, int]:
    """Run `scenario` through the traced module `m` up to its first decode step; per function, the
    selectable compressed rows (finite indexer scores) that its `topk` ops leave out, summed over query
    lanes and layers."""
    from v4compile.ir.interpret import interpret

    drops = {"prefill": 0, "decode": 0}

    class Done(Exception):
        pass

    def interp(fn, weights, inputs):
        seen: dict[int, torch.Tensor] = {}

        def observe(op, outs):
            seen.update((id(r), t) for r, t in zip(op.results, outs))
            if op.name == "topk":
                selectable = torch.isfinite(seen[id(op.operands[0])]).sum(-1)
                drops[fn.name] += int((selectable - op.attrs["k"]).clamp(min=0).sum())
        out = interpret(fn, weights, inputs, observe=observe)
        if fn.name == "decode":
            raise Done  # prefill and one decode step are enough to see it
        return out

    try:
        ir_logits(IRRunner(m, weights, interpreter=interp), scenario)
    except Done:
        pass
    return drops


def check_sparsity_is_active(m, weights, scenario):
    drops = topk_drops(m, weights, scenario)
    assert drops["prefill"] > 0 and drops["decode"] > 0, drops


def test_sparsity_is_active_in_the_scenario(run):
    """The numerics checks above see the indexer drop rows: in prefill and in decode, its top-k leaves out
    selectable compressed rows (so a pass that mishandled the selection would change the logits)."""
    numerics, m, _, check, _ = run
    assert check.prepare is None
    check_sparsity_is_active(m, check.weights(m), check.scenario)


def test_a_scenario_without_drops_is_caught():
    """Prompts of 12 tokens have at most 3 compressed rows per CSA layer (ratio 4) < index_topk 4: the
    top-k keeps every row, and the same check fails."""
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(**OPTS))
    short = Scenario.make(cfg.vocab_size, 2, 12, 2, seed=4)
    with pytest.raises(AssertionError):
        check_sparsity_is_active(m, load_ir_weights(m, DenseSource(dense_weights("tiny"))), short)


def test_every_pass_preserves_numerics(run):
    numerics, m, res, check, scale = run
    assert scale > 1
    assert res.traced_error / scale < RTOL
    for r in res.records:
        assert r.numerics_error / scale < RTOL, (numerics, r.spec, r.numerics_error)
    assert [r.name for r in res.records] == DEFAULT_PIPELINE


def test_every_pass_output_round_trips(tmp_path):
    from v4compile.ir.text import parse_module, print_module
    from v4compile.ir.verify import verify

    m = trace(preset("tiny-pro"), TraceOptions(numerics="official", **OPTS))
    PassManager(DEFAULT_PIPELINE, PipelineOptions(dump_ir=str(tmp_path))).run(m)
    dumps = sorted(tmp_path.glob("*.ir"))
    assert len(dumps) == len(DEFAULT_PIPELINE) + 1
    for f in dumps:
        text = f.read_text()
        assert print_module(verify(parse_module(text))) == text, f.name


def test_every_pass_did_something(run):
    numerics, m, res, check, scale = run
    hits = {r.name: r.hits for r in res.records}
    assert hits["merge_wq_a_wkv"]["decode.merged"] == 5
    assert hits["fuse_mhc_post_pre"]["decode.seams"] == 2 * (5 - 1)
    assert hits["fuse_mhc_post_pre"]["decode.pre_norm"] == 2 and hits["fuse_mhc_post_pre"]["decode.post_head"] == 1
    assert hits["fold_inverse_rope_wo_a_quant"]["decode.folded"] == 5
    assert hits["fuse_inv_rope_wo_a"]["decode.fused"] == 5
    assert hits["fuse_out_proj"]["decode.fused"] == 5 and hits["fuse_out_proj"]["prefill.fused"] == 5
    assert hits["fuse_out_proj"]["decode.attention"] == 5 and hits["fuse_out_proj"]["prefill.attention"] == 0
    assert hits["lower_sparse_attention"]["decode.attention"] == 5
    assert hits["fuse_indexer_topk"]["decode.fused"] == 2
    assert hits["fuse_qkv_norm_rope"]["decode.window_writes"] == 5 and hits["fuse_qkv_norm_rope"]["prefill.window_writes"] == 0
    assert hits["fuse_moe"]["decode.fused"] == 5
    assert hits["fuse_moe_router"]["decode.fused"] == 5 and hits["fuse_moe_router"]["prefill.fused"] == 5
    # every MoE but the last layer's (its output goes to mhc_post_head) takes the seam after it
    assert hits["fuse_moe_mhc"]["decode.fused"] == 4 and hits["fuse_moe_mhc"]["prefill.fused"] == 4
    assert hits["fuse_mhc_moe"]["decode.fused"] == 3  # and the seam before it, but layer 0's (hc_pre_norm) and the last's
    assert hits["pair_compressors"]["decode.paired"] == 2 and hits["pair_compressors"]["prefill.paired"] == 0  # CSA
    # every compressed layer's prologue with its compressor launch (HCA: compress_paged, CSA: compress_pair; layer
    # 0 is sliding-window only); prefill writes no window row from qkv_norm_rope
    assert hits["pair_rope_compress"]["decode.fused"] == 4 and hits["pair_rope_compress"]["prefill.fused"] == 0
    assert hits["fuse_attn_front"]["decode.fused"] == 5 and hits["fuse_attn_front"]["prefill.fused"] == 5
    assert hits["cse"]["decode.ops_merged"] >= 5  # the CSR builders shared across layers
    final = res.module
    names = {op.name for op in final.functions["decode"].ops}
    assert not names & {"attention", "window_write", "compress", "indexer_scores", "topk", "inv_rope_group_quant",
                        "router"}
    assert sum(op.name == "hc_post" for op in final.functions["decode"].ops) == 1  # layer 0's own seam
    assert final.attrs["pool.main_fmt"] == ("fp8" if numerics == "official" else "native")


def test_lossy_pool_formats_are_really_lossy():
    """The exactness above is not vacuous: the FP8 / FP4 pool under hf numerics does move logits."""
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(**OPTS))
    sc = Scenario.make(cfg.vocab_size, 2, 100, 8, seed=4)
    check = NumericsCheck(make_model("tiny"), DenseSource(dense_weights("tiny")), sc, 16, 1e-4)
    res = PassManager(["lower_sparse_attention{kv_format=fp8,index_format=fp4}"]).run(m)
    assert check.error(res.module) > 1e-2


def test_quantized_checkpoint_through_the_pipeline(tmp_path):
    """Released FP8 / FP4 weights (tiny-pro: V4-Pro's pattern), official numerics, FP8 + FP4 pool."""
    from v4compile import frontend
    from v4compile.checkpoint import Checkpoint
    from v4compile.init_random import init_random
    from v4compile.model import ReferenceModel

    out = init_random(tmp_path / "q", preset("tiny-pro"), seed=5, quantized=True)
    fe = frontend.load(str(out), None, None, TraceOptions(numerics="official", **OPTS))
    res = PassManager(DEFAULT_PIPELINE, PipelineOptions(verify_each=True)).run(fe.module)
    assert res.records[0].hits["decode.unaligned"] == 5  # q_lora 48 is not a multiple of 128: kept apart
    sc = Scenario.make(512, 2, 90, 32, seed=6)
    with Checkpoint.open(out) as ck:
        got = ir_logits(IRRunner(res.module, load_ir_weights(res.module, ck)), sc)
    exp = reference_logits(ReferenceModel.from_pretrained(out, numerics="official"), sc, 16)
    scale = max(float(t.abs().max()) for t in exp)
    assert max(float((a - b).abs().max()) for a, b in zip(exp, got)) / scale < RTOL


# ---- V4-Pro, shape-only ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pro():
    cfg = preset("v4-pro")
    opts = TraceOptions(batch=1, chunk=512, decode_batch=64, capacity=1 << 20, weights="released", dtype="bf16",
                        numerics="official")
    traced = trace(cfg, opts)
    return cfg, traced, PassManager(DEFAULT_PIPELINE, PipelineOptions(verify_each=True)).run(traced)


def test_v4_pro_pass_hits(pro):
    cfg, traced, res = pro
    hits = {r.name: r.hits for r in res.records}
    assert hits["merge_wq_a_wkv"]["decode.merged"] == 61 and hits["merge_wq_a_wkv"]["decode.unaligned"] == 0
    assert hits["fuse_mhc_post_pre"]["decode.seams"] == 120
    assert hits["fuse_moe_mhc"]["decode.fused"] == 60  # the FFN's seams (the last layer's is mhc_post_head)
    assert hits["fuse_mhc_moe"]["decode.fused"] == 59  # the seams before those MoEs but layer 0's (hc_pre_norm)
    assert hits["fold_inverse_rope_wo_a_quant"]["decode.folded"] == 61
    assert hits["fuse_inv_rope_wo_a"]["decode.fused"] == 61
    assert hits["fuse_out_proj"]["decode.fused"] == hits["fuse_out_proj"]["decode.attention"] == 61  # every layer
    assert hits["pair_sibling_gemms"]["decode.paired"] == 61  # wqkv_a (FP8) + x_gemm (BF16) on every layer
    assert hits["pair_compressors"]["decode.paired"] == 30  # the attention's and the indexer's on every CSA layer
    assert hits["pair_rope_compress"]["decode.fused"] == 61  # the prologue and the compressor launch, every layer
    assert hits["fuse_attn_front"]["decode.fused"] == 61  # wqkv_a + x_gemm, then q_norm + wq_b, on every layer
    assert hits["lower_sparse_attention"]["decode.indexers"] == 30
    merged = res.module.weights["layers.7.attn.wqkv_a.weight"]
    assert merged.type.shape == (2048, 7168) and merged.type.dtype == "fp8e4m3"
    assert res.module.weights["layers.7.attn.wqkv_a.scale"].type.shape == (16, 56)
    assert merged.sources == ("layers.7.attn.wq_a.weight", "layers.7.attn.wkv.weight")


def test_v4_pro_report(pro):
    cfg, traced, res = pro
    rep = build_report(cfg, traced, res)
    for key in ("launches_per_decode_step", "launches_per_layer", "pass_hits", "arena_bytes", "kv_bytes_per_token"):
        assert rep[key] is not None, key
    assert rep["kv_bytes_per_token"] == pytest.approx(5465, abs=0.5)  # = the accounting's fp8+fp4
    assert rep["kv_bytes_per_token"] == pytest.approx(rep["kv_bytes_per_token_accounting"]["fp8+fp4"])
    lc = launch_counts(cfg, res.module.functions["decode"])
    assert lc["mean_per_layer"] <= 15  # the goal (ATOM: 31-34 HCA, 39-42 CSA)
    assert rep["launches_per_decode_step"] < 1000
    assert rep["pass_hits"]["fuse_mhc_post_pre"]["seams"] == 120
    assert 0 < rep["arena_bytes"] < rep["arena_naive_bytes"] / 10
    geo = PoolGeometry.from_attrs(res.module.attrs)
    assert geo.envelope_rows == 1982 and geo.block_tokens == 256 and geo.index_envelope_rows == 1920
    assert geo.row_bytes() == (640, 68)


def test_v4_pro_pool_geometry():
    cfg = preset("v4-pro")
    geo = PoolGeometry.for_config(cfg, 4096, 2, "fp8", "fp4", "bf16")
    off = dict(geo.layer_offset)
    assert off[0] == 0 and off[1] == 2 and off[3] == 4  # HCA layers first, 2 rows each
    first_csa = 31 * 2
    assert off[2] == first_csa and off[4] == first_csa + 64
    assert dict(geo.index_offset)[2] == 0 and dict(geo.index_offset)[4] == 64
    assert geo.slot_rows == 61 * 128


# ---- memory plan ---------------------------------------------------------------------------------
# The plan is executed for real by the program executor (tests/core/test_program.py): every value, views
# included, at its annotated place in one byte arena.


def test_memory_plan_runs_in_one_arena(run):
    from v4compile.program.build import build_program
    from v4compile.program.execute import Buffers, execute

    numerics, m, res, check, scale = run
    final = res.module
    w = check.weights(final)
    plain = ir_logits(IRRunner(final, w), check.scenario)
    prog = build_program(final)
    bufs = Buffers()

    def run_program(fn, weights, inputs, **_):
        return execute(prog.functions[fn.name], bufs, inputs, weights)

    in_arena = ir_logits(IRRunner(final, w, interpreter=run_program), check.scenario)
    assert all(torch.equal(a, b) for a, b in zip(plain, in_arena))


def test_memory_plan_never_overlaps_live_values(pro):
    from v4compile.program.build import build_program
    from v4compile.program.verify import verify_program

    cfg, traced, res = pro
    prog = verify_program(build_program(res.module))  # pairwise: no two live arena values share a byte
    for name, fn in res.module.functions.items():
        f = prog.functions[name]
        assert fn.attrs["arena_bytes"] >= max(a.extent[1] for l in f.launches for _, a in l.results
                                               if a.buffer == "arena")


def test_pool_formats_round_trip():
    from v4compile.ops.paged import read_rows, write_rows
    from v4compile.formats import fp8_qdq, hadamard, fp4_qdq

    g = torch.Generator().manual_seed(0)
    v = torch.randn(5, 128, generator=g) * 3
    rows = torch.tensor([7, 0, 3, 9, 2])
    # main fp8: values already on the FP8 grid (official rounding) survive exactly; RoPE dims untouched
    official = torch.cat([fp8_qdq(v[:, :64], 64), v[:, 64:]], dim=1)
    planes = [torch.zeros(10, 64, dtype=torch.float8_e4m3fn), torch.zeros(10, 1, dtype=torch.float8_e8m0fnu),
              torch.zeros(10, 64)]
    planes = write_rows(planes, rows, official, "fp8")
    assert torch.equal(read_rows(planes, rows, "fp8", torch.float32), official)
    assert torch.equal(read_rows(planes, torch.tensor([-1]), "fp8", torch.float32), torch.zeros(1, 128))
    # index fp4: Hadamard-rotated + FP4-rounded keys survive exactly
    key = fp4_qdq(v @ hadamard(128), 32)
    ip = write_rows([torch.zeros(10, 64, dtype=torch.int8), torch.zeros(10, 4, dtype=torch.float8_e8m0fnu)], rows,
                    key, "fp4")
    assert torch.equal(read_rows(ip, rows, "fp4", torch.float32), key)
    # native planes are exact for anything
    nat = write_rows([torch.zeros(10, 128)], rows, v, "native")
    assert torch.equal(read_rows(nat, rows, "native", torch.float32), v)


def test_csr_translation_through_the_block_table():
    from v4compile.ops.paged import csr_compressed, csr_selected, csr_window

    # Sequence 0 at positions 40..43 (ratio 4 -> rows 0..10 visible), blocks [5, 2] of 32 tokens
    pos = torch.tensor([[40, 41, 42, 43]])
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    sel = torch.tensor([[[9, -1, 0], [1, 8, -1], [-1, -1, -1], [10, 7, 2]]])
    indptr, idx = csr_selected(sel, pos, table, ratio=4, block_tokens=32, envelope_rows=20)
    # per block 8 rows: row w -> block table[w // 8] * 20 + w % 8
    assert indptr.tolist() == [0, 2, 4, 4, 7]
    assert idx[:7].tolist() == [2 * 20 + 1, 5 * 20 + 0, 5 * 20 + 1, 2 * 20 + 0, 2 * 20 + 2, 5 * 20 + 7, 5 * 20 + 2]
    ip, ix = csr_compressed(pos, table, ratio=16, block_tokens=32, envelope_rows=20, max_rows=4)
    assert ip.tolist() == [0, 2, 4, 6, 8] and ix[:2].tolist() == [5 * 20, 5 * 20 + 1]
    # window: positions 37..39 are before the chunk and within 4 of 40 -> ring rows of slot 1
    wp, wx = csr_window(pos, torch.tensor([1], dtype=torch.int32), window=4, slot_rows=8, n_rows=100)
    base = 100 - 2 * 8
    assert wp.tolist() == [0, 3, 5, 6, 6]
    assert wx[:3].tolist() == [base + 37 % 4, base + 38 % 4, base + 39 % 4]


# ---- CLI -----------------------------------------------------------------------------------------

def cli(*args):
    """In-process (`bad_input_util.cli_in_process`): these tests read the exit status and the output, not a
    fresh interpreter's start-up (~3 s a command; the CLI in a fresh process: tests/cli/test_cli.py)."""
    return cli_in_process(*args, timeout=900)


def test_compile_check_numerics_on_tiny():
    # Official numerics (the default) at max context 160: before the lowered attention summed in the
    # reference's key order, this scenario broke tolerance at lower_sparse_attention (7.0e-5 > 1e-5, exit 1).
    # The lowering is bit-exact now (tests/passes/test_official_pool.py), so every pass's error is exactly 0.
    # No -o: the GPU binaries of an fp32 build would be compiled for nothing here (the artifact's files are
    # test_debugtool's and test_artifact_targets'); the GPU pipeline still runs to lower_to_program.
    r = cli("compile", "--preset", "tiny", "--dtype", "fp32", "--check-numerics", "--max-context", "160", "--json")
    assert r.returncode == 0, r.stderr
    assert "numerics official" in r.stderr and "max context 160" in r.stderr
    assert "every pass within tolerance" in r.stderr
    errors = dict(line.split() for line in r.stderr.splitlines()
                  if line.startswith("  ") and len(line.split()) == 2 and line.split()[0].isidentifier())
    assert errors["lower_sparse_attention"] == "0" and errors["lower_to_program"] == "0", errors
    rep = json.loads(r.stdout)
    assert rep["launches_per_decode_step"] > 0 and rep["pass_hits"]["fuse_mhc_post_pre"]["seams"] == 8


def test_compile_v4_pro_json():
    r = cli("compile", "--preset", "v4-pro", "--weights", "none", "--report", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["kv_bytes_per_token"] == pytest.approx(5465, abs=0.5)
    assert j["pass_hits"]["fuse_mhc_post_pre"]["seams"] == 120
    assert set(j["launches_per_layer"]) == {"hca", "csa"}
    assert j["launches_per_layer_mean"] <= 15


def test_compile_rejects_random_weights_for_v4_pro():
    r = cli("compile", "--preset", "v4-pro", "--report")
    assert r.returncode == 2 and "--weights none" in r.stderr and "Traceback" not in r.stderr
