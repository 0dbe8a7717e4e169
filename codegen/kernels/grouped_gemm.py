"""grouped_gemm family: `grouped_out_proj` (wo_a) and `rope_out_proj` (wo_a loading its input through the
inverse RoPE: `gemm_kernel`'s rope prologue), a block-diagonal GEMM: the flattened heads split into
`groups` groups, group g's columns multiplied by its own rows of W. One launch of the gemm kernel with the
group on grid axis z. With `o_scale` the input is pre-quantised e4m3 with one fp32 scale per 128 values
(from `inv_rope_group_quant`): FP8 weights then multiply fp8 x fp8 with both scales per K block; other
weights take the input dequantised to `out_dtype`, as the reference does."""

from __future__ import annotations

from . import KernelCall, TensorArg
from .gemm import gemm_call


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name not in ("grouped_out_proj", "rope_out_proj"):
        raise KeyError(f"grouped_gemm family has no op '{op_name}'")
    o, z = operands["o"], results["z"]
    B, T = o.shape[:2]
    hd = o.type.numel // max(B * T, 1)
    # view o [B, T, H, d] as rows of the flattened heads (H and d collapse: d is contiguous within a head)
    st = o.strides
    if st[-1] != 1 or any(st[i] != st[i + 1] * o.shape[i + 1] for i in range(2, o.type.rank - 1)):
        raise ValueError(f"grouped_out_proj: heads of o must be contiguous, strides {st}")
    flat = TensorArg(o.type.with_shape(B, T, hd), (st[0], st[1], 1), o.align)
    rope = None
    if op_name == "rope_out_proj":
        rope = {"pos": operands["pos"], "head_dim": o.shape[-1], "attrs": attrs}
    return gemm_call("grouped_gemm", flat, operands["w"], operands.get("scale"), z, None,
                      block=attrs.get("block", 128), act=attrs.get("act", "native"), eps=0.0,
                      names={"x": "o", "xs": "o_scale", "w": "w", "s": "scale", "y": "z", "pos": "pos"},
                      groups=attrs["groups"], x_scale=operands.get("o_scale"), rope=rope)
