"""Weights as the cpu target's graphs take them: stored tensors, or dense fp32 tensors derived from them.

ONNX Runtime has no exact kernel for the released block formats (FP8 e4m3 with 128 x 128 E8M0 scales, FP4
e2m1 with 1 x 32 E8M0 scales), and any ONNX node that selects one expert's matrix from a stacked `[E, ...]`
weight copies it on every step. So a graph may take, instead of a stored tensor, a *derived* one, which the
runtime builds once when it loads the artifact and shares between all sessions:
* `index`: expert `index` of a stacked weight: a view of the mapped shard, no copy (`w#3`);
* `scale` (+ `block`): the weight dequantised to fp32 with its scale grid, by `ops.basic.dequant_weight`,
  the reference's own function, so the graph sees bit for bit the weights the reference multiplies by;
* `dtype` "fp32" on a bf16 weight: the exact upcast.

The artifact's cpu target records each derived input (`derived`: name -> {"of", "index", "scale",
"block", "dtype", "shape"}); the runtime refuses an entry whose sources are not stored weights of the
right type and shape (`check_derived`).
"""

from __future__ import annotations

from typing import Any

from v4compile.errors import ArtifactError

SEP = "#"
QUANTISED = ("fp8e4m3", "fp4x2")


def derived_name(base: str, index: int | None, dequantised: bool) -> str:
    """The graph input of `base` (expert `index` of it), as fp32 where the stored one is not."""
    name = base if index is None else f"{base}{SEP}{index}"
    return name + (f"{SEP}f32" if dequantised else "")


def logical_shape(dtype: str, shape) -> list[int]:
    """The dense shape of a stored weight (FP4 packs two values in a byte of the last axis)."""
    return [*shape[:-1], shape[-1] * 2] if dtype == "fp4x2" else list(shape)


def entry(base: str, dtype: str, shape, index: int | None, scale: str | None, block: int | None) -> dict[str, Any]:
    shape = logical_shape(dtype, shape)
    return {"of": base, "index": index, "scale": scale, "block": block if scale else None, "dtype": "fp32",
            "shape": shape[1:] if index is not None else shape}


def check_derived(name: str, d: dict[str, Any], tensors: dict[str, Any], where: str) -> None:
    """One clear error when a derived input does not follow from the stored weights it names."""
    def bad(why: str, **kw):
        raise ArtifactError(f"the cpu target's derived weight '{name[:80]}' {why}", where=where, **kw)

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(d, dict) or set(d) != {"of", "index", "scale", "block", "dtype", "shape"}:
        bad("is not an entry of {of, index, scale, block, dtype, shape}")
    if not (isinstance(d["shape"], list) and all(is_int(x) and x >= 0 for x in d["shape"])
            and (d["index"] is None or is_int(d["index"])) and (d["block"] is None or is_int(d["block"]))
            and (d["scale"] is None or isinstance(d["scale"], str)) and isinstance(d["dtype"], str)):
        bad("has fields of the wrong types", expected="shape [int], index / block int or null, scale str or null")
    base = tensors.get(d["of"]) if isinstance(d["of"], str) else None
    if base is None:
        bad("names no stored weight", found=str(d["of"])[:80])
    if base["dtype"] not in ("fp32", "bf16", *QUANTISED) or len(base["shape"]) < 2:
        bad("names a stored tensor that is not a weight matrix (or a stack of them)", found=base["dtype"])
    shape = logical_shape(base["dtype"], base["shape"])
    idx = d["index"]
    if idx is not None and not (len(shape) == 3 and 0 <= idx < shape[0]):
        bad("indexes outside its stacked weight", expected=f"0 <= index < {shape[0] if len(shape) == 3 else '-'}",
            found=idx)
    if d["scale"] is None:
        if base["dtype"] in QUANTISED or d["block"] is not None:
            bad("needs a scale (its weight is quantised)" if base["dtype"] in QUANTISED else "has a block but no scale")
    else:
        sc = tensors.get(d["scale"]) if isinstance(d["scale"], str) else None
        blk = d["block"]
        if base["dtype"] not in QUANTISED or sc is None or sc["dtype"] not in ("e8m0", "fp32"):
            bad("names a scale that is not the E8M0 grid of a quantised weight", found=str(d["scale"])[:80])
        if blk is None or blk <= 0:
            bad("has no positive block", found=blk)
        *lead, o, k = shape
        grid = [*lead, -(-o // blk), -(-k // blk)] if base["dtype"] == "fp8e4m3" else [*lead, o, k // blk]
        if list(sc["shape"]) != grid:
            bad("has a scale grid that does not match its weight", expected=grid, found=list(sc["shape"]))
    want = shape[1:] if idx is not None else shape
    if d["dtype"] != "fp32" or list(d["shape"]) != want:
        bad("does not have its source's shape in fp32", expected=f"fp32 {want}", found=f"{d['dtype']} {d['shape']}")


def materialise(d: dict[str, Any], stored) -> Any:
    """The derived tensor as a numpy array: a view of the mapped weight where no conversion is needed.
    `stored(name)` gives a stored tensor (torch, as mapped)."""
    import torch

    from v4compile.ops.basic import dequant_weight

    w = stored(d["of"])
    sc = stored(d["scale"]) if d["scale"] is not None else None
    if d["index"] is not None:
        w = w[d["index"]]
        sc = sc[d["index"]] if sc is not None else None
    if sc is not None:
        if w.dim() == 3:  # a whole stack: one expert at a time (dequant_weight takes 2-D weights)
            return torch.stack([dequant_weight(w[e], sc[e], d["block"], torch.float32) for e in range(w.shape[0])]).numpy()
        return dequant_weight(w, sc, d["block"], torch.float32).numpy()
    if w.dtype != torch.float32:
        return w.float().numpy()
    return w.numpy()
