"""The modeled GPU cost of a speculative verify step against a decode step, and the tokens/s it buys.

    verify_models(cfg, draft_tokens=(1, 3), targets=("sm_90a",), batch=1, rates=None) -> {target: [dict per k]}

Both steps are the traced graphs (`trace_verify`: decode, and verify = the main model on 1 + k lanes + the
MTP block, applied k times), shape-only with the released FP8 / FP4 weights. Each op costs the registry's
rule (`OpDef.cost_of`: only the active experts' weights, so 1 + k lanes read more experts than one) at
the target's roofline, max(bytes / HBM, FLOPs / MMA peak); every op reads its own weights (separate
launches: the MTP head re-reads the main head's weight, each recursive draft the block's weights).
The traced graphs are unfused, so the absolute times are upper bounds; both steps are modeled the same
way, which is what the ratio needs. Expected tokens per verify step with acceptance rates a_j (draft j
accepted given drafts 1..j-1 were): 1 + sum_j prod_{i<=j} a_i; the gain is that over the cost ratio.
An artifact compiled for GPU targets with --draft-tokens also models the step from its compiled program
(`gpu_target.spec_model`: `spec_b<B>`'s and `spec_b<B>_d<k>`'s fused launches against `decode_b<B>`'s, report.json
`spec_step`); this
module stays the model `compile --report` prints, for any k and batch without compiling.
"""

from __future__ import annotations

from typing import Any

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op
from v4compile.targets import TARGETS

V3_ACCEPTANCE = 0.85  # the DeepSeek-V3 report's acceptance of the second token
REPORT_DRAFT_TOKENS = (1, 3)  # the draft counts `compile --report` models


def function_us(fn: Function, target: str) -> tuple[float, int, int]:
    """Modeled microseconds, bytes and FLOPs of one call of a traced function on `target`."""
    t = TARGETS[target]
    seconds, total_bytes, total_flops = 0.0, 0, 0
    for op in fn.ops:  # each op reads its weights (the MTP block's head and its recursive steps re-read theirs)
        c = get_op(op.name).cost_of([v.type if v is not None else None for v in op.operands],
                                    [v.type for v in op.results], op.attrs)
        b = c.bytes_read + c.bytes_written
        low = any(v is not None and v.type.dtype in ("fp8e4m3", "fp4x2") for v in op.operands)
        seconds += max(b / t.hbm_bytes_s, c.flops / (t.fp8_flops_s if low else t.bf16_flops_s))
        total_bytes += b
        total_flops += c.flops
    return seconds * 1e6, total_bytes, total_flops


def tokens_per_step(rates: list[float]) -> float:
    out, run = 1.0, 1.0
    for a in rates:
        run *= a
        out += run
    return out


def verify_models(cfg, draft_tokens: tuple[int, ...], targets: tuple[str, ...], batch: int = 1,
                  rates: dict[int, list[float]] | None = None, capacity: int = 4096) -> dict[str, list[dict[str, Any]]]:
    """Per target, per k: decode vs verify step, and the expected gain at the measured `rates[k]` (when
    given) and at the V3 report's 85 % per draft. Traced once per k (shape-only, released formats, bf16)."""
    from v4compile.trace import TraceOptions
    from v4compile.trace_verify import trace_verify

    out: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    for k in draft_tokens:
        m = trace_verify(cfg, k, TraceOptions(decode_batch=batch, capacity=min(capacity, cfg.max_position),
                                              weights="released", dtype="bf16"))
        for target in targets:
            out[target].append(step_gain(m, k, target, batch, (rates or {}).get(k)))
    return out


def step_gain(m, k: int, target: str, batch: int, rates: list[float] | None) -> dict[str, Any]:
    dec_us, dec_b, _ = function_us(m.functions["decode"], target)
    ver_us, ver_b, _ = function_us(m.functions["verify"], target)
    out = {"target": target, "batch": batch, "draft_tokens": k, "decode_us": round(dec_us, 1),
           "verify_us": round(ver_us, 1), "cost_ratio": round(ver_us / dec_us, 3), "decode_bytes": dec_b,
           "verify_bytes": ver_b}
    at = {"v3_85%": [V3_ACCEPTANCE] * k}
    if rates is not None:
        at["measured"] = list(rates)
    for name, r in at.items():
        tps = tokens_per_step(r)
        out[f"gain_{name}"] = {"acceptance": [round(a, 3) for a in r], "tokens_per_step": round(tps, 3),
                               "tokens_s_gain": round(tps * dec_us / ver_us, 3)}
    return out


def render(m: dict[str, Any]) -> str:
    s = (f"    {m['target']} batch {m['batch']} k={m['draft_tokens']}: verify {m['verify_us']:.1f} us vs decode "
         f"{m['decode_us']:.1f} us ({m['cost_ratio']:.2f}x)")
    for key in sorted(k for k in m if k.startswith("gain_")):
        g = m[key]
        s += (f"; {key[5:]} acceptance {'/'.join(f'{a:.2f}' for a in g['acceptance'])}: "
              f"{g['tokens_per_step']:.2f} tokens/step, {g['tokens_s_gain']:.2f}x tokens/s")
    return s


# AMD's ATOM serving DeepSeek-V4-Pro on 8x MI355X at 4 concurrent requests: time per output token without and
# with MTP-3 (a measurement on hardware, beside which this module's modeled gains are printed)
ATOM_MTP3 = {"source": "AMD ATOM, 8x MI355X, DeepSeek-V4-Pro, 4 concurrent requests", "batch": 4,
             "draft_tokens": 3, "plain_ms_per_token": 19.66, "mtp_ms_per_token": 7.25}
REPORT_BATCHES = (1, 4, 8, 32)  # the batches the report models the speculative gain at


def by_batch(cfg, k: int, targets: tuple[str, ...], batches: tuple[int, ...] = REPORT_BATCHES,
             rates: list[float] | None = None) -> dict[str, Any]:
    """The modeled gain of k drafts per target at each batch (`step_gain`: at `rates` when given, and at the
    V3 report's 85 %), beside ATOM's measured MTP-3 figure."""
    models: dict[str, list] = {t: [] for t in targets}
    for b in batches:
        for t, ms in verify_models(cfg, (k,), targets, batch=b, rates=None if rates is None else {k: rates}).items():
            models[t] += ms
    return {"draft_tokens": k, "models": models, "measured": ATOM_MTP3}


def render_by_batch(rep: dict[str, Any], model: str) -> list[str]:
    """Lines: the modeled gain by batch per target ("modeled"), then ATOM's figure ("measured")."""
    k = rep["draft_tokens"]
    lines = [f"    modeled {model} MTP-{k} gain by batch (traced verify vs decode step at the roofline):"]
    for t, ms in rep["models"].items():
        for key in sorted({g for m in ms for g in m if g.startswith("gain_")}):
            acc = ms[0][key]["acceptance"]
            cells = ", ".join(f"batch {m['batch']} {m[key]['tokens_s_gain']:.2f}x (verify {m['cost_ratio']:.2f}x "
                              f"decode)" for m in ms)
            lines.append(f"      {t} at {key[5:]} acceptance {'/'.join(f'{a:.2f}' for a in acc)}: {cells}")
    a = rep["measured"]
    lines.append(f"    measured ({a['source']}, MTP-{a['draft_tokens']}): {a['plain_ms_per_token']} -> "
                 f"{a['mtp_ms_per_token']} ms per output token, "
                 f"{a['plain_ms_per_token'] / a['mtp_ms_per_token']:.2f}x (batch {a['batch']})")
    return lines
