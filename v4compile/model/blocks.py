"""The DeepSeek-V4 forward step, written in registry ops (`v4-reference.md` sections 2-11).

`model_step` processes one static chunk of T lanes for B sequences: token ids `[B, T]`, absolute
positions `[B, T]` (-1 marks a padding lane) and the per-layer cache dicts, which it replaces with
their updated versions. Called with tensors it computes; called with IR values (by the tracer) it
records the static graph. There is no other copy of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..ops import op
from ..config import CSA, HCA, V4Config
from ..ir.core import Value
from ..ir.registry import scope
from ..ops.collective import owner_table
from .params import Params, experts_name


@dataclass(frozen=True)
class StepOptions:
    numerics: str = "hf"  # "hf": match transformers; "official": + FP8 KV / FP4 indexer rounding, FP8 activations
    #                       into FP8 / FP4 GEMMs, fp32 logits, fp32 compressor state (spec 12, 13)
    last_only: bool = False  # logits of each sequence's last valid lane only ([B, V] instead of [B, T, V])
    # The sums a partitioned module splits, split the same way (eager only: the reference of a layout,
    # `ReferenceModel.partitioned`): wo_b as `tp` partial GEMMs over its input's rank slices, the routed
    # experts as `ep` sums over each rank's experts, each added in rank order as `all_reduce` adds them.
    tp: int = 1
    ep: int = 1
    # the MTP block's Sinkhorn iterations (0: the config's `hc_sinkhorn_iters`): `TraceOptions.draft_sinkhorn_iters`
    mtp_sinkhorn_iters: int = 0
    # eager only: called with (layer, streams) after the embedding (layer -1) and after each decoder layer,
    # for the golden's per-layer fingerprint (`v4compile/golden.py`); the tracer never sets it
    on_layer: Any = field(default=None, compare=False)
    # eager only: called with (kind, layer, scores, k, pos) at each discrete top-k choice that rounding may flip
    # (the learned router's `scores + bias`, "router"; the CSA indexer's scores, "indexer"), for the golden's
    # choice margins (`v4compile/golden.py`); the tracer never sets it
    on_choice: Any = field(default=None, compare=False)


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.type.shape) if isinstance(x, Value) else tuple(x.shape)


def kv_round_block(cfg: V4Config) -> int:
    """FP8 KV simulation block: 64 values (448 = 7 x 64 for V4); smaller configs use a divisor."""
    return math.gcd(64, cfg.nope_dim)


def rope_attrs(cfg: V4Config, layer: int) -> dict[str, Any]:
    """Sliding-only layers (and MTP): plain theta; compressed layers: YaRN on `compress_rope_theta`."""
    if cfg.kind(layer) in (CSA, HCA):
        yarn = (float(cfg.yarn_factor), int(cfg.yarn_original_max_pos), float(cfg.yarn_beta_fast),
                float(cfg.yarn_beta_slow))
        return {"dim": cfg.rope_dim, "theta": float(cfg.compress_rope_theta), "yarn": yarn}
    return {"dim": cfg.rope_dim, "theta": float(cfg.rope_theta), "yarn": ()}


def compress_rope_attrs(cfg: V4Config) -> dict[str, Any]:
    a = rope_attrs(cfg, next(i for i, k in enumerate(cfg.layer_kinds) if k in (CSA, HCA)))
    return {"rope_dim": a["dim"], "theta": a["theta"], "yarn": a["yarn"]}


def attention_block(P: Params, cfg: V4Config, layer: int, pre: str, x: Any, pos: Any, cache: dict[str, Any],
                    opts: StepOptions) -> Any:
    B, T, _ = shape_of(x)
    eps = cfg.rms_eps
    rope = rope_attrs(cfg, layer)
    kind = cfg.kind(layer)
    official = opts.numerics == "official"
    a = pre + "attn."
    qr = op.rms_norm(op.linear(x, **gemm(P, opts, a + "wq_a.weight", "attn.wq_a")), P.t(a + "q_norm.weight"), eps=eps)
    q = op.reshape(op.linear(qr, **gemm(P, opts, a + "wq_b.weight", "attn.wq_b")),
                    shape=(B, T, cfg.n_heads, cfg.head_dim))
    # official: the per-head q norm's statistic in the activation dtype (spec 15 item 10)
    q = op.rope(op.rms_norm(q, None, eps=eps, mean="dtype" if official else "fp32"), pos, **rope)
    kv = op.rms_norm(op.linear(x, **gemm(P, opts, a + "wkv.weight", "attn.wkv")), P.t(a + "kv_norm.weight"),
                      eps=eps)
    kv = op.rope(kv, pos, **rope)
    if official:
        kv = op.fp8_round(kv, dims=cfg.nope_dim, block=kv_round_block(cfg))

    rows = selected = None
    ratio = cfg.ratio(layer) or 1
    if kind in (CSA, HCA):
        crope = {"rope_dim": rope["dim"], "theta": rope["theta"], "yarn": rope["yarn"]}
        with scope("compressor", role="attn.compressor"):
            c = a + "compressor."
            rows, cache["state_kv"], cache["state_gate"] = op.compress(
                op.linear(x, **gemm(P, opts, c + "wkv.weight", "attn.compressor.wkv")),
                op.linear(x, **gemm(P, opts, c + "wgate.weight", "attn.compressor.wgate")),
                P.t(c + "ape"), P.t(c + "norm.weight"), cache["state_kv"], cache["state_gate"], cache["rows"], pos,
                ratio=ratio, overlap=kind == CSA, eps=eps, round="fp8" if official else "none", **crope)
            cache["rows"] = rows
        if kind == CSA:
            with scope("indexer", role="attn.indexer"):
                i = a + "indexer."
                ic = i + "compressor."
                keys, cache["index_state_kv"], cache["index_state_gate"] = op.compress(
                    op.linear(x, **gemm(P, opts, ic + "wkv.weight", "attn.indexer.compressor.wkv")),
                    op.linear(x, **gemm(P, opts, ic + "wgate.weight", "attn.indexer.compressor.wgate")),
                    P.t(ic + "ape"), P.t(ic + "norm.weight"), cache["index_state_kv"], cache["index_state_gate"],
                    cache["index_rows"], pos, ratio=ratio, overlap=True, eps=eps,
                    round="fp4" if official else "none", role="attn.indexer.compressor", **crope)
                cache["index_rows"] = keys
                qi = op.linear(qr, **gemm(P, opts, i + "wq_b.weight", "attn.indexer.wq_b"))
                qi = op.rope(op.reshape(qi, shape=(B, T, cfg.index_n_heads, cfg.index_head_dim)), pos, **rope)
                if official:
                    qi = op.hadamard_fp4_round(qi)
                wts = op.linear(x, **gemm(P, opts, i + "weights_proj.weight", "attn.indexer.weights_proj"))
                scores = op.indexer_scores(qi, wts, keys, pos, ratio=ratio, q_scale=cfg.index_head_dim ** -0.5,
                                            w_scale=cfg.index_n_heads ** -0.5)
                selected = op.topk(scores, k=min(cfg.index_topk, shape_of(keys)[1]))
                if opts.on_choice is not None:
                    opts.on_choice("indexer", layer, scores, min(cfg.index_topk, shape_of(keys)[1]), pos)

    o = op.attention(q, kv, cache["win"], pos, P.t(a + "attn_sink"), rows, selected, window=cfg.window,
                      ratio=ratio, scale=cfg.head_dim ** -0.5)
    cache["win"] = op.window_write(cache["win"], kv, pos)
    o = op.rope(o, pos, inverse=True, **rope)
    z = op.grouped_out_proj(o, **gemm(P, opts, a + "wo_a.weight", "attn.wo_a"), groups=cfg.o_groups)
    wo_b = gemm(P, opts, a + "wo_b.weight", "attn.wo_b")
    if opts.tp == 1:
        return op.linear(z, **wo_b)
    n = _eager_dense(z, wo_b["scale"], "wo_b").shape[-1] // opts.tp  # rank r holds wo_b's input columns r * n ...
    return rank_sum([op.linear(z[..., r * n:(r + 1) * n], **{**wo_b, "w": wo_b["w"][:, r * n:(r + 1) * n]})
                     for r in range(opts.tp)])


def _eager_dense(x: Any, scale: Any, what: str) -> Any:
    if isinstance(x, Value) or scale is not None:
        raise NotImplementedError(f"a layout's split {what} is a reference of tensors and dense weights only "
                                  "(the traced module is split by the partition pass)")
    return x


def rank_sum(parts: list) -> Any:
    """The ranks' partial values added in rank order in their dtype (`all_reduce`'s reference)."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


def gemm(P: Params, opts: StepOptions, name: str, role: str, out_dtype: str = "") -> dict[str, Any]:
    """Keyword arguments of the GEMM reading weight `name`: the weight (+ scale, block), its role and its
    numerics (`ops/basic.py` GEMM_ATTRS). `hf`: every GEMM native (activation x weight dequantised to the
    activation dtype, as transformers runs it). `official` (`v4-reference.md` 12, 13.1): FP8 activations
    on every GEMM whose weight the checkpoint stores in FP8 / FP4, except `wo_a`, which DeepSeek's
    conversion dequantises to bf16 and runs as a bf16 einsum."""
    fp8 = opts.numerics == "official" and P.quantized(name) and role != "attn.wo_a"
    return {**P.lin(name), "act": "fp8" if fp8 else "native", "out_dtype": out_dtype, "role": role}


def moe_block(P: Params, cfg: V4Config, layer: int, pre: str, x: Any, ids: Any, opts: StepOptions,
              pos: Any = None) -> Any:
    f = pre + "ffn."
    hashed = cfg.is_hash(layer)
    official = opts.numerics == "official"  # router in fp32 without HF's 1e-20 (spec 10; 15 items 7, 14)
    wts, idx = op.router(x, P.t(f + "gate.weight"), None if hashed else P.t(f + "gate.bias"),
                          P.t(f + "gate.tid2eid") if hashed else None, ids if hashed else None,
                          k=cfg.n_active_experts, route_scale=float(cfg.route_scale),
                          denom_eps=0.0 if official else 1e-20, fp32=official, role="ffn.gate")
    if opts.on_choice is not None and not hashed:
        from ..ops.moe import selection_scores

        opts.on_choice("router", layer, selection_scores(x, P.t(f + "gate.weight"), P.t(f + "gate.bias"), official),
                       cfg.n_active_experts, pos)
    fp8 = official and P.quantized(experts_name(pre, "w1"))
    # official: the routing weight scales w2's input, inside its activation quantisation (spec 10)
    moe = {"limit": float(cfg.swiglu_limit), "act": "fp8" if fp8 else "native",
           "route_weight": "before_w2" if official else "after_w2", "role": "ffn.experts"}
    stacks = P.experts(pre)
    if opts.ep == 1:
        y = op.moe_experts(x, wts, idx, **stacks, **moe)
    else:  # each rank's experts (a slice of the stacks) on its own slots, the ranks' sums added in rank order
        E = _eager_dense(stacks["w1"], stacks["w1_scale"], "routed experts").shape[0]
        n = E // opts.ep
        y = rank_sum([op.moe_experts(x, *op.local_experts(wts, idx, owner_table(E, opts.ep, r)),
                                     **{k: v[r * n:(r + 1) * n] if k in ("w1", "w2", "w3") else v
                                        for k, v in stacks.items()}, **moe) for r in range(opts.ep)])
    with scope("shared", role="ffn.shared"):
        s = f + "shared_experts."
        h = op.swiglu(op.linear(x, **gemm(P, opts, s + "w1.weight", "ffn.shared.w1")),
                       op.linear(x, **gemm(P, opts, s + "w3.weight", "ffn.shared.w3")),
                       limit=float(cfg.swiglu_limit))
        y = op.add(y, op.linear(h, **gemm(P, opts, s + "w2.weight", "ffn.shared.w2")))
    return y


def decoder_layer(P: Params, cfg: V4Config, layer: int, pre: str, streams: Any, ids: Any, pos: Any,
                  cache: dict[str, Any], opts: StepOptions, sinkhorn_iters: int = 0) -> Any:
    hc = {"eps": cfg.rms_eps, "hc_eps": cfg.hc_eps, "iters": sinkhorn_iters or cfg.hc_sinkhorn_iters}
    with scope("attn_hc", role="attn_hc"):
        y, post, comb = op.hc_pre(streams, P.t(pre + "hc_attn_fn"), P.t(pre + "hc_attn_base"),
                                   P.t(pre + "hc_attn_scale"), **hc)
    with scope("attn", role="attn"):
        y = attention_block(P, cfg, layer, pre, op.rms_norm(y, P.t(pre + "attn_norm.weight"), eps=cfg.rms_eps),
                            pos, cache, opts)
    with scope("attn_hc", role="attn_hc"):
        streams = op.hc_post(y, streams, post, comb)
    with scope("ffn_hc", role="ffn_hc"):
        y, post, comb = op.hc_pre(streams, P.t(pre + "hc_ffn_fn"), P.t(pre + "hc_ffn_base"),
                                   P.t(pre + "hc_ffn_scale"), **hc)
    with scope("ffn", role="ffn"):
        y = moe_block(P, cfg, layer, pre, op.rms_norm(y, P.t(pre + "ffn_norm.weight"), eps=cfg.rms_eps), ids,
                      opts, pos)
    with scope("ffn_hc", role="ffn_hc"):
        streams = op.hc_post(y, streams, post, comb)
    return streams


def head(P: Params, cfg: V4Config, pre: str, streams: Any, pos: Any, opts: StepOptions) -> Any:
    h = op.hc_head(streams, P.t(pre + "hc_head_fn"), P.t(pre + "hc_head_base"), P.t(pre + "hc_head_scale"),
                    eps=cfg.rms_eps, hc_eps=cfg.hc_eps)
    if opts.last_only:
        h = op.last_token(h, pos)
    h = op.rms_norm(h, P.t(pre + "norm.weight"), eps=cfg.rms_eps)
    # Official logits are fp32 (spec 11, 12: the head weight upcast, an fp32 GEMM).
    return op.linear(h, **gemm(P, opts, "head.weight", "head", "fp32" if opts.numerics == "official" else ""))


def model_step(P: Params, cfg: V4Config, ids: Any, pos: Any, caches: list[dict[str, Any]],
               opts: StepOptions) -> tuple[Any, Any]:
    """Logits (`[B, T, V]`, or `[B, V]` with `last_only`) and the final hidden streams `[B, T, n, D]`
    (before `hc_head`; the MTP block's input). Updates `caches` in place (new tensors / values)."""
    with scope("embed", role="embed"):
        streams = op.hc_expand(op.embed(ids, P.t("embed.weight")), n=cfg.hc_mult)
    if opts.on_layer is not None:
        opts.on_layer(-1, streams)
    for layer in range(cfg.n_layers):
        with scope(f"layers.{layer}", layer=layer):
            streams = decoder_layer(P, cfg, layer, f"layers.{layer}.", streams, ids, pos, caches[layer], opts)
        if opts.on_layer is not None:
            opts.on_layer(layer, streams)
    with scope("head", role="head"):
        logits = head(P, cfg, "", streams, pos, opts)
    return logits, streams


def mtp_step(P: Params, cfg: V4Config, j: int, streams: Any, next_ids: Any, pos: Any, cache: dict[str, Any],
             opts: StepOptions) -> tuple[Any, Any]:
    """MTP block j (spec section 11): from the backbone's last hidden streams at position t and the
    embedding of token t+1, logits for token t+2. Returns (logits, the block's output streams)."""
    pre = f"mtp.{j}."
    B, T, n, D = shape_of(streams)
    with scope(f"mtp.{j}", layer=cfg.n_layers + j, role="mtp"):
        e = op.rms_norm(op.embed(next_ids, P.t("embed.weight")), P.t(pre + "enorm.weight"), eps=cfg.rms_eps)
        h = op.rms_norm(streams, P.t(pre + "hnorm.weight"), eps=cfg.rms_eps)
        e = op.reshape(op.linear(e, **gemm(P, opts, pre + "e_proj.weight", "mtp.e_proj")), shape=(B, T, 1, D))
        x0 = op.add(e, op.linear(h, **gemm(P, opts, pre + "h_proj.weight", "mtp.h_proj")))
        out = decoder_layer(P, cfg, cfg.n_layers + j, pre, x0, next_ids, pos, cache, opts, opts.mtp_sinkhorn_iters)
        with scope(role="head"):
            logits = head(P, cfg, pre, out, pos, opts)
    return logits, out
