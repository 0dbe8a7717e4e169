"""The attention front as one op: the first GEMMs of the attention input (a `linear_pair`, or one `linear`
where every GEMM of that input stacked into one) and the `norm_linear` (q_norm + the merged `wq_b`) that reads
one of their outputs. The reference is the composition of the two ops' references, so the fusion never
changes a value."""

from __future__ import annotations

from ..ir.registry import Cost, defop, require
from .basic import GEMM_ATTRS
from .basic import linear
from .fused import PAIR_ATTRS, _side, linear_pair, norm_linear

# the norm GEMM's own attributes (its `norm_linear` attributes but `acc`, which the pair's covers), and where
# its input lies: columns [col, col + K) of the pair's result y<src> (K: the norm weight's length)
NORM_ATTRS = {"eps": float, **{k: v for k, v in GEMM_ATTRS.items() if k != "acc"}, "src": int, "col": (int, 0)}
PAIR_KEYS = tuple(PAIR_ATTRS)


def _parts(attrs: dict) -> tuple[dict, dict]:
    """(the `linear_pair` attributes, the `norm_linear` attributes) of a `pair_norm_linear`."""
    pair = {k: attrs[k] for k in PAIR_KEYS}
    norm = {k: attrs[k] for k in ("eps", "block", "act", "out_dtype")}
    return pair, {**norm, "acc": attrs["acc"]}


def _first(x, w0, w1, scale0, scale1, pair, ref: bool):
    """The first GEMMs' results (`ref`) or result types: the pair's two, or one `linear`'s without w1."""
    if w1 is not None:
        return linear_pair.ref(x, w0, w1, scale0, scale1, **pair) if ref else \
            linear_pair.result_types([x, w0, w1, scale0, scale1], pair)
    if ref:
        return (linear.ref(x, w0, scale0, **_side(pair, 0)),)
    return tuple(linear.result_types([x, w0, scale0], _side(pair, 0)))


@defop("pair_norm_linear(x, w0, w1?, scale0?, scale1?, norm, w, scale?) -> y0, y1?, y",
       attrs={**PAIR_ATTRS, **NORM_ATTRS}, kernel="attn_front", follows={"y1": "w1"})
def pair_norm_linear(x, w0, w1, scale0, scale1, norm, w, scale, **attrs):
    """`linear_pair(x)` (without w1: `linear(x, w0)`) and the `norm_linear` of columns [col, col + K) of its
    result y<src> (V4: q_a, the first q_lora_rank columns of the merged `wqkv_a`), in one launch: the norm
    GEMM's programs start once every program writing y<src> is done (the RMS is over the whole row)."""
    pair, lin = _parts(attrs)
    ys = _first(x, w0, w1, scale0, scale1, pair, ref=True)
    col = attrs["col"]
    a = ys[attrs["src"]][..., col:col + norm.shape[0]]
    return (*ys, norm_linear.ref(a, norm, w, scale, **lin))


def _input(ys, norm, attrs):
    """The norm GEMM's input type: the columns of y<src> it reads."""
    src, col = attrs["src"], attrs["col"]
    require(0 <= src < len(ys), "pair_norm_linear src must name a result of the first GEMMs", found=src)
    y = ys[src]
    k = norm.shape[0] if norm.rank == 1 else -1
    require(0 <= col and k > 0 and col + k <= y.shape[-1], "pair_norm_linear reads columns [col, col + K) of "
            f"y{src}", expected=f"col + K <= {y.shape[-1]}", found=(col, k))
    return y.with_shape(*y.shape[:-1], k)


@pair_norm_linear.infer
def _(x, w0, w1, scale0, scale1, norm, w, scale, **attrs):
    pair, lin = _parts(attrs)
    ys = _first(x, w0, w1, scale0, scale1, pair, ref=False)
    return (*ys, norm_linear.result_types([_input(ys, norm, attrs), norm, w, scale], lin)[0])


@pair_norm_linear.cost
def _(operands, results, attrs):
    """The two launches' costs, summed: the norm GEMM still reads its input back from y<src> (the fusion saves
    a launch, not traffic)."""
    x, w0, w1, scale0, scale1, norm, w, scale = operands
    pair, lin = _parts(attrs)
    ys = list(results[:-1])
    pc = linear_pair.cost_of([x, w0, w1, scale0, scale1], ys, pair) if w1 is not None else \
        linear.cost_of([x, w0, scale0], ys, _side(pair, 0))
    nc = norm_linear.cost_of([_input(ys, norm, attrs), norm, w, scale], [results[-1]], lin)
    return Cost(pc.flops + nc.flops, pc.bytes_read + nc.bytes_read, pc.bytes_written + nc.bytes_written)
