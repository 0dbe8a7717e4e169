"""The cpu target's Sinkhorn (`codegen/onnx/mhc.sinkhorn`): eps written out only in the first column
normalisation, eps-free `LpNormalization` after it and one final 1 / (1 + eps), against the spec's
formula (v4-reference.md 3.2: eps in every denominator) evaluated in float64.

Tolerance: 4e-7 absolute (comb entries lie in [0, 1]). The spec's own formula evaluated in fp32 is
2e-7 .. 3e-7 from float64 on these inputs (measured, and asserted below so the bound stays at the size of
fp32 rounding); the faults below move the result by >= 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from v4compile.codegen.onnx import mhc
from v4compile.codegen.onnx.graph import Graph

N, EPS, ITERS, M = 4, 1e-6, 20, 512
TOL = 4e-7


def spec_sinkhorn(p, eps: float, iters: int):
    """v4-reference.md 3.2 after the softmax, in the array's own dtype (numpy float64 or torch fp32)."""
    keep = {"keepdims": True} if isinstance(p, np.ndarray) else {"keepdim": True}
    p = p / (p.sum(-2, **keep) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(-1, **keep) + eps)
        p = p / (p.sum(-2, **keep) + eps)
    return p


def _inputs():
    """Softmax rows + eps, as hc_pre feeds Sinkhorn: logits of growing scale (peaked rows: slow
    convergence), a column the softmax leaves empty (sums ~ n * eps, where eps matters most), and sparse
    supports (a few large logits per row: Sinkhorn far from converged after 20 iterations)."""
    rng = np.random.default_rng(0)
    fams = {}
    for s in (0.1, 1.0, 3.0, 10.0, 100.0):
        fams[f"scale {s:g}"] = rng.standard_normal((M, N, N)) * s
    dead = rng.standard_normal((M, N, N)) * 3
    dead[..., 0] = -60.0
    fams["empty column"] = dead
    for q in (0.2, 0.5):
        fams[f"support {q}"] = np.where(rng.random((M, N, N)) < q, 40.0, 0.0) + rng.standard_normal((M, N, N)) * 0.01
    out = {}
    for k, x in fams.items():
        e = np.exp(x - x.max(-1, keepdims=True))
        out[k] = (e / e.sum(-1, keepdims=True)).astype(np.float32) + np.float32(EPS)
    return out


INPUTS = _inputs()
WANT = {k: spec_sinkhorn(x.astype(np.float64), EPS, ITERS) for k, x in INPUTS.items()}


def _run(x: np.ndarray, graph=Graph, iters: int = ITERS) -> tuple[np.ndarray, int]:
    import onnxruntime as ort

    g = graph("sinkhorn")
    g.op("Identity", mhc.sinkhorn(g, "x", EPS, iters), out="y")
    g.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)))
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape)))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(g.model().SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0], len(g.nodes) - 1


def _worst(graph=Graph, iters: int = ITERS) -> tuple[float, str]:
    errs = {k: float(np.abs(_run(x, graph, iters)[0] - WANT[k]).max()) for k, x in INPUTS.items()}
    k = max(errs, key=errs.get)
    return errs[k], k


def test_sinkhorn_matches_the_spec_within_fp32_rounding():
    err, where = _worst()
    assert err < TOL, (err, where)
    # the bound is the size of fp32 rounding: the spec's own formula in fp32 comes close to it
    fp32 = max(float(np.abs(spec_sinkhorn(torch.from_numpy(x), EPS, ITERS).numpy() - WANT[k]).max())
               for k, x in INPUTS.items())
    assert TOL / 4 < fp32 < TOL, fp32


def test_sinkhorn_is_two_nodes_per_iteration():
    """Per-node overhead is a decode step's cost: 2 * iters + 2 nodes (the exact chain took 4 * iters + 3);
    one iteration is the first column normalisation alone."""
    x = INPUTS["scale 1"][:1]
    assert _run(x)[1] == 2 * ITERS + 2
    one, nodes = _run(x, iters=1)
    assert nodes == 3 and np.abs(one - spec_sinkhorn(x.astype(np.float64), EPS, 1)).max() < TOL


class _NoFirstEps(Graph):
    def scalar(self, v: float) -> str:
        return super().scalar(0.0 if v == EPS else v)


class _NoFinalFactor(Graph):
    def op(self, op_type, *inputs, **kw):
        return inputs[0] if op_type == "Mul" else super().op(op_type, *inputs, **kw)


@pytest.mark.parametrize("fault", ["first eps dropped", "no final 1/(1+eps)", "one iteration fewer"])
def test_a_broken_sinkhorn_is_caught(fault):
    graph = {"first eps dropped": _NoFirstEps, "no final 1/(1+eps)": _NoFinalFactor}.get(fault, Graph)
    err, _ = _worst(graph, ITERS - 1 if fault == "one iteration fewer" else ITERS)
    assert err > 2 * TOL, (fault, err)
