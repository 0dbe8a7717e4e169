"""Tracing: derive the IR from the reference model's own code.

`model_step` (the reference model) is run with IR values instead of tensors: each registry op it calls
is recorded with its result types (from the op's shape rule) and its provenance (the model's scope).
No tensor is ever computed, so the full V4-Pro graph traces shape-only in about a second.

The module's functions:

* `prefill`: a static chunk of `chunk` tokens for `batch` sequences (ids / pos `[B, T]`, pos -1 =
  padding lane); logits of each sequence's last valid lane `[B, V]`;
* `decode`: one token per sequence for `decode_batch` sequences; logits `[B, V]`;
* `verify`: speculative decoding's verify step, `chunk` tokens (the last accepted one and the drafts) for
  `decode_batch` sequences; every lane's logits `[B, T, V]`;
* `draft`: the MTP block (`mtp_step`, layer `n_layers`) on `chunk` lanes for `decode_batch` sequences: input
  `hidden` `[B, T, n, D]` (the backbone's final streams, or the block's own for a recursive draft) and
  `ids` (the token after each lane's position); the logits of each sequence's last valid lane `[B, V]` and
  the block's output streams (`streams`, `[B, T, n, D]`);

each with the per-layer caches (`cache.layers.<l>.<name>`) as explicit inputs and outputs. With `streams`,
prefill and verify also return their final hidden streams (output `streams`, every lane): the draft
function's input.

Weight types: GEMM weights the checkpoint stores in FP8 / FP4 stay quantised (plus an E8M0 scale
weight) and are dequantised inside their op; every other weight takes the model's compute dtype
(fp32-kept parameters stay fp32), as `ReferenceModel` holds them. The routed experts of a layer are
one stacked weight per projection, `layers.<l>.ffn.experts.w1` `[E, out, in]`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import V4Config
from .errors import InputError
from .ir.builder import Builder
from .ir.core import WEIGHT, Module, Value
from .ir.types import TensorType
from .model.blocks import StepOptions, model_step, mtp_step
from .model.cache import cache_input_name, layer_cache_shapes
from .model.params import Params, experts_name
from .model.reference import keeps_fp32
from .weights import TensorSpec, spec_table
from .weights_convert import expert_sources

log = logging.getLogger(__name__)

FUNCTIONS = ("prefill", "decode")


@dataclass(frozen=True)
class TraceOptions:
    """Every knob that changes the traced graph (recorded in the module attributes)."""

    batch: int = 2  # prefill batch
    chunk: int = 16  # prefill chunk (tokens per sequence per step)
    decode_batch: int = 2
    capacity: int = 256  # max tokens per sequence (sizes the caches)
    numerics: str = "hf"
    dtype: str = "fp32"  # compute dtype of activations and dense weights
    weights: str = "dense"  # "dense": every weight in the compute dtype; "released": FP8 / FP4 as released
    # The MTP block's two mHC Sinkhorns stop after this many column normalisations (0: the config's
    # `hc_sinkhorn_iters`, the block as trained). The block only drafts and the verify step is exact, so the
    # output does not depend on it; fewer iterations make a draft cheaper (tiny-doc: 242 -> 166 ONNX nodes a
    # draft at 1) at whatever acceptance the model keeps (`bench/bench_spec.py` measures it).
    draft_sinkhorn_iters: int = 0

    def attrs(self) -> dict[str, Any]:
        return {"batch": self.batch, "chunk": self.chunk, "decode_batch": self.decode_batch,
                "capacity": self.capacity, "numerics": self.numerics, "dtype": self.dtype, "weights": self.weights,
                **({"draft_sinkhorn_iters": self.draft_sinkhorn_iters} if self.draft_sinkhorn_iters else {})}

    def step(self, last_only: bool = False) -> StepOptions:
        """The model step's options for this trace."""
        return StepOptions(self.numerics, last_only=last_only, mtp_sinkhorn_iters=self.draft_sinkhorn_iters)

    def validate(self, cfg: V4Config) -> None:
        for k in ("batch", "chunk", "decode_batch", "capacity"):
            if getattr(self, k) < 1:
                raise InputError(f"`{k}` must be >= 1", found=getattr(self, k))
        if self.capacity > cfg.max_position:
            raise InputError("max context exceeds the model's maximum position", expected=f"<= {cfg.max_position}",
                             found=self.capacity)
        if self.numerics not in ("hf", "official"):
            raise InputError("unknown numerics mode", expected="hf / official", found=self.numerics)
        if self.dtype not in ("fp32", "bf16"):
            raise InputError("unknown compute dtype", expected="fp32 / bf16", found=self.dtype)
        if self.weights not in ("dense", "released"):
            raise InputError("unknown weight format mode", expected="dense / released", found=self.weights)
        n = self.draft_sinkhorn_iters
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cfg.hc_sinkhorn_iters:
            raise InputError("draft Sinkhorn iterations out of range", found=n,
                             expected=f"an integer in 1..{cfg.hc_sinkhorn_iters} (the model's), or 0 for the model's")


def _ir_dtype(spec: TensorSpec, compute: str) -> str:
    if spec.fmt == "i64":
        return "i64"
    return "fp32" if keeps_fp32(spec.name) else compute


def weight_values(cfg: V4Config, opts: TraceOptions, formats: dict[str, str] | None = None,
                  include_mtp: bool = False) -> tuple[dict[str, Value], dict[str, Value]]:
    """IR weights by name, and the scale weights by the name of the weight they scale.

    `formats` overrides each tensor's stored format (from a checkpoint's headers); otherwise `weights`
    decides: "released" keeps the spec's FP8 / FP4, "dense" dequantises everything.
    """
    specs = spec_table(cfg, include_mtp=include_mtp)
    store: dict[str, Value] = {}
    scales: dict[str, Value] = {}

    def fmt_of(s: TensorSpec) -> str:
        if formats is not None:
            return formats.get(s.name, "dense")
        return s.fmt if opts.weights == "released" else "dense"

    stacks: dict[str, TensorSpec] = {}
    for name, s in specs.items():
        if ".ffn.experts." in name:
            prefix, rest = name.split("ffn.experts.")
            stacks.setdefault(experts_name(prefix, rest.split(".")[1]), s)
            continue
        f = fmt_of(s)
        if f in ("fp8", "fp4") and s.quantizable:
            q = s.with_format(f)
            store[name] = Value(name, TensorType(q.stored_shape, "fp8e4m3" if f == "fp8" else "fp4x2"), WEIGHT, (name,))
            sshape = q.scale_shape(cfg.quant_block, cfg.expert_scale_block)
            scales[name] = Value(s.scale_key, TensorType(sshape, "e8m0"), WEIGHT, (s.scale_key,))
        else:
            store[name] = Value(name, TensorType(s.shape, _ir_dtype(s, opts.dtype)), WEIGHT, (name,))
    for sname, s in stacks.items():
        prefix = sname.split("ffn.experts.")[0]
        w = sname.rsplit(".", 1)[1]
        E = cfg.n_experts
        f = fmt_of(s)
        if f in ("fp8", "fp4"):
            q = s.with_format(f)
            store[sname] = Value(sname, TensorType((E, *q.stored_shape), "fp8e4m3" if f == "fp8" else "fp4x2"),
                                 WEIGHT, expert_sources(prefix, w, E))
            sshape = q.scale_shape(cfg.quant_block, cfg.expert_scale_block)
            scales[sname] = Value(sname + ".scale", TensorType((E, *sshape), "e8m0"), WEIGHT,
                                  expert_sources(prefix, w, E, "scale"))
        else:
            store[sname] = Value(sname, TensorType((E, *s.shape), opts.dtype), WEIGHT, expert_sources(prefix, w, E))
    return store, scales


def module_name(config_name: str) -> str:
    """An IR identifier for a config: a preset's name, or a checkpoint's directory name (a config read
    from a file is named by its path; the attribute `config` keeps that)."""
    from .ir.text import ir_ident

    if config_name.endswith(".json"):
        config_name = Path(config_name).parent.name or Path(config_name).stem
    return ir_ident(config_name)


def trace(cfg: V4Config, opts: TraceOptions | None = None, functions: tuple[str, ...] = FUNCTIONS,
          formats: dict[str, str] | None = None, name: str | None = None, streams: bool = False) -> Module:
    """Trace `cfg` into an IR module (shape-only: no weights are read)."""
    from . import ops

    ops.load_all()
    opts = opts or TraceOptions()
    opts.validate(cfg)
    t0 = time.perf_counter()
    if "draft" in functions and cfg.n_mtp_layers < 1:
        raise InputError("the draft function needs an MTP layer", found=f"n_mtp_layers {cfg.n_mtp_layers}")
    store, scales = weight_values(cfg, opts, formats, include_mtp="draft" in functions)
    P = Params(cfg, store, scales)
    module = Module(name=name or module_name(cfg.name), weights={}, functions={},
                    attrs={"config": cfg.name, **opts.attrs()})
    for fname in functions:
        if fname == "prefill":
            B, T = opts.batch, opts.chunk
        elif fname == "decode":
            B, T = opts.decode_batch, 1
        elif fname in ("verify", "draft"):
            B, T = opts.decode_batch, opts.chunk
        else:
            raise InputError(f"unknown function '{fname}'", expected=" / ".join(FUNCTIONS + ("verify", "draft")))
        with Builder(fname) as b:
            hidden = None
            if fname == "draft":
                hidden = b.input("hidden", TensorType((B, T, cfg.hc_mult, cfg.dim), opts.dtype))
            ids = b.input("ids", TensorType((B, T), "i64"))
            pos = b.input("pos", TensorType((B, T), "i64"))
            layers = [cfg.n_layers] if fname == "draft" else range(cfg.n_layers)
            caches = []
            for layer in layers:
                shapes = layer_cache_shapes(cfg, layer, B, opts.capacity, opts.dtype, opts.numerics)
                caches.append({k: b.input(cache_input_name(layer, k), TensorType(shape, dt))
                               for k, (shape, dt) in shapes.items()})
            step = opts.step(last_only=fname != "verify")
            if fname == "draft":
                logits, out = mtp_step(P, cfg, 0, hidden, ids, pos, caches[0], step)
            else:
                logits, out = model_step(P, cfg, ids, pos, caches, step)
            b.output("logits", logits)
            if fname == "draft" or (streams and fname in ("prefill", "verify")):
                b.output("streams", out)
            for layer, c in zip(layers, caches):
                for k, v in c.items():
                    b.output(cache_input_name(layer, k), v)
        b.fn.attrs = {"batch": B, "tokens": T}
        module.functions[fname] = b.fn
    used = module.used_weights()
    module.weights = {v.name: v for v in list(store.values()) + list(scales.values()) if v.name in used}
    log.debug("traced %s: %s in %.2f s", module.name,
             ", ".join(f"{f} {len(fn.ops)} ops" for f, fn in module.functions.items()), time.perf_counter() - t0)
    return module
