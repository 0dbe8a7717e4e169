"""sparse_attention kernel vs its op reference (interpreter): native and fp8 pool planes, window-only
(SWA), window + all compressed rows (HCA) and window + selected rows (CSA) layers, prefill chunks with
padding lanes and decode, fp32 and bf16. Decode (T == 1) runs split-KV (splits of each
lane's row list, the LSE merge by the last split of each group to arrive, in the same call); the split tests shrink the rows per split so these tiny row
lists span several splits (the production plan would give one).

Tolerances. fp32: 2e-6 x max|ref| + 1e-5 x |ref| (online softmax rescaling and exp order; a few fp32
ulps). bf16, per output element (lane, head, column c): the logits are rounded exactly as the reference
rounds them; the only differences are where the probabilities are rounded to bf16 before the PV product
(the reference rounds the normalised p_j, the kernel the unnormalised exp(s_j - m_running): each a relative
error <= 2^-8, so the two results differ by <= 2^-7 x sum_j p_j |v_jc|, computed from the reference's own
probabilities) plus the two final roundings to bf16 (half an ulp each: 1 ulp of |ref|). Split-KV decode
keeps the bound: each split rounds its probabilities relative to its own running max (still 2^-8 each) and
the LSE merge rescales fp32 partials (a few fp32 ulps; measured <= 6e-7 x max|ref| on the fp32 decode
cases). Measured: the kernels stay within 0.5 of this bound. A single dropped or duplicated row is caught
when it moves some output element past this bound (test_a_dropped_or_duplicated_row_is_caught: the first
window row, 0.047, and compressed row 35, 0.016, of the hca/fp8/bf16 case's lane 0); a row that moves every
element by less than about an ulp is below bf16's resolution. Of that lane's 14 window and 128 compressed
drop / duplicate faults, this bound catches 2 and 63 (the former 2^-8 x max|v| + 2 ulps: 0 and 37).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import DT, main_planes, positions  # noqa: E402
import kernel_check as kc  # noqa: E402
from kernel_check import bf16_ulp, poisoned, reference  # noqa: E402
from v4compile.codegen import kernels  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402
from v4compile.codegen.kernels import sparse_attention as sa  # noqa: E402
from v4compile.ops import paged  # noqa: E402


def _operands(kind, fmt, dtype, starts, counts, T, H, d, rope, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    B = len(starts)
    window, ratio, block_tokens, n_layers, env = 8, 4, 16, 3, 11
    max_rows = 64
    blocks = max_rows * ratio // block_tokens
    n_blocks = B * blocks + 1
    slot_rows = n_layers * window
    n_rows = n_blocks * env + (B + 1) * slot_rows
    pos = positions(starts, counts, T)
    slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
    bt = torch.randperm(n_blocks, generator=g)[: B * blocks].view(B, blocks).to(torch.int32)
    planes = main_planes(fmt, n_rows, d, rope, dt, g)
    win = reference("csr_window", {"pos": pos, "slot": slot}, {"window": window, "slot_rows": slot_rows,
                                                                 "n_rows": n_rows})
    csr_attrs = {"ratio": ratio, "block_tokens": block_tokens, "envelope_rows": env}
    if kind == "hca":
        comp = reference("csr_compressed", {"pos": pos, "block_table": bt}, dict(csr_attrs, max_rows=max_rows))
    elif kind == "csa":
        # Distinct picks per lane, as the indexer's top-k makes them (the op lists each key once).
        sel = torch.argsort(torch.rand(B, T, max_rows, generator=g), dim=-1)[..., :5]
        lim = (pos.clamp(min=0) + 1) // ratio
        sel = torch.where(sel < lim.unsqueeze(-1), sel, -1)
        comp = reference("csr_selected", {"selected": sel, "pos": pos, "block_table": bt}, csr_attrs)
    else:
        comp = (None, None)
    args = {"q": (torch.randn(B, T, H, d, generator=g) * 1.5).to(dt), "kv": torch.randn(B, T, d, generator=g).to(dt),
            "pos": pos, "sink": torch.rand(H, generator=g) * 4 - 1, "slot": slot,
            "block_table": bt if kind != "swa" else None, "win_indptr": win[0], "win_indices": win[1],
            "comp_indptr": comp[0], "comp_indices": comp[1],
            **{f"p{i}": (planes[i] if i < len(planes) else None) for i in range(3)}}
    attrs = {"window": window, "scale": d ** -0.5, "win_base": window, "comp_base": 2 if kind != "swa" else 0,
             "fmt": fmt, "slot_rows": slot_rows, "n_rows": n_rows}
    if kind != "swa":
        attrs.update(csr_attrs, comp_rows=max_rows)
    return args, attrs


CASES = [  # kind, fmt, dtype, starts, counts, T, H, d, rope
    ("swa", "native", "fp32", [0, 5, 20], [3, 3, 0], 3, 4, 32, 8),     # seq 0: no history; seq 2: padding only
    ("hca", "native", "fp32", [250, 9], [1, 1], 1, 20, 24, 8),         # decode, 62 compressed rows (> BN), 2 head blocks
    ("csa", "native", "bf16", [40, 3], [4, 2], 4, 4, 32, 8),
    ("hca", "fp8", "bf16", [255, 30], [2, 1], 2, 4, 56, 8),             # 48 NoPE dims = 3 x 16, 63 comp rows
    ("csa", "fp8", "fp32", [60, 0], [1, 1], 1, 4, 40, 8),
    ("swa", "bf16", "bf16", [100], [1], 1, 6, 32, 8),
]


def _abs_weighted(q, keys, visible, sink, scale):
    """`attend` with |values| in fp32: sum_j p_j |v_j| per output element (the bf16 tolerance's weight)."""
    B, T, H, _ = q.shape
    scores = (torch.einsum("bthd,bkd->bthk", q, keys) * scale).float().masked_fill(~visible.unsqueeze(2), -torch.inf)
    logits = torch.cat([scores, sink.float().view(1, 1, H, 1).expand(B, T, H, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bthk,bkd->bthd", probs, keys.float().abs())


def _check(case, seed=0, wrong=None, fault=None):
    """Kernel vs reference. `wrong`: attributes given to the kernel only; `fault`: a function that edits
    the kernel's operands only (the reference keeps the originals)."""
    kind, fmt, dtype = case[:3]
    args, attrs = _operands(*case, seed=seed)
    want = reference("sparse_attention", args, attrs)[0]
    out = poisoned(want.shape, want.dtype)[0]
    calls = launch("sparse_attention", fault(args) if fault else args, dict(attrs, **(wrong or {})), {"out": out})
    assert not out.float().isnan().any(), "unwritten output lanes"
    d = (out.float() - want.float()).abs()
    if want.dtype == torch.float32:
        tol = 2e-6 * want.abs().max() + 1e-5 * want.abs()
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(paged, "attend", _abs_weighted)
            weight = reference("sparse_attention", args, attrs)[0]
        tol = 2.0 ** -7 * weight + bf16_ulp(want.float())
    bad = d > tol
    assert not bad.any(), (f"sparse_attention {case[:3]}: {int(bad.sum())}/{d.numel()} off, max |d| {d.max():.3g}, "
                           f"max |ref| {want.float().abs().max():.3g}")
    return calls


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-T{c[5]}" for c in CASES])
def test_sparse_attention(case):
    _check(case)


@pytest.mark.parametrize("wrong", [{"scale": 0.5}, {"comp_base": 3}, {"win_base": 0}])
def test_wrong_kernel_is_caught(wrong):
    with pytest.raises(AssertionError, match="off"):
        _check(CASES[3] if "comp_base" in wrong else CASES[2], wrong=wrong)


def _edit_row(args, csr, lane, k, dup):
    """The kernel's `csr` ("win" | "comp") with row k of `lane` dropped (or listed twice)."""
    ptr, idx = args[f"{csr}_indptr"].clone(), args[f"{csr}_indices"]
    at = int(ptr[lane]) + k
    idx = torch.cat([idx[:at + 1], idx[at:]]) if dup else torch.cat([idx[:at], idx[at + 1:]])
    ptr[lane + 1:] += 1 if dup else -1
    return dict(args, **{f"{csr}_indptr": ptr, f"{csr}_indices": idx})


def test_prefill_wide_head_blocks(monkeypatch):
    """The wide blocking (V4's d = 512, prefill and decode: 32 heads x 8 warps per program) run at a small head
    dim: 40 heads in two blocks (the second with 8 real heads and 24 masked lanes) on a CSA prefill chunk with
    padding lanes, against the reference; the narrow blocking of the same case needs 3 blocks, so it reads
    every row once more."""
    assert sa.blocking(512) == (32, 8) and sa.blocking(56) == (16, 4)
    case = ("csa", "fp8", "bf16", [40, 3], [4, 2], 4, 40, 56, 8)
    narrow = _check(case)
    monkeypatch.setattr(sa, "WIDE_D", 0)
    wide = _check(case)
    assert [(c.grid, c.num_warps) for c in narrow] == [((8, 3, 1), 4)]
    assert [(c.grid, c.num_warps) for c in wide] == [((8, 2, 1), 8)]
    assert wide[0].bytes_moved < narrow[0].bytes_moved


# The hca / fp8 / bf16 case, lane 0 (7 window rows, 64 compressed rows): dropping its first window row moves
# the output by 0.047 (the old tolerance 2^-8 x max|v| was >= 0.059), dropping its compressed row 35 by 0.016.
@pytest.mark.parametrize("csr,k,dup", [("win", 0, False), ("win", 0, True), ("comp", 35, False), ("comp", 35, True)],
                         ids=["window-drop", "window-dup", "compressed-drop", "compressed-dup"])
def test_a_dropped_or_duplicated_row_is_caught(csr, k, dup):
    args, _ = _operands(*CASES[3], seed=0)
    assert int(args["comp_indptr"][1] - args["comp_indptr"][0]) == 64 and CASES[3][2] == "bf16"
    with pytest.raises(AssertionError, match="off"):
        _check(CASES[3], fault=lambda a: _edit_row(a, csr, 0, k, dup))


# Decode lanes: 64 compressed + 7 window rows (the largest count), 2 + 7 rows, an empty history (own row
# only), a padding lane (pos = -1).
DECODE = [  # case, rows per split floor
    (("hca", "native", "fp32", [255, 9, 0, 5], [1, 1, 1, 0], 1, 20, 24, 8), 16),   # 4 splits of 18, last 17
    (("hca", "native", "fp32", [255, 9, 0, 5], [1, 1, 1, 0], 1, 20, 24, 8), 33),   # splits of 64 > BN, last 7
    (("hca", "fp8", "bf16", [255, 30, 5], [1, 1, 0], 1, 4, 56, 8), 24),
    (("csa", "fp8", "fp32", [200, 60, 3], [1, 1, 0], 1, 4, 40, 8), 4),             # 12 rows -> 3 splits
    (("csa", "native", "bf16", [200, 7], [1, 1], 1, 4, 32, 8), 5),
    (("swa", "native", "fp32", [100, 2, 0, 9], [1, 1, 1, 0], 1, 4, 32, 8), 3),      # window only: 4 + 3 rows
    (("swa", "bf16", "bf16", [100, 4], [1, 1], 1, 6, 32, 8), 3),
]


@pytest.mark.parametrize("case,rows", DECODE, ids=[f"{c[0]}-{c[1]}-{c[2]}-rs{r}" for c, r in DECODE])
def test_decode_splits(case, rows, monkeypatch):
    monkeypatch.setattr(sa, "MIN_SPLIT_ROWS", rows)
    calls = _check(case)
    assert [c.kernel_name for c in calls] == ["sparse_attention_split_kernel"]  # the merge in the same call
    assert calls[0].grid[2] > 1, "the case must span several splits"


def test_decode_one_split_is_one_pass(monkeypatch):
    calls = _check(DECODE[0][0])
    assert [c.kernel_name for c in calls] == ["sparse_attention_kernel"]


def test_decode_production_plan():
    """V4-Pro decode shape: 8 lanes, 128 heads in 32-head blocks, 127 window + 1024 selected rows ->
    >= 2 x 256 programs would need 16 splits; the 256-row floor gives 4 of 288 rows."""
    assert sa.split_plan(1151, 8, 4, 16) == (4, 288)
    assert sa.split_plan(257, 8, 4, 16)[0] == 1
    assert sa.split_plan(7, 8, 1, 16) == (1, 7)
    assert sa.split_plan(0, 8, 1, 16) == (1, 1)


@pytest.mark.parametrize("fn,old,new,error", [
    # the sink enters the denominator once per split
    ("_merge", "other=0.0) * w\n", "other=0.0) * w + tl.exp(sink - mx)\n", AssertionError),
    # no split merges (nor resets its counter)
    ("split_program", "last_to_arrive(sem_ptr + group, NS)", "last_to_arrive(sem_ptr + group, NS + 1)",
     kernels.CodegenError),
    # the counter is left set: the next call of the program would merge early
    ("split_program", "tl.store(sem_ptr + group, 0)", "pass", kernels.CodegenError),
])
def test_wrong_merge_is_caught(monkeypatch, tmp_path, fn, old, new, error):
    monkeypatch.setattr(sa, "MIN_SPLIT_ROWS", 16)
    kc.install_broken_kernel(monkeypatch, tmp_path, sa, fn, old, new)
    with pytest.raises(error):
        _check(DECODE[0][0])
