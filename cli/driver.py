"""The compile driver: from a traced model to an artifact directory (the format: `artifact.py`).

`compile_artifact` traces the model once per bucket, runs each requested target's pipeline once on the
bucketed module, and writes the artifact: the weights streamed (`weights_plan` / `weights_write`: copied or
converted piece by piece in a bounded window, so the whole model is never in memory; every shard and every
tensor hashed as it is written, `weights.tensors.<name>.sha256`), the cpu target's ONNX models
(`codegen/onnx_export`), the GPU targets' program and kernels (`codegen/gpu_target`), the report, and the
manifest.

This is the top of the layers (tests/cli/test_layers.py): it may use the passes and codegen; nothing below
imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..artifact import (TARGETS, Buckets, decode_name, draft_name, draft_prefill_name, lane_variant, prefill_name,
                        spec_buckets, verify_name, write_artifact_dir)
from ..errors import InputError
from ..ir.core import Module
from ..manifest import canonical
from ..parallel import ParallelLayout
from ..rank_weights import RankTensors, rank_weights_module
from ..targets import GPU_TARGETS
from ..timing import Stages
from ..weights_write import WriteStopped

SHARD_BYTES = 1 << 30  # 1 GiB of tensor data per weights shard
CPU_PROGRAM = "program.txt"  # an artifact without GPU targets: the program the host device runs


# ---- building the bucketed module -------------------------------------------------------------

def has_mtp_weights(cfg, formats: dict | None) -> bool:
    """Whether the weights carry the MTP block (`formats`: a checkpoint's stored tensors; None: the spec's
    own weights, random or shape-only, which include it)."""
    if cfg.n_mtp_layers < 1:
        return False
    return formats is None or any(n.startswith("mtp.") for n in formats)


def trace_buckets(cfg, options, buckets: Buckets, formats: dict | None = None, stages: Stages | None = None,
                  mtp: bool = False) -> Module:
    """One module holding `decode_b<B>` for every decode bucket and `prefill_c<T>` for every chunk bucket
    (and `verify_b<B>` per decode bucket when `buckets.draft_tokens` > 0, and `verify_b<B>_d<k>` per
    `buckets.verify_ks()` below K; with `mtp` too, the MTP block's `draft_b<B>` / `draft_b<B>_d<k>` likewise
    and `draft_c<T>` per chunk bucket, and prefill / verify return their final streams), each traced once (timed as `trace` in `stages`). The pool is sized for the largest
    decode bucket (one slot per sequence in flight)."""
    from ..trace import module_name, trace

    buckets.validate()
    stages = stages or Stages(progress_after=None)
    fns, weights, attrs = {}, {}, None
    K = buckets.draft_tokens
    mtp = bool(mtp and K)
    # (kind, bucket, drafts): verify and MTP draft once per draft count with its own lanes (`verify_ks`)
    items = ([("decode", n, 0) for n in buckets.decode] + [("prefill", n, 0) for n in buckets.prefill]
             + [("verify", n, k) for n in buckets.decode for k in buckets.verify_ks()]
             + [("draft", n, k) for n in (buckets.decode if mtp else ()) for k in buckets.verify_ks()]
             + [("draft_c", n, 0) for n in (buckets.prefill if mtp else ())])
    for kind, n, k in items:
        o = {"decode": replace(options, decode_batch=n), "prefill": replace(options, batch=1, chunk=n),
             "verify": replace(options, decode_batch=n, chunk=1 + k),
             "draft": replace(options, decode_batch=n, chunk=1 + k),
             "draft_c": replace(options, decode_batch=1, chunk=n)}[kind]
        traced = "draft" if kind == "draft_c" else kind
        with stages("trace", progress="tracing"):
            m = trace(cfg, o, functions=(traced,), formats=formats, streams=mtp)
        fn = m.functions[traced]
        fn.name = (verify_name(n, k if k < K else None) if kind == "verify" else
                   draft_name(n, k if k < K else None) if kind == "draft" else
                   {"decode": decode_name, "prefill": prefill_name, "draft_c": draft_prefill_name}[kind](n))
        fns[fn.name] = fn
        weights.update(m.weights)
        attrs = attrs or m.attrs
    attrs = {**attrs, "decode_buckets": tuple(buckets.decode), "prefill_buckets": tuple(buckets.prefill),
             "batch": 1, "decode_batch": max(buckets.decode)}
    return Module(module_name(cfg.name), dict(sorted(weights.items())), fns, attrs)


# ---- weights ------------------------------------------------------------------------------------

def write_weights(module: Module, source, wdir: Path, workers: int | None = None, rel: str = "weights",
                  share: int = 1, stop=None) -> tuple[dict[str, Any], dict[str, str]]:
    """Shards of IR weights (at most SHARD_BYTES each; see `weights_plan`: stored bytes copied where they
    are what the kernels read, converted otherwise, every file and tensor hashed as it is written).
    Returns the manifest's `weights` entry (each tensor with its `sha256`) and the shards' digests.
    `share`, `stop`: one of that many writers at once, stopping when `stop` is set (`weights_write.write_shards`)."""
    from ..shard_digest import HASH
    from ..weights_plan import plan_weights
    from ..weights_write import write_shards

    w = write_shards(plan_weights(module, source), source, wdir, SHARD_BYTES, workers=workers, rel=rel, share=share,
                     stop=stop)
    return {"layout": "ir", "hash": HASH, "shards": w.files, "tensors": dict(sorted(w.tensors.items()))}, w.file_digest


RANK_WRITERS = 2  # ranks whose shards are written at once (their memory together is one writer's)


def write_rank_weights(module: Module, source, tmp: Path, writers: int | None = None
                       ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """A partitioned module's weights, one directory per rank (`weights/rank-<r>/`, each rank's own part of
    every rank-local weight and a copy of every replicated one: a rank reads only its directory). Each rank's
    shards are written by its own worker thread, `writers` (default RANK_WRITERS) at a time, each with that
    share of one writer's window, backlog and threads: the peak memory does not grow with the number of
    ranks. Every rank's bytes are the same whatever the writers (each writer is deterministic). Returns
    rank 0's `weights` entry (the manifest's `weights`), the files' digests and the manifest's `parallel`."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    layout = ParallelLayout.of(module)
    writers = max(1, min(layout.world, writers or RANK_WRITERS))
    rank_module = rank_weights_module(module)
    stop = threading.Event()  # set on the first error (or an interrupt here): every other writer stops
    failed: list[BaseException] = []  # the writers' own errors, first first

    def one(r: int) -> tuple[dict[str, Any], dict[str, str]]:
        rel = f"weights/rank-{r}"
        try:
            (tmp / rel).mkdir(parents=True)
            return write_weights(rank_module, RankTensors(module, source, r), tmp / rel, rel=rel, share=writers,
                                 stop=stop)
        except WriteStopped:
            raise
        except BaseException as e:
            failed.append(e)
            stop.set()
            raise

    pool = ThreadPoolExecutor(writers, thread_name_prefix="rank-weights")
    try:
        futures = [pool.submit(one, r) for r in range(layout.world)]
        done = [f.result() for f in futures]  # in rank order
    except WriteStopped:  # this rank stopped because another failed: that error is the one to report
        raise failed[0] from None
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    ranks = [w for w, _ in done]
    hashed = {k: v for _, h in done for k, v in h.items()}
    return ranks[0], hashed, {**layout.manifest(), "rank_weights": ranks}


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
    # Without GPU targets: `module` continued through PROGRAM_PASSES, whose program the host device runs.
    host_module: Module | None = None
    tokenizer_from: Path | None = None  # a checkpoint directory whose tokenizer files are copied in
    # The golden (`v4compile/golden.py`): the reference model's answer on a seeded scenario, which every device
    # checks (`run --self-check`, `serve`). The command line writes it by default; this Python API does not
    # (the tests compile dozens of artifacts and the reference run costs seconds each).
    golden: bool = False
    reference: Any = None  # (streaming=False, on_load=None) -> the ReferenceModel holding the artifact's weights
    golden_streaming: bool | None = None  # the golden layer by layer (None: when the weights exceed STREAM_SHARE of RAM)
    golden_new_tokens: int | None = None  # the golden's decode steps (None: golden.plan's)
    allow_spills: bool = False  # `--allow-spills`: the compile succeeds though kernels spill (recorded)


def write_artifact(ci: CompileInputs, out: str | Path, force: bool = False,
                   check: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Write the artifact of `ci` to `out` atomically (`artifact.write_artifact_dir`). `check(report)`, once the
    kernels are compiled (before the golden): an exception it raises stops the writing with `out` as it was."""
    from ..ir.text import print_module

    unknown = [t for t in ci.targets if t not in TARGETS]
    if unknown:
        raise InputError(f"unknown target '{unknown[0]}'", expected=", ".join(TARGETS))
    gpu = [t for t in ci.targets if t in GPU_TARGETS]
    if gpu and ci.gpu_module is None:
        raise InputError("GPU targets need the gpu pipeline's module", found=", ".join(gpu))

    def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, str]]:
        (tmp / "weights").mkdir()
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
            if ci.host_module is not None:
                targets[-1]["program"] = _write_program(ci.host_module, tmp, CPU_PROGRAM)
        gt = None
        if gpu:
            from ..codegen.gpu_target import write_gpu_targets

            (tmp / "gpu").mkdir()
            (tmp / "gpu" / "module.ir").write_text(print_module(ci.gpu_module))
            gt = write_gpu_targets(ci.gpu_module, gpu, tmp, ci.jobs)
            targets += gt.targets
        from ..tokenizer import copy_tokenizer

        tokenizer = copy_tokenizer(ci.tokenizer_from, tmp / "tokenizer")
        report = _report(ci, targets)
        if gt is not None:
            report["kernels"] = gt.rows
            report["decode_step"] = gt.decode_step
            report["spilling"] = gt.spilling
            if gt.spec_step:  # the one-call speculative step, modeled from the compiled program
                report["spec_step"] = gt.spec_step
        if check is not None:
            check(report)
        golden = _write_golden(ci, tmp, report) if ci.golden else None
        (tmp / "report.json").write_text(canonical(report))
        cfg_json = json.loads(ci.cfg.to_json())
        return {
            "model": ci.cfg.name,
            "config": cfg_json,
            "config_hash": hashlib.sha256(json.dumps(cfg_json, sort_keys=True).encode()).hexdigest(),
            "numerics": ci.numerics,
            "dtype": ci.dtype,
            "max_context": ci.max_context,
            "buckets": {"decode_batch": list(ci.buckets.decode), "prefill_chunk": list(ci.buckets.prefill),
                        "prefill_batch": 1, **({"draft_tokens": ci.buckets.draft_tokens,
                                                "verify_drafts": list(ci.buckets.verify_ks())}
                                               if ci.buckets.draft_tokens else {}),
                        **({"mtp_draft": True, "draft_sinkhorn_iters":
                            ci.module.attrs.get("draft_sinkhorn_iters") or ci.cfg.hc_sinkhorn_iters}
                           if any(n.startswith("draft_") for n in ci.module.functions) else {}),
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
            **({"allow_spills": ci.allow_spills} if gpu else {}),
            "weights": weights,
            **({"parallel": parallel} if parallel is not None else {}),
            **({"tokenizer": tokenizer} if tokenizer else {}),
            **({"golden": golden} if golden else {}),
        }, hashed

    return write_artifact_dir(out, fill, force)


def gpu_default_buckets(buckets: Buckets) -> Buckets:
    """The GPU targets' default: one decode and one prefill function, the largest of each (and the artifact's
    draft tokens: a verify, an MTP draft and the one-call steps for that decode bucket). A GPU decode
    step is bound by reading the weights, so padding a smaller batch costs little, while every bucket
    multiplies the kernels to compile (every shape is a compile-time constant of a kernel)."""
    return Buckets((max(buckets.decode),), (max(buckets.prefill),), buckets.draft_tokens)


def with_spec_steps(pipeline: list[str], module: Module) -> list[str]:
    """`pipeline` with `spec_steps` just before `plan_memory` when `module` has a verify and an MTP draft function
    per some decode bucket (the one-call speculative step, `passes/spec_steps.py`): composed after every fusion,
    so its launches are the fused verify's and draft's. Unchanged otherwise (the recorded pipeline as before).
    On verify (1 + K tokens a sequence) every fusion fires as on decode but the one-token folds: the attention
    into its out-projection (`fuse_out_proj`), the window-ring write into `qkv_norm_rope` (a later lane's write
    would overwrite a row an earlier lane still reads), hence the prologue with its compressor launch
    (`pair_rope_compress`), and the compressor pair (`pair_compressors`); with MTP the last `hc_post` stays out of
    the head (the draft reads the final streams)."""
    if not spec_buckets(module.functions) or "plan_memory" not in pipeline or "spec_steps" in pipeline:
        return pipeline
    i = pipeline.index("plan_memory")
    return [*pipeline[:i], "spec_steps", *pipeline[i:]]


def compile_artifact(fe, out: str | Path, buckets: Buckets = Buckets(), pipeline: list[str] | None = None,
                     targets: tuple[str, ...] = ("cpu",), disable: tuple[str, ...] = (), force: bool = False,
                     gpu_pipeline: list[str] | None = None, jobs: int | None = None,
                     gpu_buckets: Buckets | None = None, golden: bool = False) -> Path:
    """`compile_buckets`, then write the artifact to `out` (with `golden`: the golden too)."""
    ci = compile_buckets(fe, buckets, pipeline, targets, disable, gpu_pipeline, jobs, gpu_buckets)
    return write_artifact(replace(ci, golden=golden), out, force=force)


def compile_buckets(fe, buckets: Buckets = Buckets(), pipeline: list[str] | None = None,
                    targets: tuple[str, ...] = ("cpu",), disable: tuple[str, ...] = (),
                    gpu_pipeline: list[str] | None = None, jobs: int | None = None,
                    gpu_buckets: Buckets | None = None, stages: Stages | None = None) -> CompileInputs:
    """Trace the frontend's model once per bucket and run each requested target's pipeline once on it
    (`pipeline`: the cpu one, default CPU_PIPELINE; `gpu_pipeline`: default GPU_PIPELINE, down to the
    program, on `gpu_buckets`, default `gpu_default_buckets`): what `write_artifact` writes. `stages`
    times the traces and every pass."""
    from ..passes import CPU_PIPELINE, GPU_PIPELINE, PassManager, PipelineOptions

    pipeline = list(pipeline or CPU_PIPELINE)
    gpu_pipeline = list(gpu_pipeline or GPU_PIPELINE)
    gpu_buckets = gpu_buckets or gpu_default_buckets(buckets)
    # one K: the runtime's verify lanes are the artifact's; the GPU targets verify on K's lanes only
    gpu_buckets = replace(gpu_buckets, draft_tokens=buckets.draft_tokens,
                          verify_drafts=(buckets.draft_tokens,) if buckets.draft_tokens else None)
    if max(gpu_buckets.decode) != max(buckets.decode):  # one pool (slots) serves every target
        raise InputError("the largest GPU decode bucket must be the largest decode bucket",
                         expected=max(buckets.decode), found=max(gpu_buckets.decode))
    opts = PipelineOptions(disable=tuple(disable), **({"stages": stages} if stages is not None else {}))
    cpu_res = gpu_res = None
    mtp = has_mtp_weights(fe.cfg, fe.formats)
    if "cpu" in targets:
        cpu_res = PassManager(pipeline, opts).run(trace_buckets(fe.cfg, fe.options, buckets, fe.formats, stages, mtp))
    if any(t in GPU_TARGETS for t in targets):
        traced = trace_buckets(fe.cfg, fe.options, gpu_buckets, fe.formats, stages, mtp)
        gpu_pipeline = with_spec_steps(gpu_pipeline, traced)
        gpu_res = PassManager(gpu_pipeline, opts).run(traced)
    main = cpu_res or gpu_res
    if cpu_res is not None and gpu_res is not None:
        a = {n: w.type for n, w in cpu_res.module.weights.items()}
        b = {n: w.type for n, w in gpu_res.module.weights.items()}
        if a != b:  # one weights directory serves both targets
            raise InputError("the cpu and gpu pipelines take different weights", found=sorted(set(a) ^ set(b))[:4])
    host = None
    if cpu_res is not None and gpu_res is None:  # the host device's program (else the GPU targets')
        from ..passes import PROGRAM_PASSES

        # with MTP: the one-call greedy speculative step per decode bucket too, as in the GPU pipeline
        # the verify / draft functions of fewer lanes are the ONNX graphs' only (`lane_variant`)
        m = cpu_res.module
        m = Module(m.name, m.weights, {n: f for n, f in m.functions.items() if not lane_variant(n)}, m.attrs)
        host = PassManager(with_spec_steps(PROGRAM_PASSES, m), opts).run(m).module
    origin = {"kind": fe.weights, "seed": fe.seed if fe.weights == "random" else None,
              "checkpoint": str(fe.checkpoint) if fe.checkpoint else None}
    return CompileInputs(fe.cfg, main.module, fe.source, fe.options.numerics, fe.options.dtype, buckets,
                         fe.options.capacity, origin, pipeline if cpu_res is not None else gpu_pipeline, main.hits(),
                         tuple(targets), gpu_res.module if gpu_res is not None else None, gpu_buckets, gpu_pipeline,
                         jobs, host, fe.checkpoint, reference=fe.reference if fe.source is not None else None)


def _write_golden(ci: CompileInputs, tmp: Path, report: dict[str, Any]) -> dict[str, str] | None:
    """The golden (`v4compile/golden.py`) from the frontend's reference model: the artifact's weights,
    numerics and dtype; for a partitioned artifact, the reference of its layout (its per-rank sums in rank
    order). Its facts go into the report too (what the check covers and what it cannot)."""
    import logging

    from ..golden import make_golden, write_golden

    if ci.reference is None:  # shape-only: nothing to run
        return None
    log = logging.getLogger("v4compile")
    streaming = ci.golden_streaming
    if streaming is None:
        streaming = golden_weight_bytes(ci.cfg, ci.dtype) > STREAM_SHARE * physical_memory()
    progress = GoldenProgress(log, ci.cfg.n_layers) if streaming else None
    model = ci.reference(streaming=True, on_load=progress) if streaming else ci.reference()
    layout = ParallelLayout.of(ci.module)
    if layout is not None:
        model = model.partitioned(layout.tp, layout.ep)
    if progress is not None:
        from ..golden import model_steps, plan

        progress.expect(model_steps(plan(ci.cfg, tuple(ci.buckets.prefill), ci.max_context,
                                         new_tokens=ci.golden_new_tokens), tuple(ci.buckets.prefill)))
    g = make_golden(model, ci.numerics, ci.dtype, tuple(ci.buckets.prefill), ci.max_context,
                    new_tokens=ci.golden_new_tokens)
    g.facts["streaming"] = bool(streaming)
    f = g.facts
    log.info("golden: %d prompts of %s tokens, %d greedy tokens each, by the reference model (%s, %s) in %.2f s",
             len(f["prompts"]), "/".join(str(len(p)) for p in f["prompts"]), f["new_tokens"], ci.numerics, ci.dtype,
             f["seconds"])
    ch = f["choices"]
    if ch["clean"]:
        log.info("golden: prompts of seed %d (candidate %d of %d): every router / indexer choice clears its rounding "
                 "bound (smallest margin %s x the near-tie threshold)", f["seed"], ch["candidate"] + 1, ch["candidates"],
                 "none" if ch["smallest_margin"] is None else f"{ch['smallest_margin']:.3g}")
    else:
        log.info("golden: none of %d seeded prompt sets is free of near-tie router / indexer choices (%s, smallest "
                 "margin %.3g x the threshold): the self-check judges each row the device's differing router picks "
                 "do not reach (cpu, host, hip, cuda, each rank of a partitioned artifact its own; a lane whose picks "
                 "are not read: its logits only before its first near tie, steps %s of %d)", ch["candidates"],
                 ci.dtype, ch["smallest_margin"], "/".join(map(str, ch["clean_steps"])), f["new_tokens"])
    report["golden"] = {k: f[k] for k in ("new_tokens", "covers", "scale", "logits", "seconds", "seed", "choices")} | {
        "prompt_tokens": [len(p) for p in f["prompts"]],
        "checks": "greedy ids (but at near ties), every step's logits but those a router pick of the device's that "
                  "differs at a near tie reaches (cpu, host, hip, cuda: on a GPU the fused MoE launch's picks "
                  "copied from its scratch route_indices by the C runtime's probe table; a partitioned artifact: each "
                  "rank's own, with --dp its replica's lanes; a lane whose picks are not read: those from its "
                  "first near-tie router / indexer choice on), the device's router picks "
                  "against the golden's and their scores (cpu, host; not read on hip / cuda), "
                  "the per-layer fingerprint of the first prefill chunk on a failure (cpu: extra graph outputs; "
                  "host, hip, cuda: the C runtime's probe table, also per rank of a partitioned artifact without "
                  "--dp); a fault that "
                  "moves no judged logit or router score of these prompts by more than its bound passes unseen"}
    return write_golden(g, tmp)


STREAM_SHARE = 0.5  # the golden streams its weights when they exceed this share of the machine's memory


def golden_weight_bytes(cfg, dtype: str) -> int:
    """The reference model's weights held dense in `dtype` (the in-memory golden's largest cost)."""
    from ..accounting import account

    return account(cfg).logical_params * (4 if dtype == "fp32" else 2)


def physical_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class GoldenProgress:
    """The streaming golden's progress: one line per tenth of its layer passes, with the time left at the
    rate so far (each pass reads one decoder layer's weights from the checkpoint)."""

    def __init__(self, log, n_layers: int):
        import time

        self.log, self.L, self.t0, self.total, self.next = log, n_layers, time.perf_counter(), 0, 0

    def expect(self, steps: int) -> None:
        self.total = steps * self.L
        self.log.info("golden (streaming): %d model steps x %d layers = %d layer reads of the checkpoint per "
                      "prompt candidate", steps, self.L, self.total)

    def __call__(self, layer: int, loads: int) -> None:
        import time

        done = (loads - 1) % self.total + 1 if self.total else 0
        if not self.total or (loads < self.next and done != self.total):
            return
        self.next = loads + max(1, self.total // 10)
        dt = time.perf_counter() - self.t0
        left = dt / loads * (self.total - done)
        self.log.info("golden (streaming): layer read %d of %d (layer %d), %.1f s so far, about %.1f s left for "
                      "this candidate", done, self.total, layer, dt, left)


def _write_program(module: Module, tmp: Path, rel: str) -> str:
    """The module's program as text (parsed back and verified at load)."""
    from ..program.build import program_of
    from ..program.text import print_program

    (tmp / rel).write_text(print_program(program_of(module)))
    return rel


def _write_onnx(ci: CompileInputs, tmp: Path) -> dict[str, Any]:
    import onnx

    from ..codegen.onnx.graph import OPSET
    from ..codegen.onnx_export import export_function, function_io
    from ..codegen.onnx_session import SessionOptions

    (tmp / "onnx").mkdir()
    funcs = {}
    wnames = set(ci.module.weights)

    def written(model, name: str) -> dict[str, Any]:
        (tmp / "onnx" / f"{name}.onnx").write_bytes(model.SerializeToString(deterministic=True))
        return {"file": f"onnx/{name}.onnx", "nodes": len(model.graph.node), **function_io(model, wnames)}

    partitioned = ParallelLayout.of(ci.module) is not None
    for fname, fn in ci.module.functions.items():
        head = {"kind": fname.split("_")[0], "batch": fn.attrs["batch"], "tokens": fn.attrs["tokens"]}
        if partitioned:  # ONNX Runtime cannot exchange values between ranks: segments cut at the collectives
            from ..codegen.onnx_segments import export_segments

            segs = []
            for k, (model, c) in enumerate(export_segments(ci.module, fname)):
                segs.append({**written(model, f"{fname}.s{k}"), "collective": None if c is None else
                             {"op": c.name, "operand": c.operands[0].name, "result": c.results[0].name,
                              "group": c.attrs["group"],
                              # a replica's ranks' rows (`ops/collective.py`); absent at 1: the manifests of
                              # the other layouts as they were
                              **({"tp": c.attrs["tp"]} if c.attrs.get("tp", 1) > 1 else {})}})
            funcs[fname] = {**head, "segments": segs}
        else:
            funcs[fname] = {**head, **written(export_function(ci.module, fname), fname)}
    return {"name": "cpu", "format": "onnx", "opset": OPSET, "onnx_version": onnx.__version__, "functions": funcs,
            "session": SessionOptions().to_manifest()}


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
        "targets": {t["name"]: {f: _size(v) for f, v in t["functions"].items()} for t in targets},
        **({"gpu_kv_bytes_per_token": ci.gpu_module.attrs.get("pool.kv_bytes_per_token")} if ci.gpu_module else {}),
    }


def _size(f: dict[str, Any]) -> int:
    """A function's ONNX nodes (all its segments') or launches."""
    if "segments" in f:
        return sum(s["nodes"] for s in f["segments"])
    return f["nodes"] if "nodes" in f else f["launches"]
