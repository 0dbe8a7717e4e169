"""Lower the three attention kinds to one CSR sparse attention over a paged KV pool.

Requires: the traced per-sequence caches (`cache.layers.<l>.{win, rows, state_*, index_*}` inputs and
outputs, named by `model/cache.py`), with `window_write`, `compress` (role `attn.compressor` or
`attn.indexer.compressor`), `attention` and `indexer_scores` reading them, each tagged with its `layer`.
Guarantees:
* the caches are replaced by the pool of `v4compile/pool.py`: planes `pool.*` (main rows: window rings
  per slot growing down from the top, compressed history in block envelopes growing up from row 0;
  the CSA indexer keys in their own index planes) and per-slot compressor state rings `state.*`; new
  per-step inputs `block_table [B, blocks_per_seq]` and `slot [B]` (built by the runtime);
* (a) writes: `window_write` -> `pool_write_window`, `compress` -> `compress_paged` (rows written at
  their physical row through the block table);
* (b) CSR construction: `csr_window` (ring rows before the chunk), `csr_compressed` (all visible HCA rows)
  and `csr_selected` (the CSA top-k translated from sequence-local row numbers to physical rows);
* (c) `attention` -> `sparse_attention`: one softmax with the sink over window rows, compressed rows and
  the chunk's own keys (prefix + extend), given the slot, block table and geometry so that its reference
  sums over `attention`'s key layout (bit-exact to it); `indexer_scores` -> `indexer_scores_paged`;
* the pool geometry (every function's layers: a speculative module's MTP draft functions add the MTP
  layer, sliding-window only, as one more window ring per slot) is recorded in the module attributes
  (`pool.*`), so the IR is self-contained;
* numerics: `native` planes hold exactly the values of the caches; `fp8` / `fp4` planes are exact for
  `numerics=official` (whose roundings put every value on those grids) and lossy otherwise.
Options: `kv_format` (auto | native | bf16 | fp8), `index_format` (auto | native | fp4 | fp8); auto means
fp8 + fp4 (the recipe's pool) for official numerics and native for hf.
Hits: `<func>.attention`, `<func>.window_writes`, `<func>.compressors`, `<func>.indexers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.config import CSA, HCA, SWA
from v4compile.errors import PassError
from v4compile.ir.core import INPUT, Function, Module, Value
from v4compile.ir.types import TensorType
from v4compile.model.cache import parse_cache_input, state_input_name
from v4compile.pool import INDEX_FORMATS, MAIN_FORMATS, PoolGeometry

from .base import Pass, PassResult, register
from .rewrite import Namer, has_role, make_op, new_module, tags_of
from .rewrite import planes as plane_values


def _layers(fn: Function) -> dict[int, dict[str, Value]]:
    out: dict[int, dict[str, Value]] = {}
    for v in fn.inputs:
        m = parse_cache_input(v.name)
        if m:
            out.setdefault(m[0], {})[m[1]] = v
    return out


def _layer(op) -> int:
    if "layer" not in op.attrs:
        raise PassError(f"lower_sparse_attention: op '{op.name}' has no `layer` attribute", where=op.loc or None)
    return op.attrs["layer"]


def _geometry(module: Module, kv_format: str, index_format: str) -> PoolGeometry:
    fns = list(module.functions.values())
    caches: dict[int, dict[str, Value]] = {}
    for fn in fns:  # every function's layers: the MTP draft functions add the MTP layer's window ring
        for layer, c in _layers(fn).items():
            caches.setdefault(layer, c)
    if not caches:
        raise PassError("lower_sparse_attention: no `cache.layers.*` inputs (already lowered?)")
    if sorted(caches) != list(range(len(caches))):  # window rows are laid out by layer number
        raise PassError("lower_sparse_attention: the cached layers are not 0..n-1", found=sorted(caches)[:8])
    ratio: dict[int, int] = {}
    for op in (op for fn in fns for op in fn.ops):
        if op.name == "compress" and has_role(op, "attn.compressor"):
            ratio[_layer(op)] = op.attrs["ratio"]
    layers = []
    for layer, c in sorted(caches.items()):
        kind = CSA if "index_rows" in c else (HCA if "rows" in c else SWA)
        layers.append((layer, kind, ratio.get(layer, 0)))
    win = caches[layers[0][0]]["win"].type
    window, head_dim = win.shape[1], win.shape[2]
    rope_dim = next((op.attrs["dim"] for op in fns[0].ops if op.name == "rope"), 0)
    index_dim = next((c["index_rows"].type.shape[2] for c in caches.values() if "index_rows" in c), 128)
    official = module.attrs.get("numerics") == "official"
    main = kv_format if kv_format != "auto" else ("fp8" if official else "native")
    index = index_format if index_format != "auto" else ("fp4" if official else "native")
    n_seqs = max(f.attrs.get("batch", 1) for f in fns)
    return PoolGeometry.build(layers, window, module.attrs.get("capacity", 256), n_seqs, head_dim, rope_dim, index_dim,
                              main, index, module.attrs.get("dtype", "fp32"))


def lower_function(fn: Function, geo: PoolGeometry) -> tuple[Function, dict[str, int]]:
    namer = Namer(fn)
    caches = _layers(fn)
    B = fn.inputs[0].type.shape[0]
    inputs = [v for v in fn.inputs if not parse_cache_input(v.name)]
    block_table = Value("block_table", TensorType((B, geo.blocks_per_seq), "i32"), INPUT)
    slot = Value("slot", TensorType((B,), "i32"), INPUT)
    main = [Value(n, TensorType(s, dt), INPUT) for n, s, dt in geo.main_planes()]
    index = [Value(n, TensorType(s, dt), INPUT) for n, s, dt in geo.index_planes()] if geo.index_offset else []
    states: dict[str, Value] = {}
    for layer, c in sorted(caches.items()):
        for key in ("state_kv", "state_gate", "index_state_kv", "index_state_gate"):
            if key in c:
                t = c[key].type
                states[state_input_name(layer, key)] = Value(state_input_name(layer, key),
                                                            TensorType((geo.n_slots, *t.shape[1:]), t.dtype), INPUT)
    inputs += [block_table, slot, *main, *index, *states.values()]
    cur_main, cur_index = list(main), list(index)
    cur_state = dict(states)
    rows_of: dict[int, tuple[int, str]] = {}  # id(rows value) -> (layer, main | index)
    hits = {"attention": 0, "window_writes": 0, "compressors": 0, "indexers": 0}
    ops = []

    for op in fn.ops:
        if op.name == "window_write":
            layer = _layer(op)
            new = make_op(namer, "pool_write_window", [op.operand("kv"), op.operand("pos"), slot, *cur_main],
                          {"window": geo.window, "slot_rows": geo.slot_rows, "n_rows": geo.n_rows,
                           "layer_row": layer * geo.window, "fmt": geo.main_fmt, **tags_of(op)}, op.loc)
            cur_main = list(new.results)
            ops.append(new)
            hits["window_writes"] += 1
        elif op.name == "compress":
            layer = _layer(op)
            is_index = has_role(op, "attn.indexer.compressor")
            pre = "index_" if is_index else ""
            skv, sg = cur_state[state_input_name(layer, pre + "state_kv")], cur_state[state_input_name(layer, pre + "state_gate")]
            planes = cur_index if is_index else cur_main
            attrs = {**op.attrs, "block_tokens": geo.block_tokens,
                     "envelope_rows": geo.index_envelope_rows if is_index else geo.envelope_rows,
                     "layer_offset": geo.index_offset_of(layer) if is_index else geo.offset(layer),
                     "fmt": geo.index_fmt if is_index else geo.main_fmt}
            new = make_op(namer, "compress_paged", [*(op.operand(k) for k in ("kv", "gate", "ape", "norm")), skv, sg,
                                                    op.operand("pos"), slot, block_table, *planes], attrs, op.loc)
            cur_state[state_input_name(layer, pre + "state_kv")] = new.out("state_kv_out")
            cur_state[state_input_name(layer, pre + "state_gate")] = new.out("state_gate_out")
            if is_index:
                cur_index = plane_values(new, "q", results=True)
            else:
                cur_main = plane_values(new, "q", results=True)
            rows_of[id(op.out("rows_out"))] = (layer, "index" if is_index else "main")
            ops.append(new)
            hits["compressors"] += 1
        elif op.name == "attention":
            q, kv, p, sink, rows, sel = (op.operand(k) for k in ("q", "kv", "pos", "sink", "rows", "selected"))
            layer = _layer(op)
            cw = make_op(namer, "csr_window", [p, slot], {"window": geo.window, "slot_rows": geo.slot_rows,
                                                          "n_rows": geo.n_rows, **tags_of(op)}, op.loc)
            ops.append(cw)
            wip, wix = cw.results
            cip = cix = None
            if rows is not None:
                r = op.attrs["ratio"]
                common = {"ratio": r, "block_tokens": geo.block_tokens, "envelope_rows": geo.envelope_rows,
                          **tags_of(op)}
                if sel is None:
                    c = make_op(namer, "csr_compressed", [p, block_table], {**common, "max_rows": rows.type.shape[1]},
                                op.loc)
                else:
                    c = make_op(namer, "csr_selected", [sel, p, block_table], common, op.loc)
                ops.append(c)
                cip, cix = c.results
            if op.attrs["window"] != geo.window:
                raise PassError("lower_sparse_attention: an attention window differs from the window ring's size",
                                where=op.loc or None, expected=geo.window, found=op.attrs["window"])
            # The geometry lets the op's reference lay its keys out as `attention` does (ring slots, chunk,
            # compressed rows by window index), so both sum in the same order; the kernels ignore it.
            comp = {} if rows is None else {"ratio": op.attrs["ratio"], "block_tokens": geo.block_tokens,
                                            "envelope_rows": geo.envelope_rows, "comp_rows": rows.type.shape[1]}
            operands = {"q": q, "kv": kv, "pos": p, "sink": sink, "slot": slot,
                        "block_table": None if rows is None else block_table, "win_indptr": wip, "win_indices": wix,
                        "comp_indptr": cip, "comp_indices": cix,
                        **{f"p{i}": v for i, v in enumerate(cur_main)}}
            new = make_op(namer, "sparse_attention", operands,
                          {"window": op.attrs["window"], "scale": op.attrs["scale"], "win_base": layer * geo.window,
                           "comp_base": geo.offset(layer) if rows is not None else 0, "fmt": geo.main_fmt,
                           "slot_rows": geo.slot_rows, "n_rows": geo.n_rows, **comp, **tags_of(op)},
                          op.loc, [op.result])
            ops.append(new)
            hits["attention"] += 1
        elif op.name == "indexer_scores":
            q, w, keys, p = (op.operand(k) for k in ("q", "weights", "keys", "pos"))
            if id(keys) not in rows_of:
                raise PassError("lower_sparse_attention: indexer keys do not come from an indexer compressor")
            layer, _ = rows_of[id(keys)]
            new = make_op(namer, "indexer_scores_paged", [q, w, p, block_table, *cur_index],
                          {**op.attrs, "block_tokens": geo.block_tokens, "envelope_rows": geo.index_envelope_rows,
                           "layer_offset": geo.index_offset_of(layer), "max_rows": keys.type.shape[1],
                           "fmt": geo.index_fmt}, op.loc, [op.result])
            ops.append(new)
            hits["indexers"] += 1
        else:
            for v in op.operands:
                if v is not None and (parse_cache_input(v.name) or id(v) in rows_of) and v.kind == INPUT:
                    raise PassError(f"lower_sparse_attention: op '{op.name}' reads cache {v.name} directly")
            ops.append(op)
    outputs = [(n, v) for n, v in fn.outputs if not parse_cache_input(n)]
    outputs += [(v.name, cur) for v, cur in zip(main, cur_main)] + [(v.name, cur) for v, cur in zip(index, cur_index)]
    outputs += [(name, cur_state[name]) for name in states]
    return Function(fn.name, inputs, ops, outputs, dict(fn.attrs)), hits


@register
@dataclass(frozen=True)
class LowerSparseAttention(Pass):
    name = "lower_sparse_attention"
    kv_format: str = "auto"
    index_format: str = "auto"

    def run(self, module):
        if self.kv_format not in ("auto", *MAIN_FORMATS):
            raise PassError("unknown kv_format", expected=("auto", *MAIN_FORMATS), found=self.kv_format)
        if self.index_format not in ("auto", *INDEX_FORMATS):
            raise PassError("unknown index_format", expected=("auto", *INDEX_FORMATS), found=self.index_format)
        geo = _geometry(module, self.kv_format, self.index_format)
        funcs, hits = {}, {}
        for name, fn in module.functions.items():
            funcs[name], h = lower_function(fn, geo)
            hits.update({f"{name}.{k}": v for k, v in h.items()})
        return PassResult(new_module(module, funcs, attrs={**module.attrs, **geo.to_attrs()}), hits)
