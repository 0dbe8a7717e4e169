"""The artifact's `manifest.json` as untrusted input: read safely, checked against one typed schema, every
path confined to the artifact.

An artifact may come from another machine or another person: hashes prove that the files are the ones the
manifest lists, not that the manifest is sane. So, before anything is opened or sized from it:

* `read_manifest`: `DIR/manifest.json` is a regular file opened without following a symlink and without
  blocking, at most `MAX_MANIFEST_BYTES`, strict JSON (no key twice, no NaN / Infinity, UTF-8), nested at
  most `MAX_DEPTH` deep.
* `check_manifest`: every field the loader and the runtime read has its type and range (integers are JSON
  integers, never booleans; every size bounded before anything is allocated from it); the config is a
  valid config and matches its hash; vocabulary, context, buckets, functions and pool geometry agree with
  each other (the pool is recomputed from the config); every path the runtime opens is relative, free of
  `..`, and listed (and so hashed) in `files`.
* `confined`: a listed path resolved inside the artifact (after every symlink) that names a regular file;
  `load_artifact` applies it to every listed file and the runtime again at every open.

Every refusal is one `ArtifactError` naming the key (or file) and what was expected.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import ArtifactError, ConfigError
from .errors import show_value as _show
from .files import read_sized
from .shard_digest import HASH
from .speculation import MAX_DRAFT_TOKENS
from .targets import TARGET_FORMATS

MANIFEST = "manifest.json"
# the collectives between a partitioned function's ONNX segments (`ops/collective.py`, `runtime/distributed.py`)
SEGMENT_COLLECTIVES = ("all_reduce", "all_gather_rows", "reduce_scatter_rows")
# 3: a tensor's `sha256` and a shard's segments are tree digests (`weights.hash`, `shard_digest.HASH`); 2: a weights
# shard's hash in `files` is its `shard_digest` of whole-segment sha256s; 1: its whole-file sha256
FORMAT_VERSION = 3
MAX_MANIFEST_BYTES = 256 * 1024 * 1024  # V4-Pro's manifest (cpu + gpu targets) is ~40 MB
MAX_DEPTH = 16  # the manifest nests 7 deep (targets / i / functions / f / inputs / i)
MAX_PATH = 1024  # characters of a path inside the artifact
MAX_NAME = 1024  # characters of a tensor, function or kernel name
MAX_ENTRIES = 1_000_000  # files, tensors, kernels, a function's inputs
MAX_BATCH = 4096  # sequences in one decode bucket (and slots of the pool)
MAX_CHUNK = 1 << 20  # tokens in one prefill bucket
MAX_BUCKETS = 64
MAX_BLOCKS = 1 << 22  # pool blocks (the session keeps a free list of them): V4-Pro, 8 x 1 M tokens: 32,768
MAX_RANK = 8
MAX_NUMEL = 1 << 48
IR_DTYPES = ("fp32", "bf16", "fp8e4m3", "e8m0", "fp4x2", "i32", "i64", "bool")
SHA256 = re.compile(r"[0-9a-f]{64}")
KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---- reading ------------------------------------------------------------------------------------

def read_manifest(root: str | Path) -> dict[str, Any]:
    """`root/manifest.json`, parsed strictly; refused if it is a symlink, not a regular file, too large, not
    JSON, or nested too deeply."""
    from .safetensors_io import loads_strict

    root = Path(root)
    mpath = root / MANIFEST
    where = str(mpath)
    try:
        st = os.lstat(mpath)
    except FileNotFoundError:
        raise ArtifactError("not an artifact directory (no manifest.json)", where=str(root)) from None
    except OSError as e:
        raise ArtifactError(f"cannot open manifest.json: {e.strerror}", where=where) from None
    if stat.S_ISLNK(st.st_mode):
        raise ArtifactError("manifest.json is a symlink (the manifest must be a regular file in the artifact)",
                            where=where)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(mpath, flags)
    except OSError as e:
        raise ArtifactError(f"cannot open manifest.json: {e.strerror}", where=where) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError("manifest.json is not a regular file", where=where)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError("manifest.json is too large", where=where, expected=f"<= {MAX_MANIFEST_BYTES} bytes",
                                found=f"{st.st_size} bytes")
        try:
            raw = read_sized(f, st.st_size, MAX_MANIFEST_BYTES)
        except OSError as e:
            raise ArtifactError(f"cannot read manifest.json: {e.strerror}", where=where) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ArtifactError("manifest.json is too large", where=where, expected=f"<= {MAX_MANIFEST_BYTES} bytes")
    m = loads_strict(raw, where, "manifest.json", ArtifactError)  # (the parser's own recursion limit: ~1000)
    if not isinstance(m, dict):
        raise ArtifactError("manifest.json must be a JSON object", where=where, found=type(m).__name__)
    if _depth(m) > MAX_DEPTH:
        raise ArtifactError("manifest.json is nested too deeply", where=where, expected=f"<= {MAX_DEPTH} levels")
    return m


def _depth(v: Any) -> int:
    """The deepest nesting of lists and objects (iterative: stops as soon as it passes MAX_DEPTH)."""
    best, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            best = max(best, d)
            if best > MAX_DEPTH:
                return best
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return best


def canonical(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical text without its own digest field."""
    return hashlib.sha256(canonical({k: v for k, v in manifest.items() if k != "manifest_sha256"}).encode()) \
        .hexdigest()


# ---- paths --------------------------------------------------------------------------------------

def check_rel(rel: Any, key: str) -> str:
    """A syntactically safe path inside the artifact: a non-empty relative POSIX path without `..`."""
    if not isinstance(rel, str) or not rel:
        raise _err(f"`{key}` must be a non-empty path string", found=_show(rel))
    if len(rel) > MAX_PATH or "\0" in rel or "\\" in rel:
        raise _err(f"`{key}` is not a plain relative path", found=_show(rel))
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith("/"):
        raise _err(f"`{key}` is an absolute path (every path must lie inside the artifact)", found=_show(rel))
    if any(part in ("..", ".") for part in rel.split("/")) or "//" in rel or rel.endswith("/"):
        raise _err(f"`{key}` leaves the artifact or is not normalised (`..`, `.`, `//`)", found=_show(rel))
    return rel


def confined(root: Path, rel: str, files: dict[str, str], what: str = "file") -> Path:
    """`root / rel` if `rel` is listed in the manifest's `files`, resolves inside `root` after following
    every symlink, and names a regular file; else one ArtifactError (nothing outside is opened)."""
    check_rel(rel, what)
    if rel not in files:
        raise ArtifactError(f"{what} is not listed (and hashed) in the manifest's `files`", where=rel)
    base = root.resolve()
    p = root / rel
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ArtifactError(f"{what} cannot be resolved ({e})", where=rel) from None
    if base not in real.parents:
        raise ArtifactError(f"{what} resolves outside the artifact (symlink?)", where=rel,
                            expected=f"a file under {base}")
    try:
        st = os.stat(real)
    except OSError as e:
        raise ArtifactError(f"{what} listed in the manifest is missing ({e.strerror})", where=str(p)) from None
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{what} is not a regular file", where=str(p))
    return real


# ---- the schema ---------------------------------------------------------------------------------

def _err(what: str, **kw: Any) -> ArtifactError:
    return ArtifactError(what, where=MANIFEST, **kw)


def _obj(v: Any, key: str) -> dict:
    if not isinstance(v, dict):
        raise _err(f"`{key}` must be an object", found=_show(v))
    return v


def _get(d: dict, k: str, key: str) -> Any:
    if k not in d:
        raise _err(f"missing field `{key}`")
    return d[k]


def _int(v: Any, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(f"`{key}` must be an integer", found=_show(v))
    if not lo <= v <= hi:
        raise _err(f"`{key}` is out of range", expected=f"{lo} <= value <= {hi}", found=v)
    return v


def _str(v: Any, key: str, choices: tuple[str, ...] | None = None, max_len: int = MAX_NAME) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise _err(f"`{key}` must be a string of at most {max_len} characters", found=_show(v))
    if choices is not None and v not in choices:
        raise _err(f"`{key}` has an unknown value", expected=" / ".join(choices), found=_show(v))
    return v


def _list(v: Any, key: str, max_len: int = MAX_ENTRIES) -> list:
    if not isinstance(v, list):
        raise _err(f"`{key}` must be a list", found=_show(v))
    if len(v) > max_len:
        raise _err(f"`{key}` is too long", expected=f"<= {max_len} entries", found=len(v))
    return v


def _strs(v: Any, key: str, unique: bool = True) -> list[str]:
    out = [_str(x, f"{key}[{i}]") for i, x in enumerate(_list(v, key))]
    if unique and len(set(out)) != len(out):
        raise _err(f"`{key}` names an entry twice")
    return out


def _buckets(v: Any, key: str, hi: int) -> list[int]:
    out = [_int(x, f"{key}[{i}]", 1, hi) for i, x in enumerate(_list(v, key, MAX_BUCKETS))]
    if not out or out != sorted(set(out)):
        raise _err(f"`{key}` must be increasing positive integers", found=_show(out))
    return out


def _sha(v: Any, key: str) -> str:
    if not isinstance(v, str) or not SHA256.fullmatch(v):
        raise _err(f"`{key}` must be a sha256 (64 lowercase hex digits)", found=_show(v))
    return v


def _check_weights(w: dict, wk: str, listed) -> dict:
    """One `weights` entry (the top-level one, or a rank's in `parallel.rank_weights`): its shards and
    tensors. Returns the tensors."""
    _str(_get(w, "layout", f"{wk}.layout"), f"{wk}.layout", ("ir",))
    shape_only = w.get("shape_only", False)
    if not isinstance(shape_only, bool):
        raise _err(f"`{wk}.shape_only` must be true or false", found=_show(shape_only))
    if not shape_only:  # what the tensors' `sha256` and the shards' digests mean
        _str(_get(w, "hash", f"{wk}.hash"), f"{wk}.hash", (HASH,))
    shards = _strs(_get(w, "shards", f"{wk}.shards"), f"{wk}.shards")
    for i, s in enumerate(shards):
        listed(s, f"{wk}.shards[{i}]")
    tensors = _obj(_get(w, "tensors", f"{wk}.tensors"), f"{wk}.tensors")
    if len(tensors) > MAX_ENTRIES:
        raise _err(f"`{wk}.tensors` is too long", expected=f"<= {MAX_ENTRIES} entries", found=len(tensors))
    for name, t in tensors.items():
        key = f"{wk}.tensors[{_show(name)}]"
        _str(name, key)
        t = _obj(t, key)
        shard = _get(t, "shard", f"{key}.shard")
        if shape_only:
            if shard is not None:
                raise _err(f"`{key}.shard` must be null in a shape-only artifact", found=_show(shard))
        elif shard not in shards:
            raise _err(f"`{key}.shard` is not one of `{wk}.shards`", found=_show(shard))
        _str(_get(t, "dtype", f"{key}.dtype"), f"{key}.dtype", IR_DTYPES)
        shape = [_int(d, f"{key}.shape[{i}]", 0, MAX_NUMEL)
                 for i, d in enumerate(_list(_get(t, "shape", f"{key}.shape"), f"{key}.shape", MAX_RANK))]
        if math.prod(shape) > MAX_NUMEL:
            raise _err(f"`{key}.shape` has too many elements", expected=f"<= {MAX_NUMEL}", found=math.prod(shape))
        if not shape_only:  # the tensor's bytes in its shard, hashed as written (`weights_write`; `weights.hash`)
            _sha(_get(t, "sha256", f"{key}.sha256"), f"{key}.sha256")
    if shape_only and shards:
        raise _err("a shape-only artifact lists weight shards", found=len(shards))
    return tensors


def _check_parallel(p: Any, w: dict, cfg, listed) -> None:
    """A partitioned artifact (`--tp` / `--ep`, `v4compile/parallel.py`): a layout the config allows, and one
    `weights` entry per rank, each in its own directory, all with the same tensors (the top-level `weights`
    is rank 0's)."""
    p = _obj(p, "parallel")
    tp = _int(_get(p, "tp", "parallel.tp"), "parallel.tp", 1, 1 << 12)
    ep = _int(_get(p, "ep", "parallel.ep"), "parallel.ep", 1, 1 << 14)
    dp = _int(p.get("dp", 1), "parallel.dp", 1, 1 << 12)
    world = _int(_get(p, "world", "parallel.world"), "parallel.world", 1, 1 << 14)
    from .parallel import ParallelLayout

    layout = ParallelLayout(tp, ep, dp)
    if layout.problem() is not None or world != layout.world:
        raise _err("`parallel.world` must be max(dp x tp, ep), a multiple of tp and ep (with dp > 1: ep 1 or the "
                   "world)", found=f"dp {dp}, tp {tp}, ep {ep}, world {world}")
    for what, n, k in (("attention heads", cfg.n_heads, tp), ("o_groups", cfg.o_groups, tp),
                       ("routed experts", cfg.n_experts, ep)):
        if n % k:
            raise _err(f"`parallel`: {k} ranks do not divide the {what}", found=n)
    ranks = _list(_get(p, "rank_weights", "parallel.rank_weights"), "parallel.rank_weights", world)
    if len(ranks) != world:
        raise _err("`parallel.rank_weights` needs one entry per rank", expected=world, found=len(ranks))
    if ranks[0] != w:
        raise _err("`weights` must be rank 0's entry of `parallel.rank_weights`")
    want = {n: (t["dtype"], list(t["shape"])) for n, t in w["tensors"].items()}
    for r, rw in enumerate(ranks):
        key = f"parallel.rank_weights[{r}]"
        tensors = _check_weights(_obj(rw, key), key, listed)
        if {n: (t["dtype"], list(t["shape"])) for n, t in tensors.items()} != want:
            raise _err(f"`{key}` holds other tensors than rank 0 (every rank runs the same program)")
        outside = [s for s in rw["shards"] if not s.startswith(f"weights/rank-{r}/")]
        if outside:
            raise _err(f"`{key}.shards` lie outside weights/rank-{r}/", found=_show(outside[0]))


def _check_onnx_graph(f: dict, fk: str, tensors: dict, listed) -> None:
    """A cpu function's (or one of its segments') ONNX graph entry: its file, step inputs, outputs, weights."""
    listed(_get(f, "file", f"{fk}.file"), f"{fk}.file")
    _int(_get(f, "nodes", f"{fk}.nodes"), f"{fk}.nodes", 0, MAX_ENTRIES * 100)
    ins = _strs(_get(f, "inputs", f"{fk}.inputs"), f"{fk}.inputs")
    _strs(_get(f, "outputs", f"{fk}.outputs"), f"{fk}.outputs")
    ws = _strs(_get(f, "weights", f"{fk}.weights"), f"{fk}.weights")
    unknown = [x for x in ws if x not in tensors]
    if unknown:
        raise _err(f"`{fk}.weights` names a tensor `weights.tensors` lacks", found=_show(unknown[0]))
    if set(ins) & set(ws):
        raise _err(f"`{fk}`: a name is both a step input and a weight", found=_show(sorted(set(ins) & set(ws))[0]))


def _check_segments(f: dict, fk: str, parallel: bool, tensors: dict, listed) -> None:
    """A partitioned function's ONNX segments (`codegen/onnx_segments.py`): each a graph, each but the last
    followed by a collective whose operand that segment outputs; the last outputs the logits."""
    if not parallel:
        raise _err(f"`{fk}.segments`: a function cut at collectives needs the manifest's `parallel` layout")
    if set(f) - {"kind", "batch", "tokens", "segments"}:
        raise _err(f"`{fk}`: a segmented function has no fields beside kind, batch, tokens and segments",
                   found=_show(sorted(set(f) - {"kind", "batch", "tokens", "segments"})))
    segs = _list(f["segments"], f"{fk}.segments")
    if not segs:
        raise _err(f"`{fk}.segments` is empty")
    for k, seg in enumerate(segs):
        sk = f"{fk}.segments[{k}]"
        seg = _obj(seg, sk)
        _check_onnx_graph(seg, sk, tensors, listed)
        c = _get(seg, "collective", f"{sk}.collective")
        if (c is None) != (k == len(segs) - 1):
            raise _err(f"`{sk}.collective`: every segment but the last ends at a collective",
                       found=_show(c))
        if c is None:
            if "logits" not in seg["outputs"]:
                raise _err(f"`{sk}`: the last segment must output the logits")
            continue
        c = _obj(c, f"{sk}.collective")
        _str(_get(c, "op", f"{sk}.collective.op"), f"{sk}.collective.op", SEGMENT_COLLECTIVES)
        group = _int(_get(c, "group", f"{sk}.collective.group"), f"{sk}.collective.group", 1, 1 << 14)
        if "tp" in c:  # the rows collectives of --dp with --tp (`ops/collective.py`)
            tp = _int(c["tp"], f"{sk}.collective.tp", 1, group)
            if group % tp:
                raise _err(f"`{sk}.collective.tp` must divide the group", found=_show((group, tp)))
        operand = _str(_get(c, "operand", f"{sk}.collective.operand"), f"{sk}.collective.operand")
        # an output of its segment, or (the token ids a data-parallel router gathers) a step input
        if operand not in seg["outputs"] and operand not in seg["inputs"] and operand not in ("ids", "hidden"):
            raise _err(f"`{sk}.collective.operand` is not an output of its segment (nor a step input)",
                       found=_show(operand))
        _str(_get(c, "result", f"{sk}.collective.result"), f"{sk}.collective.result")


def check_manifest(m: dict[str, Any], verify: bool = True) -> None:
    """Every field the loader and the runtime read: types, ranges, sizes, agreement. See the module doc."""
    from .config import V4Config
    from .pool import PoolGeometry

    fv = m.get("format_version")
    if isinstance(fv, bool) or fv != FORMAT_VERSION:
        raise _err("unsupported artifact format version", expected=FORMAT_VERSION, found=_show(fv))
    if verify:
        _sha(_get(m, "manifest_sha256", "manifest_sha256"), "manifest_sha256")
        if m["manifest_sha256"] != manifest_digest(m):
            raise _err("manifest.json does not match its own hash (changed or damaged)")
    for k in ("compiler_version", "model"):
        if k in m:
            _str(m[k], k)
    if "pipeline" in m:
        _strs(m["pipeline"], "pipeline", unique=False)
    if "pipelines" in m:
        for k, v in _obj(m["pipelines"], "pipelines").items():
            _strs(v, f"pipelines.{k}", unique=False)
    if "weights_origin" in m:
        _obj(m["weights_origin"], "weights_origin")
    if "allow_spills" in m and not isinstance(m["allow_spills"], bool):
        raise _err("`allow_spills` must be true or false", found=_show(m["allow_spills"]))
    _str(_get(m, "numerics", "numerics"), "numerics", ("hf", "official"))
    _str(_get(m, "dtype", "dtype"), "dtype", ("fp32", "bf16"))

    # the config: a valid config, and the one its hash names
    cfg_json = _obj(_get(m, "config", "config"), "config")
    try:
        cfg = V4Config.from_dict(cfg_json, name="manifest.json config")
    except ConfigError as e:
        raise _err(f"`config` is not a valid config: {e}") from None
    digest = hashlib.sha256(json.dumps(cfg_json, sort_keys=True).encode()).hexdigest()
    if _sha(_get(m, "config_hash", "config_hash"), "config_hash") != digest:
        raise _err("`config_hash` does not match `config`")
    vocab = _int(_get(m, "vocab_size", "vocab_size"), "vocab_size", 1, cfg.vocab_size)
    if vocab != cfg.vocab_size:
        raise _err("`vocab_size` disagrees with the config", expected=cfg.vocab_size, found=vocab)
    max_context = _int(_get(m, "max_context", "max_context"), "max_context", 1, cfg.max_position)

    # buckets
    b = _obj(_get(m, "buckets", "buckets"), "buckets")
    decode = _buckets(_get(b, "decode_batch", "buckets.decode_batch"), "buckets.decode_batch", MAX_BATCH)
    prefill = _buckets(_get(b, "prefill_chunk", "buckets.prefill_chunk"), "buckets.prefill_chunk", MAX_CHUNK)
    _int(_get(b, "prefill_batch", "buckets.prefill_batch"), "buckets.prefill_batch", 1, 1)
    draft_tokens = _int(b["draft_tokens"], "buckets.draft_tokens", 1, MAX_DRAFT_TOKENS) if "draft_tokens" in b else 0
    # the draft counts whose verify / draft functions the cpu target carries on their own lanes (an artifact
    # from before them: K's only)
    verify_drafts = [draft_tokens] if draft_tokens else []
    if "verify_drafts" in b:
        verify_drafts = _buckets(b["verify_drafts"], "buckets.verify_drafts", max(draft_tokens, 1))
        if not draft_tokens or verify_drafts[-1] != draft_tokens:
            raise _err("`buckets.verify_drafts` must end at `buckets.draft_tokens`", expected=_show(draft_tokens),
                       found=_show(verify_drafts))
    mtp_draft = b.get("mtp_draft", False)  # the MTP block compiled: `draft_b<B>` / `draft_c<T>` (1 + K / T lanes)
    if mtp_draft is not False and (mtp_draft is not True or not draft_tokens):
        raise _err("`buckets.mtp_draft` must be true (with `draft_tokens`) or absent", found=_show(mtp_draft))
    if "draft_sinkhorn_iters" in b:  # how the MTP block drafts (an artifact from before it: the config's)
        if not mtp_draft:
            raise _err("`buckets.draft_sinkhorn_iters` is for an artifact with `mtp_draft`")
        _int(b["draft_sinkhorn_iters"], "buckets.draft_sinkhorn_iters", 1, cfg.hc_sinkhorn_iters)
    gpu_b = None
    if "gpu" in b:
        g = _obj(b["gpu"], "buckets.gpu")
        gpu_b = (_buckets(_get(g, "decode_batch", "buckets.gpu.decode_batch"), "buckets.gpu.decode_batch", MAX_BATCH),
                 _buckets(_get(g, "prefill_chunk", "buckets.gpu.prefill_chunk"), "buckets.gpu.prefill_chunk",
                          MAX_CHUNK))
        if max(gpu_b[0]) != max(decode):
            raise _err("the largest GPU decode bucket must be the largest decode bucket", expected=max(decode),
                       found=max(gpu_b[0]))

    # the pool: bounded field by field, then equal to the geometry the config, context and slots imply
    pool = _obj(_get(m, "pool", "pool"), "pool")
    n_slots = _int(_get(pool, "n_slots", "pool.n_slots"), "pool.n_slots", 1, MAX_BATCH)
    if n_slots != max(decode):
        raise _err("`pool.n_slots` must be the largest decode bucket (one slot per sequence in flight)",
                   expected=max(decode), found=n_slots)
    for k, hi in (("block_tokens", 1 << 20), ("blocks_per_seq", MAX_BLOCKS), ("n_blocks", MAX_BLOCKS)):
        _int(_get(pool, k, f"pool.{k}"), f"pool.{k}", 1, hi)
    fmts = {k: _str(_get(pool, k, f"pool.{k}"), f"pool.{k}", ch) for k, ch in
            (("main_fmt", ("native", "bf16", "fp8")), ("index_fmt", ("native", "fp4", "fp8")),
             ("compute_dtype", ("fp32", "bf16")))}
    want = {k[len("pool."):]: (list(v) if isinstance(v, tuple) else v) for k, v in
            PoolGeometry.for_config(cfg, max_context, n_slots, fmts["main_fmt"], fmts["index_fmt"],
                                    fmts["compute_dtype"], 1 if mtp_draft else 0).to_attrs().items()}
    for k, v in want.items():
        if k not in pool:
            raise _err(f"missing field `pool.{k}`")
        if isinstance(pool[k], bool) or pool[k] != v or type(pool[k]) is not type(v) and not isinstance(v, float):
            raise _err(f"`pool.{k}` disagrees with the geometry of the config, max_context and slots",
                       expected=_show(v), found=_show(pool[k]))
    if set(pool) - set(want):
        raise _err("`pool` has unknown fields", found=", ".join(sorted(set(pool) - set(want)))[:80])

    # files: every listed path is a safe relative path with a sha256
    files = _obj(_get(m, "files", "files"), "files")
    if len(files) > MAX_ENTRIES:
        raise _err("`files` is too long", expected=f"<= {MAX_ENTRIES} entries", found=len(files))
    for rel, digest in files.items():
        check_rel(rel, f"files[{_show(rel)}]")
        _sha(digest, f"files[{_show(rel)}]")

    def listed(rel: Any, key: str) -> str:
        check_rel(rel, key)
        if rel not in files:
            raise _err(f"`{key}` names a file the manifest's `files` does not list (and hash)", found=_show(rel))
        return rel

    if "tokenizer" in m:  # optional: the checkpoint's tokenizer files (`tokenizer.py`)
        tk = _obj(m["tokenizer"], "tokenizer")
        if "json" not in tk or set(tk) - {"json", "config"}:
            raise _err("`tokenizer` must name `json` (and optionally `config`)", found=_show(sorted(tk)))
        for k, rel in tk.items():
            listed(rel, f"tokenizer.{k}")

    if "golden" in m:  # optional: the reference's answer every device checks (`golden.py`; `compile --no-golden`)
        gd = _obj(m["golden"], "golden")
        if set(gd) != {"facts", "tensors"}:
            raise _err("`golden` must name `facts` and `tensors`", found=_show(sorted(gd)))
        for k, want in (("facts", "golden/golden.json"), ("tensors", "golden/golden.safetensors")):
            if listed(gd[k], f"golden.{k}") != want:
                raise _err(f"`golden.{k}` names another file", expected=want, found=_show(gd[k]))

    # weights
    w = _obj(_get(m, "weights", "weights"), "weights")
    tensors = _check_weights(w, "weights", listed)
    if "parallel" in m:
        _check_parallel(m["parallel"], w, cfg, listed)

    # targets and their functions
    targets = _list(_get(m, "targets", "targets"), "targets", len(TARGET_FORMATS))
    if not targets:
        raise _err("`targets` is empty", expected="at least one of " + ", ".join(TARGET_FORMATS))
    names: list[str] = []
    for i, t in enumerate(targets):
        key = f"targets[{i}]"
        t = _obj(t, key)
        name = _str(_get(t, "name", f"{key}.name"), f"{key}.name", tuple(TARGET_FORMATS))
        if name in names:
            raise _err(f"`{key}.name` names the target '{name}' twice")
        names.append(name)
        _str(_get(t, "format", f"{key}.format"), f"{key}.format", (TARGET_FORMATS[name],))
        fns = _obj(_get(t, "functions", f"{key}.functions"), f"{key}.functions")
        if name == "cpu":
            _int(_get(t, "opset", f"{key}.opset"), f"{key}.opset", 1, 1000)
            if "program" in t:  # without GPU targets: the program the host device runs
                listed(t["program"], f"{key}.program")
            db, pb = decode, prefill
        else:
            listed(_get(t, "program", f"{key}.program"), f"{key}.program")
            _str(_get(t, "backend", f"{key}.backend"), f"{key}.backend")
            db, pb = gpu_b if gpu_b is not None else (decode, prefill)
        ks = verify_drafts if name == "cpu" else verify_drafts[-1:]  # the GPU targets: K's lanes only

        def lanes(k: int) -> str:  # `artifact.verify_name`'s suffix: K's lanes none
            return f"_d{k}" if k < draft_tokens else ""
        # one function per bucket of each kind the artifact has (the program's one-call speculative steps are
        # its own, each with its verify's interface: `runtime/artifact_checks.program_interface`)
        want_fns = ({f"decode_b{x}": ("decode", x, 1) for x in db} |
                    {f"prefill_c{x}": ("prefill", 1, x) for x in pb} |
                    {f"verify_b{x}{lanes(k)}": ("verify", x, 1 + k) for x in db for k in ks} |
                    {f"draft_b{x}{lanes(k)}": ("draft", x, 1 + k) for x in db for k in (ks if mtp_draft else ())} |
                    {f"draft_c{x}": ("draft", 1, x) for x in pb if mtp_draft})
        if set(fns) != set(want_fns):
            raise _err(f"`{key}.functions` does not hold one function per bucket",
                       expected=", ".join(sorted(want_fns)), found=", ".join(sorted(map(str, fns)))[:200])
        for fname, f in fns.items():
            fk = f"{key}.functions.{fname}"
            f = _obj(f, fk)
            kind, batch, tokens = want_fns[fname]
            for k, v in (("kind", kind), ("batch", batch), ("tokens", tokens)):
                got = _get(f, k, f"{fk}.{k}")
                if isinstance(got, bool) or got != v:
                    raise _err(f"`{fk}.{k}` disagrees with the function's bucket", expected=_show(v), found=_show(got))
            if name == "cpu" and "segments" in f:
                _check_segments(f, fk, "parallel" in m, tensors, listed)
            elif name == "cpu":
                _check_onnx_graph(f, fk, tensors, listed)
            else:
                for k in ("launches", "kernel_calls"):
                    _int(_get(f, k, f"{fk}.{k}"), f"{fk}.{k}", 0, MAX_ENTRIES)
    gpu_targets = [n for n in names if n != "cpu"]
    if gpu_targets and gpu_b is None:
        raise _err("GPU targets need `buckets.gpu`")

    # kernels
    kernels = _list(_get(m, "kernels", "kernels"), "kernels")
    seen: set[tuple[str, str]] = set()
    for i, k in enumerate(kernels):
        key = f"kernels[{i}]"
        k = _obj(k, key)
        target = _str(_get(k, "target", f"{key}.target"), f"{key}.target", tuple(gpu_targets) or ("(no GPU target)",))
        kname = _str(_get(k, "name", f"{key}.name"), f"{key}.name")
        if not KERNEL_NAME.fullmatch(kname):
            raise _err(f"`{key}.name` is not a kernel name", found=_show(kname))
        if (target, kname) in seen:
            raise _err(f"`{key}` lists the {target} kernel '{kname}' twice")
        seen.add((target, kname))
        for field, hk in (("path", "sha256"), ("sidecar", "sidecar_sha256")):
            rel = listed(_get(k, field, f"{key}.{field}"), f"{key}.{field}")
            if not rel.startswith(f"kernels/{target}/"):
                raise _err(f"`{key}.{field}` lies outside kernels/{target}/", found=_show(rel))
            if _sha(_get(k, hk, f"{key}.{hk}"), f"{key}.{hk}") != files[rel]:
                raise _err(f"`{key}.{hk}` disagrees with the hash of {rel} in `files`")
