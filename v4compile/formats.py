"""Low-precision number formats of DeepSeek-V4 checkpoints and numerics (`v4-reference.md` 13, 14.2-14.3).

* E8M0 scale bytes: `e` means 2^(e-127); 255 is NaN; no sign, no zero.
* FP8 e4m3 weights with a 128x128 scale grid `[ceil(out/128), ceil(in/128)]` (edge blocks partial).
* FP4 e2m1 weights packed two per byte along the input dim (element 2k in the low nibble) with a
  1x32 scale grid `[out, in/32]`.
* Quantise-dequantise simulations used by `numerics="official"` (FP8 KV rows, FP4 indexer keys) and the
  Walsh-Hadamard rotation of the indexer.
* FP8 activations of the FP8 / FP4 GEMMs (spec 13.1): per token and `ACT_BLOCK`-wide block of the
  reduction axis, e4m3 with a UE8M0 scale.
"""

from __future__ import annotations

import math

import torch

from .errors import CheckpointError

FP8_MAX = 448.0
FP4_MAX = 6.0
ACT_BLOCK = 128  # FP8 activation quantisation: values per scale along K (spec 13.1)
ACT_FLOOR = 1e-4  # amax floor of an activation block (spec 13.1)
# e2m1 magnitudes by 3-bit code (bit 2..1 exponent, bit 0 mantissa); bit 3 of a nibble is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---- E8M0 --------------------------------------------------------------------------------------

def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale bytes (uint8 or float8_e8m0fnu) to float32 powers of two; byte 255 becomes NaN."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        return scale.float()  # V3-style fp32 `weight_scale_inv`: already a multiplier
    e = scale.to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Positive powers of two to E8M0 bytes (uint8)."""
    e = torch.log2(s.float()).round().to(torch.int32) + 127
    return e.clamp(0, 254).to(torch.uint8)


def pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """The UE8M0 block scale `2^ceil(log2(max(amax, floor) / qmax))` (spec 13.1 - 13.3)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp(min=floor) / qmax)))


def nonfinite_error(t: torch.Tensor, where: str, scale: bool = False) -> CheckpointError | None:
    """The error for a tensor holding NaN / Inf (an E8M0 scale: the NaN byte 0xFF), or None if all finite.
    `scale`: a uint8 tensor holds E8M0 scale bytes."""
    if t.dtype == torch.float8_e8m0fnu or (scale and t.dtype == torch.uint8):
        bad = t.view(torch.uint8) == 255
        what = "E8M0 scale byte 0xFF (NaN)"
    elif t.is_floating_point():
        bad = ~torch.isfinite(t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t)
        what = "NaN or Inf"
    else:
        return None
    n = int(bad.sum())
    if n == 0:
        return None
    first = [int(i) for i in bad.nonzero()[0]] if bad.dim() else []
    return CheckpointError("tensor holds non-finite values", where=where,
                           expected="finite values (--allow-nonfinite to load them anyway)",
                           found=f"{n} x {what}, first at index {first}")


# ---- FP8 e4m3, 128x128 blocks ------------------------------------------------------------------

def _expand_grid(scale: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    rows = scale.repeat_interleave(block, 0)[: shape[0]]
    return rows.repeat_interleave(block, 1)[:, : shape[1]]


def fp8_block_dequant(weight: torch.Tensor, scale: torch.Tensor, block: int = 128,
                      where: str = "fp8 weight") -> torch.Tensor:
    """`W[i, j] = float(weight[i, j]) * scale[i // block, j // block]` as float32."""
    out_f, in_f = weight.shape
    grid = (math.ceil(out_f / block), math.ceil(in_f / block))
    if tuple(scale.shape) != grid:
        raise CheckpointError("scale grid does not match its weight", where=where, expected=list(grid),
                              found=list(scale.shape))
    w = weight.view(torch.float8_e4m3fn).float() if weight.dtype != torch.float8_e4m3fn else weight.float()
    return w * _expand_grid(e8m0_to_float(scale), (out_f, in_f), block)


def fp8_block_quant(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Round a 2-D float tensor to e4m3 with one E8M0 scale per `block x block` tile."""
    out_f, in_f = w.shape
    gr, gc = math.ceil(out_f / block), math.ceil(in_f / block)
    padded = torch.zeros(gr * block, gc * block, dtype=torch.float32)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.view(gr, block, gc, block).abs().amax(dim=(1, 3))
    s = pow2_scale(tiles, FP8_MAX, 1e-4)
    q = (w.float() / _expand_grid(s, (out_f, in_f), block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(s)


# ---- FP4 e2m1, 1x32 blocks, packed -------------------------------------------------------------

def _fp4_table(device=None) -> torch.Tensor:
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 `[..., n/2]` to 4-bit codes `[..., n]` (int64); element 2k is the low nibble."""
    b = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([b & 0x0F, (b >> 4) & 0x0F], dim=-1).flatten(-2)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[..., n]` to int8 `[..., n/2]` (low nibble first)."""
    c = codes.to(torch.int64)
    b = (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)
    return b.to(torch.uint8).view(torch.int8)


def fp4_dequant(packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                where: str = "fp4 weight") -> torch.Tensor:
    """`W[i, j] = value(nibble(i, j)) * scale[i, j // block]` as float32; packed is `[out, in/2]`."""
    out_f, half = packed.shape
    in_f = half * 2
    if tuple(scale.shape) != (out_f, in_f // block):
        raise CheckpointError("scale grid does not match its weight", where=where,
                              expected=[out_f, in_f // block], found=list(scale.shape))
    vals = _fp4_table(packed.device)[fp4_unpack(packed)]
    return vals * e8m0_to_float(scale).repeat_interleave(block, dim=1)


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    """Codes of the nearest e2m1 value of each element (|x| <= 6 assumed), ties to the even code."""
    m = x.float().abs()
    # Midpoints between neighbouring magnitudes (exact dyadic numbers): the number of them below |x| is
    # the nearest code; on a midpoint, round half to even (mantissa bit 0 clear).
    mids = torch.tensor([(a + b) / 2 for a, b in zip(FP4_VALUES, FP4_VALUES[1:])] + [math.inf], device=x.device)
    code = torch.bucketize(m, mids[:-1])
    code += ((m == mids[code]) & (code % 2 == 1)).to(code.dtype)
    sign = (x < 0) & (code != 0)
    return code + 8 * sign.to(torch.int64)


def fp4_quant(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `[out, in]` to packed e2m1 with one E8M0 scale per 1 x `block` group."""
    out_f, in_f = w.shape
    g = w.float().view(out_f, in_f // block, block)
    s = pow2_scale(g.abs().amax(dim=-1), FP4_MAX, FP4_MAX * 2.0 ** -126)
    codes = fp4_round((g / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).view(out_f, in_f)
    return fp4_pack(codes), float_to_e8m0(s)


# ---- quantise-dequantise simulations (numerics="official") -------------------------------------

def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """Spec 13.2: per `block` values along the last dim, round through e4m3 with a UE8M0 scale."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    s = pow2_scale(g.abs().amax(dim=-1, keepdim=True), FP8_MAX, 1e-4)
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return q.reshape(shape).to(x.dtype)


def act_quant(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec 13.1, the activation side of an FP8 / FP4 GEMM: along the last (reduction) axis, per
    `block` values, `s = 2^ceil(log2(max(amax, 1e-4) / 448))`, `q = e4m3(clamp(x / s, -448, 448))`.
    Returns q (e4m3, x's shape) and s (fp32 `[..., ceil(K / block)]`); a partial last block has its own
    scale (the padding is zeros, which do not change an amax)."""
    K = x.shape[-1]
    nb = -(-K // block)
    g = torch.nn.functional.pad(x.float(), (0, nb * block - K)).reshape(*x.shape[:-1], nb, block)
    s = pow2_scale(g.abs().amax(dim=-1, keepdim=True), FP8_MAX, ACT_FLOOR)
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*x.shape[:-1], nb * block)[..., :K], s.squeeze(-1)


def act_dequant(q: torch.Tensor, s: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """The fp32 values `q * s` of `act_quant`'s output (exact: an e4m3 value times a power of two)."""
    K = q.shape[-1]
    return (q.float() * s.repeat_interleave(block, dim=-1)[..., :K])


def act_qdq(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """x as the FP8 GEMM sees it (spec 13.1), in fp32."""
    return act_dequant(*act_quant(x, block), block)


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Spec 13.3: per `block` values along the last dim, round through e2m1 with a UE8M0 scale."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    s = pow2_scale(g.abs().amax(dim=-1, keepdim=True), FP4_MAX, FP4_MAX * 2.0 ** -126)
    codes = fp4_round((g / s).clamp(-FP4_MAX, FP4_MAX))
    return (_fp4_table(x.device)[codes] * s).reshape(shape).to(x.dtype)


def hadamard(n: int, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard matrix of size n (Sylvester order), n a power of two."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)
