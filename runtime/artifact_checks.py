"""What the runtime checks when it opens an artifact's pieces, before ONNX Runtime, the C runtime or `struct`
sees them: each piece against the manifest and against the others. The cost is headers and interfaces,
never a pass over weight bytes.

* ONNX graphs (`onnx_model`): parse errors (garbage, empty files) are one error; no tensor may keep its data
  in an external file (the artifact's graphs never do: weights arrive from the shards in memory); the
  graph's inputs, weights and outputs are the ones the manifest lists for its function, `ids` is
  [batch, tokens] of the function's bucket, `block_table` [batch, blocks_per_seq], `logits` [batch, vocab]
  (every graph but a partitioned function's segment that ends at a collective: `codegen/onnx_segments.py`),
  each weight input has its tensor's shape, and the state the runtime allocates from the graph is bounded.
* weights: each shard's header holds every tensor the manifest places there with the manifest's dtype and
  shape (checked as the shards are mapped: `weights_map.MappedWeights`) and, for the program,
  `program_weight_types`: the program's weight buffers are the manifest's tensors.
* sidecars (`check_sidecar`): every field typed and within the target's limits (block threads, warp size,
  shared memory, grid, scratch sizes), and naming the manifest's kernel and binary.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from v4compile.artifact import Artifact, lane_variant, spec_buckets, spec_names, verify_name
from v4compile.errors import ArtifactError

# Every buffer the runtime allocates from a graph's state inputs, together (V4-Pro's pool at 1 M tokens
# is far below); and never more than this machine's memory.
MAX_STATE_BYTES = 1 << 40


def host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return MAX_STATE_BYTES
ONNX_DTYPE = {1: "fp32", 16: "bf16", 7: "i64", 6: "i32", 9: "bool"}
ONNX_NP = {1: np.float32, 7: np.int64, 6: np.int32}


# ---- weights ------------------------------------------------------------------------------------

def program_weight_types(art: Artifact, program) -> None:
    """The program's weight buffers are the manifest's tensors, with their shapes and dtypes."""
    tensors = art.manifest["weights"]["tensors"]
    for f in program.functions.values():
        for b in f.buffers:
            if b.kind != "weight":
                continue
            w = tensors.get(b.name)
            if w is None:
                raise ArtifactError("the program takes a weight the manifest lacks", where=f"@{f.name}", found=b.name)
            if b.type is not None and (list(b.type.shape) != w["shape"] or b.type.dtype != w["dtype"]):
                raise ArtifactError(f"weight '{b.name}' differs between the program and the manifest",
                                    where=f"@{f.name}", expected=f"{b.type.dtype} {list(b.type.shape)}",
                                    found=f"{w['dtype']} {w['shape']}")


# ---- ONNX ---------------------------------------------------------------------------------------

def _external(g) -> str | None:
    """The name of the first tensor of the graph (subgraphs included) that keeps its data outside the file."""
    import onnx

    for t in g.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or t.external_data:
            return t.name
    for n in g.node:
        for a in n.attribute:
            ts = ([a.t] if a.HasField("t") else []) + list(a.tensors)
            for t in ts:
                if t.data_location == onnx.TensorProto.EXTERNAL or t.external_data:
                    return f"{n.name or n.op_type}.{a.name}"
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                hit = _external(sub)
                if hit:
                    return hit
    return None


def _dims(vi) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]


def onnx_model(art: Artifact, fname: str, spec: dict[str, Any]):
    """The ONNX model of function `fname`, parsed and checked against the manifest (see the module doc)."""
    import onnx
    from google.protobuf.message import DecodeError

    rel = spec["file"]
    raw = art.read_bytes(rel, "ONNX graph")
    try:
        model = onnx.ModelProto.FromString(raw)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"the ONNX graph cannot be parsed ({str(e)[:120] or type(e).__name__})", where=rel) \
            from None
    g = model.graph
    ext = _external(g)
    if ext is not None:
        raise ArtifactError("the ONNX graph keeps tensor data in an external file (an artifact's graphs never do)",
                            where=rel, found=ext)
    ins = [i.name for i in g.input]
    outs = [o.name for o in g.output]
    want_in = list(spec["inputs"]) + list(spec["weights"]) + list(spec.get("derived", {}))
    if sorted(ins) != sorted(want_in) or outs != list(spec["outputs"]):
        diff = sorted(set(ins) ^ set(want_in)) or sorted(set(outs) ^ set(spec["outputs"])) or ["(order)"]
        raise ArtifactError(f"the ONNX graph's interface is not the one the manifest lists for {fname}", where=rel,
                            found=f"{len(ins)} inputs, {len(outs)} outputs; first difference: {diff[0][:60]}")
    m = art.manifest
    B, T = spec["batch"], spec["tokens"]
    by_name = {i.name: i for i in g.input}
    want = {"ids": [B, T], "pos": [B, T], "block_table": [B, m["pool"]["blocks_per_seq"]], "slot": [B]}
    for n, shape in want.items():
        if n in by_name and _dims(by_name[n]) != shape:
            raise ArtifactError(f"the ONNX graph's input '{n}' is not that of {fname}'s bucket", where=rel,
                                expected=shape, found=_dims(by_name[n]))
    logits = next((o for o in g.output if o.name == "logits"), None)
    want_logits = logits_shape(spec, m["vocab_size"])
    # every graph outputs the logits but a segment that ends at a collective (`codegen/onnx_segments.py`)
    if (logits is not None or spec.get("collective") is None) and (logits is None or _dims(logits) != want_logits):
        raise ArtifactError(f"the ONNX graph's logits are not those of {fname}", where=rel,
                            expected=want_logits, found=None if logits is None else _dims(logits))
    tensors = m["weights"]["tensors"]
    for n in [*spec["weights"], *spec.get("derived", {})]:
        vi = by_name[n]
        want_w = spec["derived"][n] if n in spec.get("derived", {}) else tensors[n]  # derived: `onnx_weights`
        if _dims(vi) != want_w["shape"] or ONNX_DTYPE.get(vi.type.tensor_type.elem_type) != want_w["dtype"]:
            raise ArtifactError(f"the ONNX graph takes weight '{n}' with another type than the manifest's",
                                where=rel, expected=f"{want_w['dtype']} {want_w['shape']}",
                                found=f"{ONNX_DTYPE.get(vi.type.tensor_type.elem_type)} {_dims(vi)}")
    total = 0
    for n in spec["inputs"]:
        if n in want:
            continue
        vi = by_name[n]
        dims = _dims(vi)
        et = vi.type.tensor_type.elem_type
        if et not in ONNX_NP or any(d is None or d < 0 for d in dims):
            raise ArtifactError(f"the ONNX graph's state input '{n}' has no static shape of a known type", where=rel)
        total += math.prod(dims) * np.dtype(ONNX_NP[et]).itemsize
    limit = min(MAX_STATE_BYTES, host_memory())
    if total > limit:
        raise ArtifactError("the ONNX graph's state inputs are too large to allocate", where=rel,
                            expected=f"<= {limit} bytes (this machine's memory)", found=f"{total} bytes")
    return model


# ---- sidecars -----------------------------------------------------------------------------------

MAX_BLOCK_THREADS = 1024  # both targets
MAX_GRID = (2 ** 31 - 1, 65535, 65535)
MAX_SCRATCH_BYTES = 1 << 34  # Triton scratch of one launch, all programs together


def check_sidecar(side: Any, k: dict[str, Any], target: str) -> dict[str, Any]:
    """A kernel's sidecar: typed, within the target's limits, naming the manifest's kernel and binary (the
    parameter list against the kernel's call is checked where the call is known)."""
    from v4compile.targets import TARGETS

    where = k["sidecar"]
    spec = TARGETS[target]

    def bad(what: str, **kw):
        return ArtifactError(f"kernel sidecar: {what}", where=where, **kw)

    def ints(key: str, n: int, lo: int, hi) -> list[int]:
        v = side.get(key)
        his = hi if isinstance(hi, tuple) else (hi,) * n
        if (not isinstance(v, list) or len(v) != n or
                any(isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= h for x, h in zip(v, his))):
            raise bad(f"`{key}` must be {n} integers in [{lo}, {list(his) if n > 1 else his[0]}]", found=repr(v)[:60])
        return v

    if not isinstance(side, dict):
        raise bad("not a JSON object", found=type(side).__name__)
    for key, want in (("name", k["name"]), ("target", target), ("binary_sha256", k["sha256"]),
                      ("warp_size", spec.warp_size)):
        if side.get(key) != want or isinstance(side.get(key), bool):
            raise bad(f"`{key}` disagrees with the manifest or the target", expected=want,
                      found=repr(side.get(key))[:60])
    sym = side.get("symbol")
    if not isinstance(sym, str) or not sym or len(sym) > 1024 or not sym.isascii() or not sym.isprintable():
        raise bad("`symbol` must be a printable ASCII name", found=repr(sym)[:60])
    grid = ints("grid", 3, 0, MAX_GRID)
    (warps,) = ints_of(side, "num_warps", bad, 1, MAX_BLOCK_THREADS // spec.warp_size)
    block = ints("block", 3, 1, MAX_BLOCK_THREADS)
    if block != [warps * spec.warp_size, 1, 1]:
        raise bad("`block` is not num_warps x the target's warp size", expected=[warps * spec.warp_size, 1, 1],
                  found=block)
    ints_of(side, "shared_bytes", bad, 0, spec.lds_bytes)
    params = side.get("params")
    if not isinstance(params, list) or len(params) > 4096 or not all(isinstance(p, dict) for p in params):
        raise bad("`params` must be a list of objects", found=repr(params)[:60])
    programs = grid[0] * grid[1] * grid[2]
    for i, p in enumerate(params):
        if not isinstance(p.get("name"), str) or not isinstance(p.get("kind"), str):
            raise bad(f"`params[{i}]` needs a string `name` and `kind`")
        if p["kind"] == "triton_scratch":
            (size,) = ints_of(p, "size_per_program", bad, 0, MAX_SCRATCH_BYTES, f"params[{i}].")
            if size * programs > MAX_SCRATCH_BYTES:
                raise bad(f"`params[{i}]` asks for too much scratch", expected=f"<= {MAX_SCRATCH_BYTES} bytes",
                          found=size * programs)
    return side


def ints_of(d: dict, key: str, bad, lo: int, hi: int, prefix: str = "") -> tuple[int]:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(f"`{prefix}{key}` must be an integer in [{lo}, {hi}]", found=repr(v)[:60])
    return (v,)


# ---- the GPU program ----------------------------------------------------------------------------

def logits_shape(spec: dict, vocab: int) -> list[int]:
    """A function's logits: [batch, vocab] (each sequence's last lane), a verify function's every lane's."""
    return [spec["batch"], spec["tokens"], vocab] if spec["kind"] == "verify" else [spec["batch"], vocab]


def program_interface(art: Artifact, program, gpu: bool, host: bool = False) -> None:
    """The program's functions are the manifest's (GPU target: its functions; else the cpu target's), each
    taking `ids` [batch, tokens] and `block_table` [batch, blocks_per_seq] and giving `logits` (`logits_shape`);
    on the host device its buffers fit this machine's memory."""
    m = art.manifest
    if host:
        sizes = {}
        for f in program.functions.values():
            for b in f.buffers:
                key = b.name if b.kind in ("pool", "state", "weight") else f"{f.name}/{b.name}"
                sizes[key] = max(sizes.get(key, 0), b.nbytes)
        if sum(sizes.values()) > host_memory():
            raise ArtifactError("the program's buffers do not fit this machine's memory",
                                expected=f"<= {host_memory()} bytes", found=f"{sum(sizes.values())} bytes")
    entry = next((t for t in m["targets"] if (t["name"] != "cpu") == gpu), None)
    # the cpu target's verify / draft functions of fewer lanes than K's are its ONNX graphs' only
    want = {n for n in entry["functions"] if not lane_variant(n)} if entry is not None else set()
    # the one-call speculative steps (`passes/spec_steps.py`): the program's own, each with its verify's interface
    steps = {n: verify_name(b) for b in spec_buckets(want)
             for n in spec_names(b, entry["functions"][verify_name(b)]["tokens"] - 1)}
    if set(program.functions) - set(steps) != want:
        raise ArtifactError("the program's functions are not the manifest's", where="gpu/program.txt" if gpu else
                            "program.txt", expected=", ".join(sorted(want)), found=", ".join(sorted(program.functions)))
    for name, f in program.functions.items():
        spec = entry["functions"][steps.get(name, name)]
        B, T = spec["batch"], spec["tokens"]
        ins = {b.name: b for b in f.buffers if b.kind == "input"}
        for n, shape in (("ids", [B, T]), ("block_table", [B, m["pool"]["blocks_per_seq"]])):
            b = ins.get(n)
            if b is None or b.type is None or list(b.type.shape) != shape:
                raise ArtifactError(f"the program's @{name} input '{n}' is not that of its bucket", expected=shape,
                                    found=None if b is None or b.type is None else list(b.type.shape))
        out = dict(f.outputs).get("logits")
        want_logits = logits_shape(spec, m["vocab_size"])
        if out is None or list(out.type.shape) != want_logits:
            raise ArtifactError(f"the program's @{name} logits are not those of its bucket", expected=want_logits,
                                found=None if out is None else list(out.type.shape))
