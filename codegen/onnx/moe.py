"""ONNX lowerings of the `moe` kernel family: moe_experts_shared, moe_experts.

The routed experts (`moe_routed`): tokens grouped by expert, never a copy of an expert's weights.

Any ONNX node that picks expert e out of a stacked `[E, out, in]` weight (Gather, Slice) copies the matrix on
every step, and computing every expert on every token reads all E of them. Here each expert's matrices are
separate graph inputs (views of the stacked weight that the runtime makes once: `onnx_weights`), and a step
sorts its (token, slot) pairs by expert, splits the sorted activations into one group per expert (empty
for an expert no token chose: a zero-row Gemm reads nothing) and runs three Gemms per expert on its group.
So a step reads each active expert's weights once, whatever the number of pairs routed to it, and prefill
routes like decode.

Where it is cheaper, every expert is computed for every token instead: three GEMMs over the whole
stacks (read in place: no copy), the last one summing each token's experts weighted by its routing
(`_dense`). Grouping costs three
Gemm nodes per expert plus the splits and concats whatever the step routes (~1.3 us a node on one core:
tiny decode b1 ran 2.5 ms for 1,888 nodes); computing every expert costs the bytes of the experts no pair
chose (~10 GB/s) and the multiply-adds of the pairs not routed (~40 G/s for these small GEMMs):
`dense_is_cheaper` weighs the two (for weights applied after w2, transformers' routing, only). Tiny's
decode steps (8 experts of 24 KB) go dense: 61 -> 39 nodes per MoE layer, its shared expert included,
decode b1 -7 %; its 64-token prefill (4x the multiply-adds, +9 % measured when dense) and every step of
a model with MB-sized experts (mid: 6 MB each) stay grouped, so their bytes never scale with E.
On the dense path the shared expert is one more expert of the stacks (expert E, its row of every token
taken with weight 1: `lower_moe_experts_shared`), so its three GEMMs and SwiGLU are no nodes of their own:
tiny's MoE step at one token 32 -> 26 nodes after ONNX Runtime's optimiser, 45 -> 38 us (same-process A/B).
With the routing weights applied before w2 and the sum over experts done by w2's GEMM (issue 22: no sort
of the pairs, no gather of their rows, no scatter back): 26 -> 15 nodes, 17.1 -> 13.0 us a step of
`moe_experts_shared` alone at one token, 26.8 -> 19.6 us at eight (same-process A/B, 1 thread).

On the grouped path the weighted sum back into the tokens is one ScatterND with reduction "add" over the
pairs in expert order: each token's sum starts from zero and adds its experts in ascending order, the
order of the reference (`ops.moe.moe_experts`: `index_add_` expert by expert).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ...ir.types import TensorType
from ..onnx_weights import logical_shape
from . import gemm_input, linear, quant

# the cost model of `dense_is_cheaper` (one core, measured on bench_cpu's tiny: see the module's docstring)
NODE_US = 1.3  # a grouped-path node
BYTES_PER_US = 10_000.0  # weights streamed
MACS_PER_US = 40_000.0  # small fp32 GEMMs


def dense_is_cheaper(E: int, k: int, N: int, I: int, D: int) -> bool:
    """Whether computing all E experts on all N tokens (k experts each; matrices I x D) costs less than
    the grouped path's 3 E Gemm nodes: the experts no pair chose read, the pairs not routed multiplied."""
    unread = max(E - N * k, 0) * 3 * I * D * 4 / BYTES_PER_US  # at least this many experts unchosen
    unrouted = N * (E - k) * 3 * I * D / MACS_PER_US
    return unread + unrouted <= 3 * E * NODE_US


def takes_dense(route_weight: str, E: int, k: int, N: int, I: int, D: int) -> bool:
    """Whether `moe_routed` computes every expert on every token (see the module's docstring)."""
    return route_weight == "after_w2" and dense_is_cheaper(E, k, N, I, D)


def moe_routed(g, x: str, xt: TensorType, weights: str, indices: str, it: TensorType, w: tuple[str, str, str],
               wt: tuple[TensorType, TensorType, TensorType], k: int, limit: float, route_weight: str,
               scales: tuple = (None, None, None), block: int | None = None, act: str = "native", ep: int = 1,
               shared: tuple | None = None) -> str:
    """`sum_k weight_k * w2_e(swiglu(w1_e x, w3_e x))` over each token's k experts (`ops.moe.moe_experts`);
    `w` = (w1, w2, w3) stacked `[E, out, in]`, FP4 / FP8 with `scales` or fp32 / bf16 without; `x` as the
    first GEMMs see it (`act` "fp8": already rounded, `gemm_input`), w2's input rounded here. `shared`
    (dense path only): the shared expert's (s1, s2, s3) as fp32 graph inputs, computed as expert E and
    added to the routed sum."""
    D = xt.shape[-1]
    N = xt.numel // D
    E = wt[0].shape[0]
    P = N * k
    flat = g.reshape(x, (N, D))
    pairs = g.reshape(g.as_i64(indices, it.dtype), (N, k, 1))  # the dense path's layout: [N, X, 1] weights
    weights = g.reshape(weights, (N, k, 1))
    if ep > 1:
        # A pair of no expert of the stack (id outside [0, E): another rank's slot, `local_experts`) adds
        # nothing: it runs on expert 0 with weight 0 (exactly +-0 for a finite expert output). Dropping
        # the pairs would give the Gemms a data-dependent row count, which the fixed-shape FP8 rounding of
        # w2's input below does not take; the GPU kernels skip them (`kernels/moe.py`).
        foreign = g.op("Or", g.op("Less", pairs, g.iscalar(0)), g.op("GreaterOrEqual", pairs, g.iscalar(E)))
        pairs = g.where(foreign, g.iscalar(0), pairs)
        weights = g.where(foreign, g.scalar(0.0), weights)
    # after w2 only: another rank's pairs run on (expert 0, weight 0) above, so a token can hold one
    # (expert, token) pair twice; the dense path adds the copy's weight 0 to the expert's, before w2 the
    # grouped path would add the row's output again
    if takes_dense(route_weight, E, k, N, wt[0].shape[1], D):  # w1, w3 [E, I, D]
        return _dense(g, flat, pairs, weights, w, wt, limit, scales, block, act, xt, shared)
    assert shared is None, "the shared expert joins the dense path's stacks only"
    pairs, weights = g.reshape(pairs, (P,)), g.reshape(weights, (P,))
    # pairs sorted by expert (ascending; TopK on the ids as floats: exact below 2^24 experts)
    order = g.op("TopK", g.cast(pairs, TensorProto.FLOAT), g.i64(P), n_out=2, axis=0, largest=0, sorted=1)[1]
    tok = g.op("Div", order, g.iscalar(k))  # the token of each sorted pair
    wsort = g.unsqueeze(g.op("Gather", weights, order, axis=0), -1)  # [P, 1]
    counts = g.sum(g.cast(g.op("Equal", g.unsqueeze(pairs, -1), g.const(np.arange(E), np.int64)),
                          TensorProto.INT64), 0)  # [E]
    xs = g.op("Split", g.op("Gather", flat, tok, axis=0), counts, n_out=E, axis=0)

    def expert(which: int, e: int) -> str:
        return linear.weight(g, w[which], wt[which], scales[which], block, index=e)[0]

    gate = g.concat([g.op("Gemm", xs[e], expert(0, e), transB=1) for e in range(E)], 0)  # [P, I]
    up = g.concat([g.op("Gemm", xs[e], expert(2, e), transB=1) for e in range(E)], 0)
    h = _swiglu(g, gate, up, limit)
    if route_weight == "before_w2":
        h = g.op("Mul", h, wsort)
    if act == "fp8":  # w2's input as its FP8 GEMM sees it (the weighting above comes first, as in the op)
        h = quant.act_qdq(g, h, TensorType((P, wt[0].shape[1]), "fp32"))
    hs = g.op("Split", h, counts, n_out=E, axis=0)
    y = g.concat([g.op("Gemm", hs[e], expert(1, e), transB=1) for e in range(E)], 0)  # [P, D]
    if route_weight == "after_w2":
        y = g.op("Mul", y, wsort)
    out = g.op("ScatterND", g.const(np.zeros((N, D), np.float32)), g.unsqueeze(tok, -1), y, reduction="add")
    return g.reshape(out, xt.shape)


def _swiglu(g, gate: str, up: str, limit: float) -> str:
    lim = g.scalar(limit)
    gate = g.op("Min", gate, lim)
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), g.op("Clip", up, g.op("Neg", lim), lim))


def _dense(g, flat, pairs, weights, w, wt, limit, scales, block, act, xt, shared=None):
    """Every expert on every token, each token's experts weighted by its routing weight (0 for an expert
    it did not choose) and summed by the GEMM of w2 itself: `sum_e w_ne h_ne w2_e^T` is one `[N, X * I] x
    [X * I, D]` Gemm over the weighted activations of all experts, where the reference weights each routed
    output after w2 and adds them in expert order (the same sum, rounded in another order: fp32, the same
    size of error as the GEMMs' own summation order). `pairs` and `weights` `[N, k, 1]`: the routing; a
    token's weights per expert `[N, X, 1]` are one ScatterElements (reduction add: a pair repeated, as
    another rank's pairs on (expert 0, weight 0), adds its weight once per pair, as the reference does).
    w1 and w3 as one `[E * I, D]` matrix each, w2 as one `[D, E * I]` (a Reshape / Transpose of the stack,
    which ONNX Runtime folds once: then pre-packed Gemms). The `shared` expert's matrices join the stacks
    as expert E with weight 1 for every token (Concats of constants, folded once at load as the Reshapes
    are: a second copy of the stacks, small wherever this path is taken). FP8 activations (`act`): w2's
    input is rounded per expert row before the weighting, as the reference rounds it before w2."""
    N, D = xt.numel // xt.shape[-1], xt.shape[-1]
    E, I = wt[0].shape[0], wt[0].shape[1]
    stack = [linear.weight(g, w[i], wt[i], scales[i], block)[0] for i in range(3)]
    up = [g.reshape(stack[i], (E * I, D)) for i in (0, 2)]
    if shared is not None:
        up = [g.concat([up[0], shared[0]], 0), g.concat([up[1], shared[2]], 0)]  # [(E + 1) * I, D]
        stack[1] = g.concat([stack[1], g.reshape(shared[1], (1, D, I))], 0)  # [E + 1, D, I]
    X = E + (shared is not None)  # experts computed
    down = g.reshape(g.op("Transpose", stack[1], perm=[1, 0, 2]), (D, X * I))  # [D, X * I]

    def up_proj(s: str) -> str:
        return g.op("Gemm", flat, s, transB=1)  # [N, X * I]

    h = g.reshape(_swiglu(g, up_proj(up[0]), up_proj(up[1]), limit), (N, X, I))
    if act == "fp8":
        h = quant.act_qdq(g, h, TensorType((N, X, I), "fp32"))
    base = np.zeros((N, X, 1), np.float32)
    base[:, E:] = 1.0  # the shared expert: weight 1 for every token
    h = g.op("Mul", h, g.op("ScatterElements", g.const(base), pairs, weights, axis=1, reduction="add"))
    out = g.op("Gemm", g.reshape(h, (N, X * I)), down, transB=1)  # [N, D]
    return g.reshape(out, xt.shape)


def lower_moe_experts_shared(g, o, a, r):
    xt, lim = o.types["x"], a["limit"]
    x = gemm_input(g, "moe_experts_shared", a, o.x, xt)
    wt = (o.types["w1"], o.types["w2"], o.types["w3"])
    (E, I), D = wt[0].shape[:2], xt.shape[-1]
    k = o.types["indices"].shape[-1]
    st = (o.types["s1"], o.types["s2"], o.types["s3"])
    # the shared expert as expert E of the dense path: where it sees the routed experts' activations (fp8
    # blocks are fixed at 128 wide, `gemm_input`) and has their dense shapes (all fp32 to the graph)
    fold = takes_dense(a["route_weight"], E, k, xt.numel // D, I, D) and a["shared_act"] == a["act"] and \
        [logical_shape(t.dtype, t.shape) for t in st] == [logical_shape(t.dtype, t.shape)[1:] for t in wt]
    sw = (o.s1, o.s2, o.s3)
    shared = tuple(linear.weight(g, sw[i], st[i], (o.s1_scale, o.s2_scale, o.s3_scale)[i], a["shared_block"])[0]
                   for i in range(3)) if fold else None
    routed = moe_routed(g, x, xt, o.weights, o.indices, o.types["indices"], (o.w1, o.w2, o.w3), wt, k, lim,
                        a["route_weight"], (o.w1_scale, o.w2_scale, o.w3_scale), a["block"], a["act"],
                        shared=shared)
    if fold:
        return routed
    sa = {"act": a["shared_act"], "out_dtype": a["out_dtype"]}
    xs = gemm_input(g, "moe_experts_shared", sa, o.x, xt)
    sb = a["shared_block"]
    gt = g.op("Min", linear.linear(g, xs, xt, o.s1, o.types["s1"], o.s1_scale, sb), g.scalar(lim))
    up = g.op("Clip", linear.linear(g, xs, xt, o.s3, o.types["s3"], o.s3_scale, sb), g.scalar(-lim), g.scalar(lim))
    h = g.op("Mul", g.op("Mul", gt, g.op("Sigmoid", gt)), up)
    ht = xt.with_shape(*xt.shape[:-1], o.types["s1"].shape[0])
    h = gemm_input(g, "moe_experts_shared", sa, h, ht)
    return g.op("Add", routed, linear.linear(g, h, ht, o.s2, o.types["s2"], o.s2_scale, sb))


def lower_moe_experts(g, o, a, r):
    x = gemm_input(g, "moe_experts", a, o.x, o.types["x"])
    return moe_routed(g, x, o.types["x"], o.weights, o.indices, o.types["indices"], (o.w1, o.w2, o.w3),
                      (o.types["w1"], o.types["w2"], o.types["w3"]), o.types["indices"].shape[-1], a["limit"],
                      a["route_weight"], (o.w1_scale, o.w2_scale, o.w3_scale), a["block"], a["act"], a.get("ep", 1))
