"""sample family: next-token choice from fp32 logits [B, V] — greedy or seeded temperature / top-p.

Not an op of the registry yet; the proposed op is `sample(logits, seed) -> tokens` with attributes
`temperature: float` (0 = greedy) and `top_p: float` (1 = off), and `seed` an i64[2] buffer
(seed, step) read at run time (so one captured graph serves every step). Algorithm, exactly:

* greedy: the arg-max, ties to the lowest token id.
* sampling: z_i = (l_i - max l) / T, e_i = exp(z_i), Z = sum e_i. Top-p keeps e_i >= tau where tau is the
  largest fp32 value with sum_{e_j >= tau} e_j >= top_p * Z (found by bisection on tau's bits, so the
  kept set is the reference's sorted-cumsum nucleus with boundary ties kept). The token is the arg-max
  over kept i of z_i + g_i with Gumbel noise g_i = -log(-log(u_i)), u_i = ((h >> 8) + 0.5) / 2^24 and
  h = mix(mix(mix(mix(seed ^ 0x9E3779B9) ^ step) ^ row) ^ i), `mix` the 32-bit lowbias32 finaliser.
  Counter-based: the same (seed, step, row, i) draws the same u on any device, so CPU and GPU agree
  (up to a Gumbel tie or a mass exactly at the top-p boundary, measure zero in practice).
One program per row; the vocabulary is streamed in chunks of BV (31 bisection passes when top_p < 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, unaligned
from .pdl import pdl_enter

if TYPE_CHECKING:
    import torch


@triton.jit
def _mix(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def sample_kernel(l_ptr, seed_ptr, out_ptr, V: tl.constexpr, L_RS: tl.constexpr, GREEDY: tl.constexpr,
                  INV_T: tl.constexpr, TOP_P: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    lrow = l_ptr + row.to(tl.int64) * L_RS
    r = tl.arange(0, BV)
    best = float("-inf")
    bi = 0
    for v0 in range(0, V, BV):
        v = tl.load(lrow + v0 + r, mask=v0 + r < V, other=float("-inf"))
        cm = tl.max(v, axis=0)
        ci = tl.min(tl.where(v == cm, v0 + r, V), axis=0)
        take = cm > best
        bi = tl.where(take, ci, bi)
        best = tl.where(take, cm, best)
    if not GREEDY:
        m = best
        total = 0.0
        for v0 in range(0, V, BV):
            v = tl.load(lrow + v0 + r, mask=v0 + r < V, other=float("-inf"))
            total += tl.sum(tl.exp((v - m) * INV_T), axis=0)
        tau = 0.0
        if TOP_P < 1.0:
            lo = 0
            hi = 0x3F800001  # bits of 1.0 + 1: e_max = 1 always keeps the top token
            for _ in range(31):
                mid = (lo + hi) // 2
                t = mid.to(tl.float32, bitcast=True)
                mass = 0.0
                for v0 in range(0, V, BV):
                    v = tl.load(lrow + v0 + r, mask=v0 + r < V, other=float("-inf"))
                    e = tl.exp((v - m) * INV_T)
                    mass += tl.sum(tl.where(e >= t, e, 0.0), axis=0)
                ok = mass >= TOP_P * total
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            tau = lo.to(tl.float32, bitcast=True)
        seed = tl.load(seed_ptr).to(tl.uint32)
        step = tl.load(seed_ptr + 1).to(tl.uint32)
        key = _mix(_mix(_mix(seed ^ 0x9E3779B9) ^ step) ^ row.to(tl.uint32))
        best = float("-inf")
        bi = 0
        for v0 in range(0, V, BV):
            idx = v0 + r
            v = tl.load(lrow + idx, mask=idx < V, other=float("-inf"))
            z = (v - m) * INV_T
            h = _mix(key ^ idx.to(tl.uint32))
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            s = z - tl.log(-tl.log(u))
            s = tl.where((idx < V) & (tl.exp(z) >= tau), s, float("-inf"))
            cm = tl.max(s, axis=0)
            ci = tl.min(tl.where(s == cm, idx, V), axis=0)
            take = cm > best
            bi = tl.where(take, ci, bi)
            best = tl.where(take, cm, best)
    tl.store(out_ptr + row, bi.to(out_ptr.dtype.element_ty))


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "sample":
        raise KeyError(f"sample family has no op '{op_name}'")
    logits, seed, out = operands["logits"], operands["seed"], results["tokens"]
    if logits.type.rank != 2 or logits.dtype != "fp32" or logits.strides[1] != 1:
        raise ValueError(f"sample: logits must be fp32 [B, V] with unit column stride, got {logits.type}")
    if seed.type.shape != (2,) or seed.dtype not in ("i64", "i32"):
        raise ValueError("sample: seed must be an integer [2] buffer (seed, step)")
    B, V = logits.shape
    temp, top_p = float(attrs.get("temperature", 0.0)), float(attrs.get("top_p", 1.0))
    if temp < 0 or not 0 < top_p <= 1:
        raise ValueError(f"sample: need temperature >= 0 and 0 < top_p <= 1, got {temp}, {top_p}")
    greedy = temp == 0.0
    ce = dict(V=V, L_RS=logits.strides[0], GREEDY=greedy, INV_T=0.0 if greedy else 1.0 / temp,
              TOP_P=1.0 if greedy else top_p, BV=min(4096, triton.next_power_of_2(V)))
    pointers = [ptr("l_ptr", "operand", "logits", logits), ptr("seed_ptr", "operand", "seed", seed),
                ptr("out_ptr", "result", "tokens", out)]
    passes = 1 if greedy else (3 if top_p >= 1 else 34)
    return [KernelCall(call_name("sample", ce, f"b{B}_v{V}_{'greedy' if greedy else 'topp'}"), sample_kernel, ce,
                       pointers, (B, 1, 1), num_warps=8, unaligned=unaligned({"l_ptr": logits}),
                       bytes_moved=logits.type.nbytes * passes)]


def launch_sample(logits: torch.Tensor, seed: torch.Tensor, tokens: torch.Tensor, temperature: float,
                  top_p: float = 1.0) -> None:
    """Run the sampler on tensors (no registry op yet, so not through `kernels.launch`)."""
    from . import run_calls  # (torch: on first use, kernels/__init__.py)
    args = {"logits": logits, "seed": seed}
    calls = specialise("sample", {k: TensorArg.of(v) for k, v in args.items()}, {"tokens": TensorArg.of(tokens)},
                       {"temperature": temperature, "top_p": top_p})
    run_calls(calls, args, {"tokens": tokens})
