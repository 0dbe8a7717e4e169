"""The artifact directory: what `v4compile compile -o DIR` writes and `v4compile.load(DIR)` reads.

    DIR/manifest.json          format and compiler versions, the config and its hash, numerics, dtype,
                               buckets, pool geometry, targets (+ their functions' files and interfaces),
                               kernels (target, path, sha256 of every GPU binary and sidecar), the weights
                               layout, and the sha256 of every file
    DIR/weights/*.safetensors  the IR weights exactly as the functions take them (after merges), in shards
                               (none in a shape-only artifact, `--weights none`: kernels and program only);
                               the manifest gives each tensor's shard, dtype, shape and sha256
    DIR/weights/rank-<r>/      instead, a partitioned module's (`--tp` / `--ep`): rank r's weights, each rank
                               its own directory; the manifest's `parallel` gives the layout and every
                               rank's `weights` entry (the top-level `weights` is rank 0's)
    DIR/onnx/<function>.onnx   the `cpu` target: one ONNX model per function (weights are graph inputs,
                               never copied into these files)
    DIR/module.ir              the final IR (text form) of the cpu pipeline
    DIR/gpu/module.ir          the final IR of the gpu pipeline (GPU targets)
    DIR/gpu/program.txt        its program: buffers and ordered launches (codegen/gpu_target.py)
    DIR/kernels/<target>/      gfx950 / sm_90a: one binary + JSON sidecar per kernel specialisation
    DIR/report.json            what was compiled: functions, op counts, pass hits, sizes; for GPU targets
                               the static kernel report (`kernels`) and the modeled decode step per bucket

Writing is atomic (everything goes to a temporary sibling directory renamed at the end; on any error it
is removed) and byte-reproducible (no timestamps, sorted keys, deterministic names). Weights are streamed
(`weights_io`): copied or converted piece by piece in a bounded window, so the whole model is never in
memory; every shard and every tensor is hashed as it is written (`weights.tensors.<name>.sha256`).
Loading treats the artifact as untrusted input: the manifest is checked against its schema and every path
confined to the directory (`manifest.py`), then every file's hash is checked, naming the file that changed;
the runtime checks the pieces against each other as it opens them (`runtime/artifact_checks.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArtifactError, InputError
from .files import sha256_file as files_sha256
from .ir.core import Module
from .parallel import ParallelLayout, RankTensors, rank_weights_module
from .manifest import (FORMAT_VERSION, MANIFEST, TARGET_FORMATS, canonical, check_manifest, confined, manifest_digest,
                       read_manifest)

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 30  # 1 GiB of tensor data per weights shard
TARGETS = tuple(TARGET_FORMATS)  # cpu, gfx950, sm_90a
GPU_TARGETS = tuple(t for t, f in TARGET_FORMATS.items() if f == "triton-aot")


@dataclass(frozen=True)
class Buckets:
    """The static shapes compiled: decode per batch bucket, prefill per chunk bucket (prefill batch 1)."""

    decode: tuple[int, ...] = (1, 2, 4, 8)
    prefill: tuple[int, ...] = (16, 64)

    def validate(self) -> None:
        from .manifest import MAX_BATCH, MAX_BUCKETS, MAX_CHUNK

        for what, v, hi in (("decode batch buckets", self.decode, MAX_BATCH),
                            ("prefill chunk buckets", self.prefill, MAX_CHUNK)):
            if not v or any(b < 1 for b in v) or list(v) != sorted(set(v)):
                raise InputError(f"{what} must be increasing positive integers", found=list(v)[:8])
            if len(v) > MAX_BUCKETS or max(v) > hi:
                raise InputError(f"{what} out of range", expected=f"<= {MAX_BUCKETS} buckets, each <= {hi}",
                                 found=list(v)[:8])


def decode_name(b: int) -> str:
    return f"decode_b{b}"


def prefill_name(t: int) -> str:
    return f"prefill_c{t}"


def sha256_file(path: Path, error: type = ArtifactError) -> str:
    return files_sha256(path, error)


_json = canonical


# ---- building the bucketed module -------------------------------------------------------------

def trace_buckets(cfg, options, buckets: Buckets, formats: dict | None = None) -> Module:
    """One module holding `decode_b<B>` for every decode bucket and `prefill_c<T>` for every chunk bucket.
    The pool is sized for the largest decode bucket (one slot per sequence in flight)."""
    from dataclasses import replace

    from .trace import trace

    buckets.validate()
    fns, weights, attrs = {}, {}, None
    for kind, sizes in (("decode", buckets.decode), ("prefill", buckets.prefill)):
        for n in sizes:
            o = replace(options, decode_batch=n) if kind == "decode" else replace(options, batch=1, chunk=n)
            m = trace(cfg, o, functions=(kind,), formats=formats)
            fn = m.functions[kind]
            fn.name = decode_name(n) if kind == "decode" else prefill_name(n)
            fns[fn.name] = fn
            weights.update(m.weights)
            attrs = attrs or m.attrs
    attrs = {**attrs, "decode_buckets": tuple(buckets.decode), "prefill_buckets": tuple(buckets.prefill),
             "batch": 1, "decode_batch": max(buckets.decode)}
    from .trace import module_name

    return Module(module_name(cfg.name), dict(sorted(weights.items())), fns, attrs)


# ---- weights ------------------------------------------------------------------------------------

def write_weights(module: Module, source, wdir: Path, workers: int | None = None, rel: str = "weights"
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """Shards of IR weights (at most SHARD_BYTES each; see `weights_io`: stored bytes copied where they
    are what the kernels read, converted otherwise, every file and tensor hashed as it is written).
    Returns the manifest's `weights` entry (each tensor with its `sha256`) and the shards' file hashes."""
    from .weights_io import plan_weights, write_shards

    w = write_shards(plan_weights(module, source), source, wdir, SHARD_BYTES, workers=workers, rel=rel)
    return {"layout": "ir", "shards": w.files, "tensors": dict(sorted(w.tensors.items()))}, w.file_sha256


def write_rank_weights(module: Module, source, tmp: Path) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """A partitioned module's weights, one directory per rank (`weights/rank-<r>/`, each rank's own part of
    every rank-local weight and a copy of every replicated one: a rank reads only its directory). Returns
    rank 0's `weights` entry (the manifest's `weights`), the files' hashes and the manifest's `parallel`."""
    layout = ParallelLayout.of(module)
    ranks, hashed = [], {}
    for r in range(layout.world):
        rel = f"weights/rank-{r}"
        (tmp / rel).mkdir(parents=True)
        w, h = write_weights(rank_weights_module(module), RankTensors(module, source, r), tmp / rel, rel=rel)
        ranks.append(w)
        hashed.update(h)
    return ranks[0], hashed, {"tp": layout.tp, "ep": layout.ep, "world": layout.world, "rank_weights": ranks}


# ---- write --------------------------------------------------------------------------------------

@dataclass
class CompileInputs:
    cfg: Any
    module: Module  # the final IR of the pipeline
    source: Any  # gives the IR weights (None: shape-only, no weights written)
    numerics: str
    dtype: str
    buckets: Buckets
    max_context: int
    weights_origin: dict[str, Any]
    pipeline: list[str]
    hits: dict[str, Any] = field(default_factory=dict)
    targets: tuple[str, ...] = ("cpu",)
    gpu_module: Module | None = None  # the gpu pipeline's final module (GPU targets)
    gpu_buckets: Buckets | None = None  # its buckets (default: the largest decode batch and prefill chunk)
    gpu_pipeline: list[str] = field(default_factory=list)
    jobs: int | None = None  # AOT worker processes (does not change any output)


def write_artifact(ci: CompileInputs, out: str | Path, force: bool = False) -> Path:
    """Write the artifact to `out` atomically (replacing an existing artifact there, or with `force` any
    directory)."""
    from . import __version__
    from .ir.text import print_module

    out = Path(out)
    if out.is_symlink():  # replacing it would replace the link, not the directory it names
        raise InputError("output directory is a symlink", where=str(out), expected="the directory it points to")
    if out.exists() and not force and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise InputError("output directory exists and is not an artifact; refusing to replace it", where=str(out))
    unknown = [t for t in ci.targets if t not in TARGETS]
    if unknown:
        raise InputError(f"unknown target '{unknown[0]}'", expected=", ".join(TARGETS))
    gpu = [t for t in ci.targets if t in GPU_TARGETS]
    if gpu and ci.gpu_module is None:
        raise InputError("GPU targets need the gpu pipeline's module", found=", ".join(gpu))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        (tmp / "weights").mkdir(parents=True)
        hashed: dict[str, str] = {}  # files hashed as they were written
        parallel = None
        if ci.source is not None and ParallelLayout.of(ci.module) is not None:
            weights, hashed, parallel = write_rank_weights(ci.module, ci.source, tmp)
        elif ci.source is not None:
            weights, hashed = write_weights(ci.module, ci.source, tmp / "weights")
        else:  # shape-only: the layout the weights will have, no data
            weights = {"layout": "ir", "shape_only": True, "shards": [],
                       "tensors": {n: {"shard": None, "dtype": w.type.dtype, "shape": list(w.type.shape)}
                                   for n, w in sorted(ci.module.weights.items())}}
        targets = []
        if "cpu" in ci.targets:
            targets.append(_write_onnx(ci, tmp))
            (tmp / "module.ir").write_text(print_module(ci.module))
        gt = None
        if gpu:
            from .codegen.gpu_target import write_gpu_targets

            (tmp / "gpu").mkdir()
            (tmp / "gpu" / "module.ir").write_text(print_module(ci.gpu_module))
            gt = write_gpu_targets(ci.gpu_module, gpu, tmp, ci.jobs)
            targets += gt.targets
        report = _report(ci, targets)
        if gt is not None:
            report["kernels"] = gt.rows
            report["decode_step"] = gt.decode_step
        (tmp / "report.json").write_text(_json(report))
        cfg_json = json.loads(ci.cfg.to_json())
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                rel = str(p.relative_to(tmp))
                files[rel] = hashed[rel] if rel in hashed else sha256_file(p)
        manifest = {
            "format_version": FORMAT_VERSION,
            "compiler_version": __version__,
            "model": ci.cfg.name,
            "config": cfg_json,
            "config_hash": hashlib.sha256(json.dumps(cfg_json, sort_keys=True).encode()).hexdigest(),
            "numerics": ci.numerics,
            "dtype": ci.dtype,
            "max_context": ci.max_context,
            "buckets": {"decode_batch": list(ci.buckets.decode), "prefill_chunk": list(ci.buckets.prefill),
                        "prefill_batch": 1,
                        **({"gpu": {"decode_batch": list(ci.gpu_buckets.decode),
                                    "prefill_chunk": list(ci.gpu_buckets.prefill)}} if gpu else {})},
            "pool": {k[len("pool."):]: (list(v) if isinstance(v, tuple) else v)
                     for k, v in ci.module.attrs.items() if k.startswith("pool.")},
            "vocab_size": ci.cfg.vocab_size,
            "pipeline": list(ci.pipeline),
            "pipelines": {k: v for k, v in (("cpu", list(ci.pipeline) if "cpu" in ci.targets else None),
                                            ("gpu", list(ci.gpu_pipeline) if gpu else None)) if v is not None},
            "weights_origin": ci.weights_origin,
            "targets": targets,
            "kernels": gt.kernels if gt is not None else [],
            "weights": weights,
            **({"parallel": parallel} if parallel is not None else {}),
            "files": files,
        }
        manifest["manifest_sha256"] = manifest_digest(manifest)  # the manifest's own bytes are checked too
        (tmp / MANIFEST).write_text(_json(manifest))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote artifact %s (%d files)", out, len(files) + 1)
    return out


def gpu_default_buckets(buckets: Buckets) -> Buckets:
    """The GPU targets' default: one decode and one prefill function, the largest of each. A GPU decode
    step is bound by reading the weights, so padding a smaller batch costs little, while every bucket
    multiplies the kernels to compile (every shape is a compile-time constant of a kernel)."""
    return Buckets((max(buckets.decode),), (max(buckets.prefill),))


def compile_artifact(fe, out: str | Path, buckets: Buckets = Buckets(), pipeline: list[str] | None = None,
                     targets: tuple[str, ...] = ("cpu",), disable: tuple[str, ...] = (), force: bool = False,
                     gpu_pipeline: list[str] | None = None, jobs: int | None = None,
                     gpu_buckets: Buckets | None = None) -> Path:
    """Trace the frontend's model per bucket, run each requested target's pipeline (`pipeline`: the cpu
    one, default CPU_PIPELINE; `gpu_pipeline`: default GPU_PIPELINE, down to the program, on
    `gpu_buckets`, default `gpu_default_buckets`), write the artifact."""
    from .passes import CPU_PIPELINE, GPU_PIPELINE, PassManager, PipelineOptions

    pipeline = list(pipeline or CPU_PIPELINE)
    gpu_pipeline = list(gpu_pipeline or GPU_PIPELINE)
    gpu_buckets = gpu_buckets or gpu_default_buckets(buckets)
    if max(gpu_buckets.decode) != max(buckets.decode):  # one pool (slots) serves every target
        raise InputError("the largest GPU decode bucket must be the largest decode bucket",
                         expected=max(buckets.decode), found=max(gpu_buckets.decode))
    opts = PipelineOptions(disable=tuple(disable))
    cpu_res = gpu_res = None
    if "cpu" in targets:
        cpu_res = PassManager(pipeline, opts).run(trace_buckets(fe.cfg, fe.options, buckets, fe.formats))
    if any(t in GPU_TARGETS for t in targets):
        gpu_res = PassManager(gpu_pipeline, opts).run(trace_buckets(fe.cfg, fe.options, gpu_buckets, fe.formats))
    main = cpu_res or gpu_res
    if cpu_res is not None and gpu_res is not None:
        a = {n: w.type for n, w in cpu_res.module.weights.items()}
        b = {n: w.type for n, w in gpu_res.module.weights.items()}
        if a != b:  # one weights directory serves both targets
            raise InputError("the cpu and gpu pipelines take different weights", found=sorted(set(a) ^ set(b))[:4])
    origin = {"kind": fe.weights, "seed": fe.seed if fe.weights == "random" else None,
              "checkpoint": str(fe.checkpoint) if fe.checkpoint else None}
    ci = CompileInputs(fe.cfg, main.module, fe.source, fe.options.numerics, fe.options.dtype, buckets,
                       fe.options.capacity, origin, pipeline if cpu_res is not None else gpu_pipeline, main.hits(),
                       tuple(targets), gpu_res.module if gpu_res is not None else None, gpu_buckets, gpu_pipeline,
                       jobs)
    return write_artifact(ci, out, force=force)


def _write_onnx(ci: CompileInputs, tmp: Path) -> dict[str, Any]:
    import onnx

    from .codegen.onnx_export import OPSET, export_function, function_io

    (tmp / "onnx").mkdir()
    funcs = {}
    for fname, fn in ci.module.functions.items():
        model = export_function(ci.module, fname)
        path = tmp / "onnx" / f"{fname}.onnx"
        path.write_bytes(model.SerializeToString(deterministic=True))
        io = function_io(model, set(ci.module.weights))
        funcs[fname] = {"file": f"onnx/{fname}.onnx", "kind": fname.split("_")[0], "batch": fn.attrs["batch"],
                        "tokens": fn.attrs["tokens"], "nodes": len(model.graph.node), **io}
        del model
    return {"name": "cpu", "format": "onnx", "opset": OPSET, "onnx_version": onnx.__version__, "functions": funcs}


def _report(ci: CompileInputs, targets: list[dict]) -> dict[str, Any]:
    from collections import Counter

    return {
        "model": ci.cfg.name,
        "numerics": ci.numerics,
        "dtype": ci.dtype,
        "pipeline": list(ci.pipeline),
        "pass_hits": ci.hits,
        "functions": {n: {"ops": len(f.ops), "op_counts": dict(sorted(Counter(op.name for op in f.ops).items())),
                          "batch": f.attrs["batch"], "tokens": f.attrs["tokens"]}
                      for n, f in ci.module.functions.items()},
        "weights_bytes": sum(w.type.nbytes for w in ci.module.weights.values()),
        "kv_bytes_per_token": ci.module.attrs.get("pool.kv_bytes_per_token"),
        "targets": {t["name"]: {f: v["nodes"] if "nodes" in v else v["launches"] for f, v in t["functions"].items()}
                    for t in targets},
        **({"gpu_kv_bytes_per_token": ci.gpu_module.attrs.get("pool.kv_bytes_per_token")} if ci.gpu_module else {}),
    }


# ---- load ---------------------------------------------------------------------------------------

@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]
    verified: bool = True
    deferred: tuple[str, ...] = ()  # files whose hash the weights reader checks as it streams them

    def weights(self):
        """The weights, mapped (`weights_io.MappedWeights`), every shard opened through `file` (listed,
        confined, a regular file); the deferred shards are hashed as streamed."""
        from .weights_io import MappedWeights

        files = self.manifest["files"]
        return MappedWeights(self.path, self.manifest["weights"]["tensors"], ArtifactError,
                             {rel: files[rel] for rel in self.deferred} if self.deferred else None,
                             path_of=lambda rel: self.file(rel, "weights shard"))

    def target(self, name: str) -> dict[str, Any]:
        for t in self.manifest["targets"]:
            if t["name"] == name:
                return t
        raise ArtifactError(f"the artifact has no '{name}' target", where=str(self.path),
                            expected=", ".join(t["name"] for t in self.manifest["targets"]) or "a target")

    def file(self, rel: str, what: str = "file") -> Path:
        """The path of a file of the artifact: listed in the manifest, inside the artifact after every
        symlink, a regular file (checked again at every open: see `manifest.confined`)."""
        return confined(self.path, rel, self.manifest["files"], what)

    def read_bytes(self, rel: str, what: str = "file", limit: int = 1 << 32) -> bytes:
        """A (small) file's bytes, checked against its hash in the manifest when the artifact was verified:
        what is used is what was hashed, even if the file changed since `load_artifact`."""
        from .files import read_bytes

        data = read_bytes(self.file(rel, what), ArtifactError, what, limit)
        if self.verified and hashlib.sha256(data).hexdigest() != self.manifest["files"][rel]:
            raise ArtifactError(f"{what} does not match its hash in the manifest (changed or damaged)", where=rel)
        return data


def load_artifact(path: str | Path, verify: bool = True, defer_weights: bool = False) -> Artifact:
    """Read and check an artifact directory: the manifest (not through a symlink; one typed schema, see
    `manifest.py`), then every file it lists (inside the artifact, a regular file, and with `verify` its
    sha256). Nothing outside the directory is opened. With `defer_weights` the weight shards' hashes are
    left to `Artifact.weights()`, which hashes them as it reads them (one read of every byte, not two)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ArtifactError("an artifact is named by a directory path", found=repr(path)[:60])
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError("not an artifact directory", where=str(path))
    manifest = read_manifest(path)
    try:
        check_manifest(manifest, verify)
    except ArtifactError as e:
        raise ArtifactError(e.what, where=str(path / MANIFEST) if e.where == MANIFEST else e.where,
                            expected=e.expected, found=e.found) from None
    files = manifest["files"]
    shards = set(manifest["weights"].get("shards", [])) & set(files) if verify and defer_weights else set()
    for rel, digest in sorted(files.items()):
        p = confined(path, rel, files)
        if verify and rel not in shards and sha256_file(p) != digest:
            raise ArtifactError("file does not match its hash in the manifest (changed or damaged)",
                                where=str(path / rel), expected=digest[:16] + "...")
    return Artifact(path, manifest, verify, tuple(sorted(shards)))
