"""The attention-side kernel families on the real operands of the tiny model's final IR: a seeded
scenario runs through the op references (IRRunner), and in one prefill chunk (with padding lanes and
compressed history) and one decode step every op of the mhc / qkv_norm_rope / compress / csr / indexer /
sparse_attention / pool_write families is also launched on copies of its operands and compared with the
reference's results: official numerics in bf16 (FP8 main pool, FP4 index pool). (`("hf", "fp32")` also
passes; it is left out of CI for time.)

Tolerances are the families' own (see their test modules): float results 1 bf16 ulp / 1e-5 x max|ref|
(sparse_attention bf16: 2^-8 x max|value rows| + 2 ulps); pool planes and state rings bit for bit
except float planes (same float tolerance); CSR lists exactly (indexer picks as per-lane sets).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import assert_plane  # noqa: E402
from conftest import dense_weights  # noqa: E402
from kernel_check import assert_matches, bf16_ulp, poisoned  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402
from v4compile.config import preset  # noqa: E402
from v4compile.harness import IRRunner, Scenario, ir_logits  # noqa: E402
from v4compile.ir.core import WEIGHT  # noqa: E402
from v4compile.ir.registry import get_op  # noqa: E402
from v4compile.passes import DEFAULT_PIPELINE, PassManager  # noqa: E402
from v4compile.trace import TraceOptions, trace  # noqa: E402
from v4compile.weights_convert import DenseSource, load_ir_weights  # noqa: E402

FAMILIES = {"mhc", "qkv_norm_rope", "compress", "csr", "indexer", "sparse_attention", "pool_write"}
# Prefill chunk 2 = tokens 32..47: seq 0 (40 tokens) ends inside it, seq 1 (30) is padding only. The hf
# variant checks the decode step only (its prefill variants are the unit tests'; this keeps CI time low).
CHECK_CALLS = {"official": {("prefill", 2), ("decode", 0)}, "hf": {("decode", 0)}}


def present_results(opdef, args, n: int) -> list[str]:
    """Names of the n results an op instance returns (the registry's rule: tied / `follows` operands)."""
    return opdef.result_names([args.get(o) for o in opdef.operand_names], n)


def _compare(op, args, want, got, seen):
    opdef = get_op(op.name)
    names = present_results(opdef, args, len(want))
    assert len(names) == len(want), (op.name, names, len(want))
    for n, w in zip(names, want):
        g = got[n]
        what = f"{op.name} {n} ({op.loc})"
        if n == "indices" and op.name == "indexer_select":
            ip = want[0].tolist()
            for lane in range(len(ip) - 1):
                a = sorted(g[ip[lane]:ip[lane + 1]].tolist())
                b = sorted(w[ip[lane]:ip[lane + 1]].tolist())
                assert a == b, f"{what}: lane {lane} picks {a} != {b}"
        elif n == "indices":
            k = int(want[0][-1])
            assert torch.equal(g[:k], w[:k]), what
        elif not w.dtype.is_floating_point or w.element_size() == 1 or n.startswith("state"):
            assert_plane(g, w, what)
        elif op.name == "sparse_attention" and w.dtype == torch.bfloat16:
            d = (g.float() - w.float()).abs()
            vmax = max(float(t.float().abs().max()) for t in [args["kv"]] + [args[f"p{i}"] for i in range(3)
                                                                           if args[f"p{i}"] is not None
                                                                           and args[f"p{i}"].element_size() > 1])
            assert not (d > 2.0 ** -8 * max(vmax, 8.0) + 2 * bf16_ulp(w.float())).any(), what
        else:
            assert_matches(g, w, what, ulps=1.0)
    seen.add(op.name)


def _kind(fn, op, opdef, vals) -> tuple:
    """One check per distinct variant of an op (operands present, overlap, format), whichever function
    meets it first (CI time: each launch runs in the interpreter)."""
    return (op.name, tuple(v is None for v in vals), op.attrs.get("overlap"), op.attrs.get("fmt"))


def _checking_interpreter(calls, seen, check_calls):
    done = set()

    def run(fn, weights, inputs, observe=None, check_types=True):
        calls[fn.name] = calls.get(fn.name, -1) + 1
        checking = (fn.name, calls[fn.name]) in check_calls
        env = {id(v): inputs[v.name] for v in fn.inputs}

        def get(v):
            return None if v is None else (weights[v.name] if v.kind == WEIGHT else env[id(v)])

        for op in fn.ops:
            opdef = get_op(op.name)
            vals = [get(v) for v in op.operands]
            check = checking and opdef.kernel in FAMILIES and _kind(fn, op, opdef, vals) not in done
            if check:
                done.add(_kind(fn, op, opdef, vals))
                args = {o.name: (None if t is None else t.clone()) for o, t in zip(opdef.operands, vals)}
            outs = opdef.run(vals, op.attrs)
            if check:
                res = {}
                for n, w in zip(present_results(opdef, args, len(outs)), outs):
                    tied = opdef.tied.get(n)
                    res[n] = args[tied] if tied else poisoned(w.shape, w.dtype)[0]
                launch(op.name, args, op.attrs, res)
                _compare(op, args, outs, res, seen)
            for r, t in zip(op.results, outs):
                env[id(r)] = t
        return {name: get(v) for name, v in fn.outputs}
    return run


@pytest.mark.slow
# hf / fp32 (native pool) runs the same kernels with other constexprs; its unit tests cover it, and each
# traced run costs tens of seconds of interpreter time, so CI runs the official / bf16 one only.
@pytest.mark.parametrize("numerics,dtype", [("official", "bf16")])
def test_families_on_traced_operands(numerics, dtype):
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(numerics=numerics, dtype=dtype, batch=2, chunk=16, decode_batch=2, capacity=160))
    final = PassManager(DEFAULT_PIPELINE).run(m).module
    weights = load_ir_weights(final, DenseSource(dense_weights("tiny")))
    calls, seen = {}, set()
    sc = Scenario.make(cfg.vocab_size, 2, 40, 1, seed=4)  # 10 CSA rows > index_topk 4
    ir_logits(IRRunner(final, weights, interpreter=_checking_interpreter(calls, seen, CHECK_CALLS[numerics])), sc)
    expected = {"hc_expand", "hc_pre_norm", "mhc_post_pre", "mhc_post_head", "qkv_norm_rope", "compress_paged",
                "csr_window", "csr_compressed", "indexer_select", "sparse_attention"}
    if numerics == "official":
        expected.add("pool_write_window")  # decode writes the ring inside qkv_norm_rope
    assert expected <= seen, f"ops never checked: {expected - seen}"
