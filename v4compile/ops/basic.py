"""Elementary ops (the `core` op set): embedding, linear layers (any weight format), RMSNorm, SwiGLU,
reshape, split, add. Torch is imported inside the references, so that loading this op set to read or
verify IR does not load it."""

from __future__ import annotations

from typing import Any

from ..ir.registry import Cost, defop, require, reshape_view, split_view
from ..ir.types import TensorType


def dequant_weight(w: Any, scale: Any, block: int, dtype: Any) -> Any:
    """A 2-D weight as `dtype`: fp8 e4m3 with a block x block E8M0 grid, packed fp4 with 1 x block
    scales, or a plain float tensor (scale None)."""
    import torch

    from ..formats import fp4_dequant, fp8_block_dequant

    if scale is None:
        return w.to(dtype)
    if w.dtype == torch.float8_e4m3fn:
        return fp8_block_dequant(w, scale, block).to(dtype)
    return fp4_dequant(w, scale, block).to(dtype)


def weight_in_features(w: TensorType) -> int:
    return w.shape[-1] * 2 if w.dtype == "fp4x2" else w.shape[-1]


@defop("embed(ids, table) -> x", kernel="embed")
def embed(ids, table):
    """Row `ids[b, t]` of the embedding table."""
    return table[ids.clamp(min=0)]


@embed.cost
def _(operands, results, attrs):
    ids, table = operands
    return Cost(0, ids.nbytes + results[0].nbytes, results[0].nbytes)  # only the rows looked up


@embed.infer
def _(ids, table):
    require(ids.dtype in ("i32", "i64"), "embed ids must be integers", found=ids.dtype)
    require(table.rank == 2, "embed table must be 2-D", found=table)
    return TensorType((*ids.shape, table.shape[1]), table.dtype)


# ---- GEMM numerics ----------------------------------------------------------------------------
# Every GEMM op (`linear`, `norm_linear`, `grouped_out_proj`, `moe_experts`, `moe_experts_shared`) records
# how it computes (`v4-reference.md` 12, 13.1); the weight format is the weight operand's dtype:
#   act: "native": the activation as it is times the weight dequantised to the activation dtype (what
#        transformers does); "fp8": the activation quantised per token and 128-wide K block to e4m3 with a
#        UE8M0 scale (`formats.act_quant`), times the dequantised weight, in fp32 (what DeepSeek's
#        FP8 / FP4 GEMMs do; with fp32 accumulation the per-block `s_act * s_weight` factors give exactly
#        this product up to summation order);
#   acc: the accumulation dtype ("fp32", the only one);
#   out_dtype: "" = the activation dtype; "fp32" / "bf16": the result's dtype (official logits: "fp32",
#        with the GEMM then run in fp32).
GEMM_ATTRS = {"block": (int, 128), "act": (str, "native"), "acc": (str, "fp32"), "out_dtype": (str, "")}
ACTS = ("native", "fp8")
OUT_DTYPES = ("", "fp32", "bf16")


def torch_dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def gemm(x: Any, w: Any, scale: Any, block: int, act: str, out_dtype: str = "") -> Any:
    """`x W^T` with the numerics of the GEMM attributes (see GEMM_ATTRS)."""
    import torch
    import torch.nn.functional as F

    from ..formats import act_qdq

    out = torch_dtype(out_dtype) if out_dtype else x.dtype
    if act == "fp8":
        return F.linear(act_qdq(x), dequant_weight(w, scale, block, torch.float32)).to(out)
    if out != x.dtype:
        return F.linear(x.float(), dequant_weight(w, scale, block, torch.float32)).to(out)
    return F.linear(x, dequant_weight(w, scale, block, x.dtype))


def check_gemm_attrs(what: str, act: str, acc: str, out_dtype: str) -> None:
    require(act in ACTS, f"{what}: act must be one of {ACTS}", found=act)
    require(acc == "fp32", f"{what}: acc must be fp32", found=acc)
    require(out_dtype in OUT_DTYPES, f"{what}: out_dtype must be one of {OUT_DTYPES}", found=out_dtype)


@defop("linear(x, w, scale?) -> y", attrs=GEMM_ATTRS, kernel="gemm")
def linear(x, w, scale, *, block, act, acc, out_dtype):
    """`y = x W^T` (W plain, FP8 128x128 or FP4 1x32 when scaled) with the numerics of `act`, `acc`,
    `out_dtype` (see GEMM_ATTRS)."""
    return gemm(x, w, scale, block, act, out_dtype)


def check_weight(w: TensorType, scale: TensorType | None, block: int, what: str) -> None:
    """A 2-D weight (or a stack of them) and its scale grid: FP8 needs `[ceil(out/b), ceil(in/b)]`,
    FP4 `[out, in/b]`, plain float weights no scale."""
    if w.dtype in ("fp8e4m3", "fp4x2"):
        require(scale is not None, f"{what}: a {w.dtype} weight needs a scale operand")
        require(scale.dtype == "e8m0" or scale.dtype == "fp32", f"{what}: scale must be e8m0", found=scale.dtype)
        *lead, out_f, k = w.shape
        if w.dtype == "fp8e4m3":
            grid = (*lead, -(-out_f // block), -(-k // block))
        else:
            grid = (*lead, out_f, 2 * k // block)
        require(tuple(scale.shape) == grid, f"{what}: scale grid does not match the weight", expected=list(grid),
                found=list(scale.shape))
    else:
        require(w.dtype in ("fp32", "bf16"), f"{what}: unsupported weight dtype", found=w.dtype)
        require(scale is None, f"{what}: a {w.dtype} weight takes no scale")


@linear.infer
def _(x, w, scale, *, block, act, acc, out_dtype):
    require(w.rank == 2, "linear weight must be 2-D", found=w)
    require(x.dtype in ("fp32", "bf16"), "linear input must be fp32 or bf16", found=x.dtype)
    require(x.shape[-1] == weight_in_features(w), "linear input width does not match the weight",
            expected=weight_in_features(w), found=x.shape[-1])
    check_weight(w, scale, block, "linear")
    check_gemm_attrs("linear", act, acc, out_dtype)
    return TensorType((*x.shape[:-1], w.shape[0]), out_dtype or x.dtype)


# How the unweighted RMSNorm (the per-head q norm) forms its statistic: "fp32" squares and averages the
# fp32 values (transformers); "dtype" squares, averages, adds eps and takes the rsqrt in x's dtype, each
# step rounded to it (DeepSeek's code, `v4-reference.md` 15 item 10). Weighted norms are always "fp32".
RMS_MEANS = ("fp32", "dtype")


@defop("rms_norm(x, weight?) -> y", attrs={"eps": float, "mean": (str, "fp32")}, kernel="rms_norm",
       variants={"weighted": ("weight",), "unweighted": ()})
def rms_norm(x, weight, *, eps, mean="fp32"):
    """RMSNorm over the last axis in fp32; weighted: multiply by the (fp32) weight and cast back once;
    unweighted (the per-head q norm): rescale x by the rsqrt cast to x's dtype, as HF does, or with
    `mean` "dtype" by the rsqrt of the mean of squares formed in x's dtype (RMS_MEANS)."""
    import torch

    if weight is None:
        if mean == "dtype":  # each step's result rounded to x's dtype, each computed in fp32 (as on a GPU)
            dt = x.dtype
            ms = x.float().square().to(dt).float().mean(-1, keepdim=True).to(dt)
            return x * torch.rsqrt((ms.float() + eps).to(dt).float()).to(dt)
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


@rms_norm.infer
def _(x, weight, *, eps, mean="fp32"):
    require(weight is None or weight.shape == (x.shape[-1],), "rms_norm weight must match the last dim",
            expected=[x.shape[-1]], found=None if weight is None else list(weight.shape))
    require(mean in RMS_MEANS and (mean == "fp32" or weight is None),
            f"rms_norm: mean must be one of {RMS_MEANS} (\"dtype\" unweighted only)", found=mean)
    return x


@defop("swiglu(gate, up) -> y", attrs={"limit": float}, kernel="elementwise")
def swiglu(gate, up, *, limit):
    """`silu(min(gate, L)) * clamp(up, -L, L)`: the clamped SwiGLU of every V4 expert."""
    import torch.nn.functional as F

    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@swiglu.infer
def _(gate, up, *, limit):
    require(gate == up, "swiglu operands must have the same type", expected=gate, found=up)
    return gate


@defop("reshape(x) -> y", attrs={"shape": tuple}, view=reshape_view)
def reshape(x, *, shape):
    return x.reshape(shape)


@reshape.infer
def _(x, *, shape):
    out = TensorType(tuple(int(s) for s in shape), x.dtype)
    require(out.numel == x.numel, "reshape must keep the element count", expected=x.numel, found=out.numel)
    return out


@defop("add(a, b) -> y", kernel="elementwise")
def add(a, b):
    """Elementwise sum with broadcasting."""
    return a + b


@add.infer
def _(a, b):
    require(a.dtype == b.dtype, "add operands must have the same dtype", expected=a.dtype, found=b.dtype)
    n = max(a.rank, b.rank)
    sa, sb = (1,) * (n - a.rank) + a.shape, (1,) * (n - b.rank) + b.shape
    require(all(x == y or 1 in (x, y) for x, y in zip(sa, sb)), "add operands do not broadcast",
            found=(list(a.shape), list(b.shape)))
    return TensorType(tuple(max(x, y) if 1 in (x, y) else x for x, y in zip(sa, sb)), a.dtype)


@defop("last_token(x, pos) -> y", kernel="last_token")
def last_token(x, pos):
    """`x[b, n_b - 1]`: the last valid lane of each sequence in a padded chunk (lane 0 if none)."""
    import torch

    n = (pos >= 0).sum(1)
    idx = (n - 1).clamp(min=0)
    return x[torch.arange(x.shape[0]), idx]


@last_token.infer
def _(x, pos):
    require(tuple(pos.shape) == tuple(x.shape[:2]), "last_token positions must be [B, T]", expected=list(x.shape[:2]),
            found=list(pos.shape))
    return TensorType((x.shape[0], *x.shape[2:]), x.dtype)


@defop("spec_accept(logits, ids, pos) -> next_ids, kept_pos", kernel="spec_accept")
def spec_accept(logits, ids, pos):
    """Greedy speculative acceptance between a verify and the MTP block (`speculation.accept` at temperature
    0, lane by lane): `next_ids` = the argmax of every lane's logits (ties to the lowest id); draft j (lane j's
    id, j >= 1, pos >= 0) survives while every draft before it did and it equals lane j - 1's argmax;
    `kept_pos` = pos on lane 0 and the surviving drafts' lanes, -1 elsewhere."""
    import torch

    best = torch.argmax(logits, dim=-1)
    match = (best[:, :-1] == ids[:, 1:]) & (pos[:, 1:] >= 0)
    keep = torch.cat([torch.ones_like(match[:, :1]), torch.cumprod(match.long(), dim=1).bool()], dim=1)
    return best.to(ids.dtype), torch.where(keep, pos, torch.full_like(pos, -1))


@spec_accept.infer
def _(logits, ids, pos):
    require(logits.rank == 3 and tuple(ids.shape) == tuple(logits.shape[:2]) == tuple(pos.shape),
            "spec_accept takes logits [B, T, V] and ids, pos [B, T]", expected=list(logits.shape[:2]),
            found=[list(ids.shape), list(pos.shape)])
    require(ids.dtype == pos.dtype == "i64", "spec_accept ids and positions must be i64",
            found=[ids.dtype, pos.dtype])
    return TensorType(tuple(ids.shape), "i64"), TensorType(tuple(pos.shape), "i64")


@defop("spec_sample(logits, ids, pos, draft_probs, uniforms, temperature) -> next_ids, kept_pos", kernel="spec_accept")
def spec_sample(logits, ids, pos, draft_probs, uniforms, temperature):
    """Speculative acceptance between a verify and the MTP block, sampled or greedy per sequence: exactly
    `speculation.sample_accept` (float32, sums left to right; the host's two-call path runs the same function):
    `draft_probs [B, T, V]` each draft's q, `uniforms [B, T]` drawn before the step, `temperature [B]` (0: the
    greedy rule, `spec_accept`'s; bf16 logits widened first, as the host reads them). `next_ids`: the surviving
    drafts then the token after them (greedy: every lane's argmax); `kept_pos`: pos on lane 0 and the surviving
    drafts' lanes, -1 elsewhere."""
    import torch

    from ..speculation import sample_accept

    nxt, kept = sample_accept(*(x.detach().cpu().numpy() for x in (logits.float(), ids, pos, draft_probs, uniforms,
                                                                    temperature)))
    return torch.from_numpy(nxt).to(ids.device), torch.from_numpy(kept).to(ids.device)


@spec_sample.infer
def _(logits, ids, pos, draft_probs, uniforms, temperature):
    B, T = tuple(ids.shape)
    require(logits.rank == 3 and tuple(logits.shape[:2]) == (B, T) == tuple(pos.shape) == tuple(uniforms.shape)
            and tuple(draft_probs.shape) == tuple(logits.shape) and tuple(temperature.shape) == (B,),
            "spec_sample takes logits, draft_probs [B, T, V], ids, pos, uniforms [B, T] and temperature [B]",
            expected=list(logits.shape), found=[list(x.shape) for x in (ids, pos, draft_probs, uniforms, temperature)])
    require(ids.dtype == pos.dtype == "i64", "spec_sample ids and positions must be i64", found=[ids.dtype, pos.dtype])
    require(draft_probs.dtype == uniforms.dtype == temperature.dtype == "fp32" and logits.dtype in ("fp32", "bf16"),
            "spec_sample computes in float32: its q, uniforms and temperatures must be fp32 (logits fp32 or bf16)",
            found=[x.dtype for x in (logits, draft_probs, uniforms, temperature)])
    return TensorType((B, T), "i64"), TensorType((B, T), "i64")


@defop("draft_next(logits, streams, pos) -> ids, pos_next, hidden", kernel="spec_accept")
def draft_next(logits, streams, pos):
    """A recursive MTP draft's step inputs from the draft before it (what the host's `draft_b<B>` calls feed it):
    per sequence b with n_b valid lanes (pos >= 0), lane 0 gets `ids` = the argmax of `logits [B, V]` (ties to
    the lowest id: the next draft), `pos_next` = its largest position + 1 and `hidden` = `streams [B, T, n, D]`
    at its last valid lane (n_b - 1, `last_token`'s lane); every other lane, and every lane of a sequence without
    a valid one, is padding: id 0, position -1, zero streams."""
    import torch

    B, T = pos.shape
    live = (pos >= 0).any(1)
    lane = ((pos >= 0).sum(1) - 1).clamp(min=0)
    ids = torch.zeros_like(pos)
    nxt = torch.full_like(pos, -1)
    hidden = torch.zeros_like(streams)
    ids[:, 0] = torch.where(live, torch.argmax(logits, dim=-1).to(pos.dtype), 0)
    nxt[:, 0] = torch.where(live, pos.max(1).values + 1, -1)
    hidden[:, 0] = torch.where(live.view(B, *([1] * (streams.dim() - 2))), streams[torch.arange(B), lane], 0)
    return ids, nxt, hidden


@draft_next.infer
def _(logits, streams, pos):
    B, T = tuple(pos.shape)
    require(logits.rank == 2 and logits.shape[0] == B and streams.rank == 4 and tuple(streams.shape[:2]) == (B, T),
            "draft_next takes logits [B, V], streams [B, T, n, D] and pos [B, T]", expected=[B, T],
            found=[list(logits.shape), list(streams.shape)])
    require(pos.dtype == "i64", "draft_next positions must be i64", found=pos.dtype)
    return TensorType((B, T), "i64"), TensorType((B, T), "i64"), streams


@defop("split(x) -> a, b", attrs={"at": int}, view=split_view)
def split(x, *, at):
    """A view: the last axis cut at `at` (the two outputs of a merged GEMM)."""
    return x[..., :at], x[..., at:]


@split.infer
def _(x, *, at):
    require(0 < at < x.shape[-1], "split point must be inside the last axis", expected=f"0 < at < {x.shape[-1]}",
            found=at)
    return x.with_shape(*x.shape[:-1], at), x.with_shape(*x.shape[:-1], x.shape[-1] - at)
