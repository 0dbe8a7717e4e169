"""qkv_rope_compress / qkv_rope_compress_pair (a decode step's query prologue and its layer's compressor launch in
one, `passes/pair_rope_compress.py`) vs the two launches they replace, under the interpreter: every result (q, kv,
the indexer query, the state rings, the index planes, and the main pool planes that both write: window rows and
compressed rows) bit for bit, on decode steps that close a window. The main planes are FP8 (NoPE + scale + RoPE
planes), laid out as the pool is: compressed rows in whole envelopes from row 0, the slots' window rings above.
A launch whose program range is one short, and a kernel whose compressor reads the prologue's norm weight, are
caught."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kernel_check as kc  # noqa: E402
from attn_cases import main_planes  # noqa: E402
from kernel_check import poisoned  # noqa: E402
from test_kernels_compress import operands  # noqa: E402
from v4compile.codegen.kernels import launch, rope_compress  # noqa: E402
from v4compile.ir.registry import get_op  # noqa: E402
from v4compile.ops.rope_compress import ROPE_COMPRESS  # noqa: E402

WINDOW, SLOT_ROWS, LAYER_ROW = 8, 16, 8  # two window layers a slot; this is the second
MAIN = ("bf16", 4, False, [11, 7], [1, 1], 1, 32, 8, "fp8", "fp8", "fp32")  # an HCA-like compressor, FP8 planes
PAIR = (("bf16", 4, True, [11, 12], [1, 1], 1, 32, 8, "fp8", "fp8", "fp32"),  # a CSA layer's two compressors
        ("bf16", 4, True, [11, 12], [1, 1], 1, 32, 8, "index-fp4", "fp4", "fp32"))
CASES = {"qkv_rope_compress": (MAIN,), "qkv_rope_compress_pair": PAIR}


def _case(op_name, seed=0):
    """(qkv_norm_rope args / attrs, compressor op, args / attrs) sharing positions, slots and the main planes."""
    halves = [operands(*c, seed=seed + i + 1) for i, c in enumerate(CASES[op_name])]
    args, attrs, _, _ = halves[0]
    if len(halves) == 2:
        (a1, at1, _, _) = halves[1]
        args = {**{(k if k in ("pos", "slot", "block_table") else f"{k}_0"): v for k, v in args.items()},
                **{f"{k}_1": v for k, v in a1.items() if k not in ("pos", "slot", "block_table")}}
        attrs = {**{f"{k}_0": v for k, v in attrs.items()}, **{f"{k}_1": v for k, v in at1.items()}}
    h = "_0" if len(halves) == 2 else ""
    g = torch.Generator().manual_seed(seed)
    B, d, rope, dt = args["pos"].shape[0], 32, 8, torch.bfloat16
    n_slots = args[f"state_kv{h}"].shape[0]
    below = args[f"p0{h}"].shape[0]  # whole envelopes: the compressed rows' region
    n_rows = below + n_slots * SLOT_ROWS
    for i, p in enumerate(main_planes("fp8", n_rows, d, rope, dt, g)):
        args[f"p{i}{h}"] = p
    q_args = {"q": (torch.randn(B, 1, 4, d, generator=g) * 2).to(dt),
              "kv": (torch.randn(B, 1, d, generator=g) * 3).to(dt),
              "norm": torch.rand(d, generator=g) + 0.5, "pos": args["pos"], "slot": args["slot"],
              "qi": torch.randn(B, 1, 4, 32, generator=g).to(dt) if h else None,
              **{f"p{i}": args[f"p{i}{h}"] for i in range(3)}}
    q_attrs = {"eps": 1e-6, "dim": rope, "theta": 10000.0, "yarn": (16.0, 256, 32.0, 1.0), "kv_round_dims": d - rope,
               "kv_round_block": 8, "qi_round": "fp4" if h else "none", "q_mean": "fp32", "window": WINDOW,
               "slot_rows": SLOT_ROWS, "n_rows": n_rows, "layer_row": LAYER_ROW, "fmt": "fp8"}
    return q_args, q_attrs, ROPE_COMPRESS[op_name].second.name, args, attrs


def _outs(name, args):
    """Fresh activation results and the tied results (the operand tensors themselves) of `name`."""
    op = get_op(name)
    outs = {r: args[o] for r, o in op.tied.items() if args.get(o) is not None}
    if name == "qkv_norm_rope":
        outs.update(q_out=poisoned(args["q"].shape, args["q"].dtype)[0],
                    kv_out=poisoned(args["kv"].shape, args["kv"].dtype)[0])
        if args["qi"] is not None:
            outs["qi_out"] = poisoned(args["qi"].shape, args["qi"].dtype)[0]
    return outs


def _clone(args):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def check(op_name):
    q_args, q_attrs, second, c_args, c_attrs = _case(op_name)
    fresh = {**{f"p{i}": q_args[f"p{i}"].clone() for i in range(3)}}
    # the two launches, as before the pass: the prologue, then the compressor on the planes it wrote
    qa = _clone(q_args)
    q_outs = _outs("qkv_norm_rope", qa)
    launch("qkv_norm_rope", qa, q_attrs, q_outs)
    ca = _clone(c_args)
    rc = ROPE_COMPRESS[op_name]
    for i, n in enumerate(rc.c_planes):
        ca[n] = qa[f"p{i}"]
    c_outs = _outs(second, ca)
    launch(second, ca, c_attrs, c_outs)
    want = {**{k: v for k, v in q_outs.items() if not k[1:].isdigit()},
            **{rc.result_map[k]: v for k, v in c_outs.items()}}
    # the one launch
    fa = {**_clone({k: v for k, v in q_args.items()}),
          **{rc.operand_map[k]: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c_args.items()
             if k not in rc.c_planes and k not in ("pos", "slot")}}
    outs = {**{k: v for k, v in _outs("qkv_norm_rope", fa).items() if not k[1:].isdigit()},
            **{r: fa[o] for r, o in get_op(op_name).tied.items() if fa.get(o) is not None}}
    attrs = {**q_attrs, **{f"c_{k}": v for k, v in c_attrs.items()}}
    calls = launch(op_name, fa, attrs, outs)
    fn = "rope_compress_pair_kernel" if second == "compress_pair" else "rope_compress_kernel"
    assert [c.kernel_name for c in calls] == [fn]
    assert sorted(outs) == sorted(want), (sorted(outs), sorted(want))
    for k, w in want.items():
        assert torch.equal(outs[k].view(torch.uint8), w.view(torch.uint8)), f"{op_name} {k} differs"
    # the step wrote rows of both kinds into the main planes: window rows above `below`, compressed rows under it
    below = q_attrs["n_rows"] - c_args[rc.second.operand_names[4]].shape[0] * SLOT_ROWS
    changed = (outs["q0"].view(torch.uint8) != fresh["p0"].view(torch.uint8)).any(-1).nonzero().flatten()
    assert (changed >= below).any() and (changed < below).any(), f"{op_name}: rows written {changed.tolist()}"


@pytest.mark.parametrize("op_name", sorted(CASES))
def test_one_launch_is_the_two(op_name):
    check(op_name)


def test_a_program_range_one_short_is_caught(monkeypatch):
    """The launch one program short (the last sequence's compressor never runs)."""
    real = rope_compress.specialise

    def short(*a):
        (c,) = real(*a)
        c.grid = (c.grid[0] - 1, 1, 1)
        return [c]

    monkeypatch.setattr(rope_compress, "specialise", short)
    with pytest.raises(AssertionError, match="differs"):
        check("qkv_rope_compress")


def test_a_compressor_reading_the_prologue_operand_is_caught(monkeypatch, tmp_path):
    kc.install_broken_kernel(monkeypatch, tmp_path, rope_compress, "rope_compress_pair_kernel",
                             "compress_program(pid - A, kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0,",
                             "compress_program(pid - A, kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr,")
    with pytest.raises(AssertionError, match="differs"):
        check("qkv_rope_compress_pair")
