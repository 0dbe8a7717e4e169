"""ONNX lowerings of the `moe` kernel family: moe_experts_shared, moe_experts.

The routed experts (`moe_routed`): tokens grouped by expert, never a copy of an expert's weights.

Any ONNX node that picks expert e out of a stacked `[E, out, in]` weight (Gather, Slice) copies the matrix on
every step, and computing every expert on every token reads all E of them. Here each expert's matrices are
separate graph inputs (views of the stacked weight that the runtime makes once: `onnx_weights`), and a step
sorts its (token, slot) pairs by expert, splits the sorted activations into one group per expert (empty
for an expert no token chose: a zero-row Gemm reads nothing) and runs three Gemms per expert on its group.
So a step reads each active expert's weights once, whatever the number of pairs routed to it, and prefill
routes exactly like decode.

The weighted sum back into the tokens is one ScatterND with reduction "add" over the pairs in expert
order: each token's sum starts from zero and adds its experts in ascending order, the order of the
reference (`ops.moe.moe_experts`: `index_add_` expert by expert).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ...ir.types import TensorType
from . import gemm_input


def moe_routed(g, x: str, xt: TensorType, weights: str, indices: str, it: TensorType, w: tuple[str, str, str],
               wt: tuple[TensorType, TensorType, TensorType], k: int, limit: float, route_weight: str,
               scales: tuple = (None, None, None), block: int | None = None, act: str = "native", ep: int = 1) -> str:
    """`sum_k weight_k * w2_e(swiglu(w1_e x, w3_e x))` over each token's k experts (`ops.moe.moe_experts`);
    `w` = (w1, w2, w3) stacked `[E, out, in]`, FP4 / FP8 with `scales` or fp32 / bf16 without; `x` as the
    first GEMMs see it (`act` "fp8": already rounded, `gemm_input`), w2's input rounded here."""
    D = xt.shape[-1]
    N = xt.numel // D
    E = wt[0].shape[0]
    P = N * k
    flat = g.reshape(x, (N, D))
    pairs = g.reshape(g.as_i64(indices, it.dtype), (P,))
    # pairs sorted by expert (ascending; TopK on the ids as floats: exact below 2^24 experts)
    weights = g.reshape(weights, (P,))
    if ep > 1:
        # A pair of no expert of the stack (id outside [0, E): another rank's slot, `local_experts`) adds
        # nothing: it runs on expert 0 with weight 0 (exactly +-0 for a finite expert output). Dropping
        # the pairs would give the Gemms a data-dependent row count, which the fixed-shape FP8 rounding of
        # w2's input below does not take; the GPU kernels skip them (`kernels/moe.py`).
        foreign = g.op("Or", g.op("Less", pairs, g.iscalar(0)), g.op("GreaterOrEqual", pairs, g.iscalar(E)))
        pairs = g.where(foreign, g.iscalar(0), pairs)
        weights = g.where(foreign, g.scalar(0.0), weights)
    order = g.op("TopK", g.cast(pairs, TensorProto.FLOAT), g.i64(P), n_out=2, axis=0, largest=0, sorted=1)[1]
    tok = g.op("Div", order, g.iscalar(k))  # the token of each sorted pair
    wsort = g.unsqueeze(g.op("Gather", weights, order, axis=0), -1)  # [P, 1]
    counts = g.sum(g.cast(g.op("Equal", g.unsqueeze(pairs, -1), g.const(np.arange(E), np.int64)),
                          TensorProto.INT64), 0)  # [E]
    xs = g.op("Split", g.op("Gather", flat, tok, axis=0), counts, n_out=E, axis=0)

    def expert(which: int, e: int) -> str:
        return g.weight(w[which], wt[which], scales[which], block, index=e)[0]

    gate = g.concat([g.op("Gemm", xs[e], expert(0, e), transB=1) for e in range(E)], 0)  # [P, I]
    up = g.concat([g.op("Gemm", xs[e], expert(2, e), transB=1) for e in range(E)], 0)
    lim = g.scalar(limit)
    gate = g.op("Min", gate, lim)
    h = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), g.op("Clip", up, g.op("Neg", lim), lim))
    if route_weight == "before_w2":
        h = g.op("Mul", h, wsort)
    if act == "fp8":  # w2's input as its FP8 GEMM sees it (the weighting above comes first, as in the op)
        h = g.act_qdq(h, TensorType((P, wt[0].shape[1]), "fp32"))
    hs = g.op("Split", h, counts, n_out=E, axis=0)
    y = g.concat([g.op("Gemm", hs[e], expert(1, e), transB=1) for e in range(E)], 0)  # [P, D]
    if route_weight == "after_w2":
        y = g.op("Mul", y, wsort)
    out = g.op("ScatterND", g.const(np.zeros((N, D), np.float32)), g.unsqueeze(tok, -1), y, reduction="add")
    return g.reshape(out, xt.shape)


def lower_moe_experts_shared(g, o, a, r):
    xt, lim = o.types["x"], a["limit"]
    x = gemm_input(g, "moe_experts_shared", a, o.x, xt)
    routed = moe_routed(g, x, xt, o.weights, o.indices, o.types["indices"], (o.w1, o.w2, o.w3),
                        (o.types["w1"], o.types["w2"], o.types["w3"]), o.types["indices"].shape[-1], lim,
                        a["route_weight"], (o.w1_scale, o.w2_scale, o.w3_scale), a["block"], a["act"])
    sa = {"act": a["shared_act"], "out_dtype": a["out_dtype"]}
    xs = gemm_input(g, "moe_experts_shared", sa, o.x, xt)
    sb = a["shared_block"]
    gt = g.op("Min", g.linear(xs, xt, o.s1, o.types["s1"], o.s1_scale, sb), g.scalar(lim))
    up = g.op("Clip", g.linear(xs, xt, o.s3, o.types["s3"], o.s3_scale, sb), g.scalar(-lim), g.scalar(lim))
    h = g.op("Mul", g.op("Mul", gt, g.op("Sigmoid", gt)), up)
    ht = xt.with_shape(*xt.shape[:-1], o.types["s1"].shape[0])
    h = gemm_input(g, "moe_experts_shared", sa, h, ht)
    return g.op("Add", routed, g.linear(h, ht, o.s2, o.types["s2"], o.s2_scale, sb))


def lower_moe_experts(g, o, a, r):
    x = gemm_input(g, "moe_experts", a, o.x, o.types["x"])
    return moe_routed(g, x, o.types["x"], o.weights, o.indices, o.types["indices"], (o.w1, o.w2, o.w3),
                      (o.types["w1"], o.types["w2"], o.types["w3"]), o.types["indices"].shape[-1], a["limit"],
                      a["route_weight"], (o.w1_scale, o.w2_scale, o.w3_scale), a["block"], a["act"], a.get("ep", 1))
