"""The speculative `verify` step traced shape-only (for the cost model; `v4compile/model/speculative.py` is
what it computes).

`verify`, for `B` sequences and `k` drafts: the main model on `1 + k` lanes (every lane's logits), the MTP
block on those lanes' streams with the ids that follow them (`mtp_ids`, the accepted drafts and the
token after them) and `k - 1` recursive MTP applications on one lane each (`draft_ids.<j>` at `draft_pos.<j>`),
with the backbone's and the MTP block's caches as inputs and outputs, as `trace.trace` does for decode.
Only the cost model reads it, as one graph: an artifact compiled with `--draft-tokens` runs the same work as
separate functions (`trace.trace`'s `verify` as `verify_b<B>`, its `draft` as `draft_b<B>`: once on the kept
lanes, then once per recursive draft with one valid lane of the 1 + K), with the acceptance on the host
between them (`runtime/speculative.py`).
"""

from __future__ import annotations

from .config import V4Config
from .errors import InputError
from .ir.builder import Builder
from .ir.core import Module
from .ir.types import TensorType
from .model.blocks import StepOptions, model_step, mtp_step
from .model.cache import cache_input_name, layer_cache_shapes
from .model.params import Params
from .ops import op
from .speculation import MAX_DRAFT_TOKENS
from .trace import TraceOptions, module_name, weight_values


def trace_verify(cfg: V4Config, draft_tokens: int, opts: TraceOptions | None = None) -> Module:
    """A module with `decode` (as `trace.trace` makes it) and `verify` for `opts.decode_batch` sequences."""
    from . import ops
    from .trace import trace

    if cfg.n_mtp_layers < 1:
        raise InputError("the config has no MTP block", expected="n_mtp_layers >= 1")
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise InputError("draft_tokens out of range", expected=f"1..{MAX_DRAFT_TOKENS}", found=draft_tokens)
    ops.load_all()
    opts = opts or TraceOptions()
    module = trace(cfg, opts, functions=("decode",), name=module_name(cfg.name))
    store, scales = weight_values(cfg, opts, include_mtp=True)
    P = Params(cfg, store, scales)
    B, T, k = opts.decode_batch, 1 + draft_tokens, draft_tokens
    with Builder("verify") as b:
        ids = b.input("ids", TensorType((B, T), "i64"))
        pos = b.input("pos", TensorType((B, T), "i64"))
        mtp_ids = b.input("mtp_ids", TensorType((B, T), "i64"))
        caches = []
        for layer in range(cfg.n_layers + 1):
            shapes = layer_cache_shapes(cfg, layer, B, opts.capacity, opts.dtype, opts.numerics)
            caches.append({key: b.input(cache_input_name(layer, key), TensorType(shape, dt))
                           for key, (shape, dt) in shapes.items()})
        logits, streams = model_step(P, cfg, ids, pos, caches[:-1], StepOptions(opts.numerics))
        draft, h = mtp_step(P, cfg, 0, streams, mtp_ids, pos, caches[-1], opts.step(last_only=True))
        b.output("logits", logits)
        b.output("draft_logits.0", draft)
        for j in range(1, k):  # the block again on its own output, one lane, one position further each time
            tok = b.input(f"draft_ids.{j}", TensorType((B, 1), "i64"))
            lane = b.input(f"draft_pos.{j}", TensorType((B, 1), "i64"))
            draft, h = mtp_step(P, cfg, 0, h if j > 1 else last_lane(h, pos), tok, lane, caches[-1],
                                opts.step(last_only=True))
            b.output(f"draft_logits.{j}", draft)
        for layer, c in enumerate(caches):
            for key, v in c.items():
                b.output(cache_input_name(layer, key), v)
    b.fn.attrs = {"batch": B, "tokens": T}
    module.functions["verify"] = b.fn
    used = module.used_weights()
    module.weights = {v.name: v for v in list(store.values()) + list(scales.values()) if v.name in used}
    return module


def last_lane(h, pos):
    """The block's streams at each sequence's last valid lane, as a one-lane chunk `[B, 1, n, D]`."""
    B, _, n, D = h.type.shape
    return op.reshape(op.last_token(h, pos), shape=(B, 1, n, D))
