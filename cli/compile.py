"""`v4compile compile`: the pipeline run on the model the command line names, its report (`--report`,
`--json`), and with `-o DIR` the artifact (the compile driver, `cli/driver.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ..errors import InputError
from ..speculation import MAX_DRAFT_TOKENS
from ..targets import GPU_TARGETS
from .args import add_pipeline_flags, add_source_flags, int_arg, split_specs, threads_arg
from .pipeline import (allreduce_choice, check_outputs, finish, frontend_of, partition_spec, run_pipeline, stages_of,
                       targets_of)

log = logging.getLogger("v4compile")


def _int_list(text: str, what: str) -> tuple[int, ...]:
    parts = [x for x in text.split(",") if x.strip()]
    if len(parts) > 64 or len(text) > 4096:
        raise InputError(f"{what} lists too many buckets", expected="<= 64", found=len(parts))
    try:
        return tuple(int(x, 10) for x in parts)
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers", found=text[:80]) from None


def _buckets_of(args):
    """The artifact's buckets from the command line, checked before any work starts."""
    from ..artifact import Buckets
    from .driver import gpu_default_buckets

    buckets = Buckets(_int_list(args.decode_buckets, "--decode-buckets"),
                      _int_list(args.prefill_buckets, "--prefill-buckets"), args.draft_tokens,
                      _int_list(args.verify_drafts, "--verify-drafts") if args.verify_drafts else None)
    buckets.validate()
    gpu_buckets = gpu_default_buckets(buckets)
    if args.gpu_decode_buckets or args.gpu_prefill_buckets:
        gpu_buckets = Buckets(_int_list(args.gpu_decode_buckets, "--gpu-decode-buckets") if args.gpu_decode_buckets
                              else gpu_buckets.decode,
                              _int_list(args.gpu_prefill_buckets, "--gpu-prefill-buckets") if args.gpu_prefill_buckets
                              else gpu_buckets.prefill, gpu_buckets.draft_tokens)
        gpu_buckets.validate()
    return buckets, gpu_buckets


GOLDEN_BY_DEFAULT = True  # `compile -o` writes the golden (the test suite's conftest turns it off: ~2 s each)
SMALL_MODEL_PARAMS = 2_000_000_000  # the cpu target comes by default with models up to this size
ALL_GPUS = ",".join(GPU_TARGETS)  # `--target` for every GPU target, as messages suggest it


def cmd_compile(args) -> int:
    from .report import build_report, render_report

    check_outputs(args, artifact_dir=True)
    targets = targets_of(args)
    if args.output:
        _buckets_of(args)  # before any work
        targets = artifact_targets(args, targets)
    if args.dtype is None:
        # ONNX Runtime's CPU kernels compute in fp32; GPU targets alone default to bf16.
        args.dtype = "fp32" if "cpu" in targets else "bf16"
    single = _single_pipeline(args)
    fe = frontend_of(args, need_weights=args.check_numerics, shape_only_default=bool(args.output) and "cpu" not in targets,
                     announce="compile", trace=single)
    if args.draft_sinkhorn_iters:  # before any work
        if not (args.output and args.draft_tokens):
            raise InputError("--draft-sinkhorn-iters sets how an artifact's MTP block drafts",
                             expected="-o DIR with --draft-tokens K")
        fe.options.validate(fe.cfg)
    ci = _artifact_plan(args, fe, targets) if args.output else None  # checked before any work
    result = outcome = None
    if single:
        result, outcome = run_pipeline(args, fe)
    st = stages_of(args)
    rep = None
    if args.report or args.json:
        with st("report"):
            rep = build_report(fe.cfg, fe.module, result, tuple(targets))
            rep["threads"] = args._threads
            parallel = _parallel_report(args, fe, result, targets)
            if parallel:
                rep["parallel"] = parallel
                from ..codegen.roofline import add_collectives

                for t, m in rep.get("decode_step", {}).items():  # the per-rank step pays its all-reduces too
                    if t in parallel["decode_step"]:
                        add_collectives(m, parallel["decode_step"][t]["collectives_us"],
                                        parallel["decode_step"][t].get("oneshot"))
    if args.json:
        print(json.dumps(rep, indent=1))
    elif args.report:
        sys.stdout.write(render_report(rep))
        if rep.get("parallel"):
            from ..codegen.parallel_model import render_parallel

            sys.stdout.write(render_parallel(rep["parallel"]))
    refused: list[dict] = []
    if args.output and outcome is not None and not outcome.ok:  # a failed command writes nothing
        log.info("no artifact written to %s: the numerics check failed", args.output)
    elif args.output:
        from dataclasses import replace

        from .driver import compile_buckets, write_artifact

        inputs = replace(compile_buckets(fe, **ci, stages=st), allow_spills=args.allow_spills)
        inputs.golden = args.golden and inputs.reference is not None
        inputs.golden_streaming = args.golden_streaming
        inputs.golden_new_tokens = args.golden_new_tokens

        def verdict(report: dict) -> None:  # before anything is renamed into place: refused, nothing is written
            refused.extend(_spill_verdict(args, inputs, report))
            if refused:
                raise _Refused
        with st("write output", progress="writing the artifact"):
            try:
                write_artifact(inputs, args.output, force=args.force, check=verdict)
            except _Refused:
                pass
    if not (args.output or args.report or args.json or args.dump_ir):
        log.info("compiled %s: %d passes, nothing written (use -o DIR, --report or --dump-ir)", result.module.name,
                 len(result.records))
    rc = finish(args, outcome)
    if rc == 0 and refused:
        print(f"error: {len(refused)} kernel specialisation(s) spill registers (listed above); nothing written to "
              f"{args.output}: --allow-spills writes such an artifact without failing", file=sys.stderr)
        return SPILLS_FOUND
    return rc


SPILLS_FOUND = 1  # exit status of a compile whose kernels spill (as a failed numerics check; bad input is 2)


class _Refused(Exception):
    """The artifact's kernels spill: its writing stops before anything is renamed into place."""


def _spill_verdict(args, inputs, rep: dict) -> list[dict]:
    """The artifact's spilling specialisations (`rep`: its report, before it is written), listed (stderr; with
    --report also in the report); returns those that fail the compile. Refused unless --allow-spills, except in
    an fp32 GPU program: fp32 is a check build (the deployment dtype is bf16), and sm_90a has no fp32 MMA, so its
    dots run as FMA loops whose spills say nothing of the deployed kernels."""
    if not any(t in GPU_TARGETS for t in inputs.targets):
        return []
    spills = rep.get("spilling", [])
    n = len(rep.get("kernels", []))
    line = (f"kernel spills: {len(spills)} of {n} specialisations x targets spill" if spills
            else f"kernel spills: none ({n} specialisations x targets)")
    if args.report and not args.json:
        sys.stdout.write(f"  {line}\n" + "".join(f"    {s['name']} ({s['target']}): {s['spills']} {s['unit']}\n"
                                                for s in spills))
    check_build = inputs.dtype == "fp32"
    for s in spills:
        log.log(logging.INFO if check_build else logging.WARNING, "spills: %s (%s): %d %s", s["name"], s["target"],
                s["spills"], s["unit"])
    if not spills or args.allow_spills:
        return []
    if check_build:
        log.info("%s in this fp32 GPU program (a check build: not refused)", line)
        return []
    return spills


def _parallel_report(args, fe, result, targets) -> dict | None:
    """The report's "parallel" entry of a partitioned compile (codegen/parallel_model.py)."""
    from ..parallel import ParallelLayout

    if result is None or ParallelLayout.of(result.module) is None or "decode" not in result.module.functions:
        return None
    from ..codegen.parallel_model import parallel_section
    from ..passes.base import get_pass

    partitioned = get_pass("partition", {"tp": args.tp, "ep": args.ep, "dp": args.dp}).run(fe.module).module
    return parallel_section(fe.cfg, fe.module, partitioned, result.module, tuple(t for t in targets if t != "cpu")
                            or GPU_TARGETS)


def _config_only(args):
    """The config of the model named (preset or checkpoint directory), without tracing it."""
    from ..config import V4Config, preset

    if args.checkpoint:
        return V4Config.from_dir(args.checkpoint)
    return preset(args.preset or "tiny")


def artifact_targets(args, targets: list[str]) -> list[str]:
    """What `-o` writes: the requested targets, plus, unless --target was given, the cpu target for a
    small model with weights (so that its artifact runs on any machine)."""
    from ..accounting import account

    out = list(targets)
    if (args.target is not None or "cpu" in out or args.weights == "none"
            or account(_config_only(args)).logical_params > SMALL_MODEL_PARAMS):
        return out
    if args.checkpoint:
        from ..checkpoint import Checkpoint

        if set(Checkpoint.open(args.checkpoint).stored_formats().values()) - {"dense"}:
            log.info("compile: the cpu target is left out: its ONNX lowering has no FP8 / FP4 weights yet")
            return out
    return out + ["cpu"]


def _single_pipeline(args) -> bool:
    """Whether the command runs the pipeline on one trace of the command line's shapes (--batch, --chunk,
    --decode-batch): without -o, and with -o for what reads that run (report, numerics, IR prints, dumps);
    the artifact itself is traced and compiled once per bucket."""
    return not args.output or any((args.report, args.json, args.check_numerics, args.dump_ir, args.print_ir_after_all,
                                   args.print_ir_after_change, args.print_ir_after, args.verify_each,
                                   args.stop_after, args.start_from))


def _artifact_plan(args, fe, targets) -> dict:
    """What `driver.compile_buckets` compiles for -o: targets, pipelines, buckets (checked before any work)."""
    from ..passes import CPU_PIPELINE, GPU_PIPELINE

    if args.start_from:
        raise InputError("an artifact is traced per bucket: --start-from cannot be combined with -o")
    if "cpu" in targets and args.dtype != "fp32" and args.numerics != "hf":
        # bf16 on the cpu target rounds each stored value as the reference does, but not the in-op bf16
        # arithmetic that official numerics' FP8 activation roundings would turn into e4m3 steps
        raise InputError("the cpu target runs bf16 with hf numerics only", found=f"--dtype {args.dtype} "
                         f"--numerics {args.numerics}", expected=f"--numerics hf, --dtype fp32, or --target {ALL_GPUS}")
    if "cpu" in targets and fe.source is None:
        raise InputError("the cpu target needs weights", expected="--weights random (presets), a checkpoint, or "
                                                                  f"--target {ALL_GPUS} for a shape-only artifact")
    gpu = [t for t in targets if t != "cpu"]
    cpu_pipeline, gpu_pipeline = list(CPU_PIPELINE), list(GPU_PIPELINE)
    if args.passes:
        if gpu and "cpu" in targets:
            raise InputError("--passes with -o names one pipeline: give either GPU targets or cpu", found=targets)
        if gpu:
            gpu_pipeline = split_specs(args.passes)
        else:
            cpu_pipeline = split_specs(args.passes)
    gpu_pipeline = allreduce_choice(args, gpu_pipeline)
    spec = partition_spec(args)
    if spec is not None:  # one SPMD module per target (a GPU program with collective launches)
        for p in (cpu_pipeline, gpu_pipeline):
            p.insert(0, spec)
    buckets, gpu_buckets = _buckets_of(args)
    return {"buckets": buckets, "pipeline": cpu_pipeline, "targets": tuple(targets),
            "disable": tuple(args.disable_pass), "gpu_pipeline": gpu_pipeline, "jobs": args.jobs,
            "gpu_buckets": gpu_buckets}


def add_command(sub) -> None:
    c = sub.add_parser("compile", help="run the compiler pipeline (and report)")
    add_source_flags(c, numerics="official", dtype=None)  # deployment defaults (dtype: by target)
    add_pipeline_flags(c)
    c.add_argument("--report", action="store_true", help="print launches, pass hits, arena and KV bytes")
    c.add_argument("--json", action="store_true", help="the report as JSON")
    c.add_argument("-o", "--output", help="write the artifact directory (manifest, weights, onnx/, module.ir, report)")
    c.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    c.add_argument("--golden", action=argparse.BooleanOptionalAction, default=GOLDEN_BY_DEFAULT,
                   help="-o: write the golden, the reference model's answer on a seeded ragged batch that `run "
                        "--self-check` and `serve` check every device against (default on; --no-golden skips it)")
    c.add_argument("--golden-streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="make the golden layer by layer, one decoder layer's weights in memory at a time (the same "
                        "golden, bit for bit; it reads the weights once per model step). Default: when the model's "
                        "weights exceed half of this machine's memory")
    c.add_argument("--golden-new-tokens", type=int_arg(1, 64), default=None,
                   help="the golden's decode steps (default: enough to reach the compressed pools and the indexer's "
                        "picks, at most 64; fewer make a cheaper check on slow devices, recorded in golden.json)")
    c.add_argument("--decode-buckets", default="1,2,4,8", help="decode batch buckets (default 1,2,4,8)")
    c.add_argument("--prefill-buckets", default="16,64", help="prefill chunk buckets, batch 1 (default 16,64)")
    c.add_argument("--draft-tokens", type=int_arg(0, MAX_DRAFT_TOKENS), default=0,
                   help="speculative decoding: a verify function per decode bucket for up to this many drafts "
                        "(every target; with MTP weights also the MTP draft and the one-call step; default 0: none)")
    c.add_argument("--verify-drafts", default=None,
                   help="the draft counts whose verify and MTP draft functions the cpu target carries on their own "
                        "1 + k lanes, comma-separated, ending at --draft-tokens (default: every k in 1..K; a step "
                        "verifying fewer drafts than K runs on fewer lanes, as `--draft-tokens auto` chooses)")
    c.add_argument("--draft-sinkhorn-iters", type=int_arg(0, 1000), default=0,
                   help="the MTP block's Sinkhorn iterations when it drafts (1 .. the model's hc_sinkhorn_iters; default "
                        "0: the model's). Fewer make each draft cheaper; the output is the same whatever the value "
                        "(every draft is verified), only the acceptance may change (recorded in the manifest)")
    c.add_argument("--gpu-decode-buckets", default=None,
                   help="decode batch buckets of the GPU targets (default: the largest --decode-buckets; smaller "
                        "batches run padded)")
    c.add_argument("--gpu-prefill-buckets", default=None,
                   help="prefill chunk buckets of the GPU targets (default: the largest --prefill-buckets)")
    c.add_argument("--allow-spills", action="store_true",
                   help="write the artifact without failing when GPU kernels spill registers (otherwise exit "
                        "status 1 and nothing written; recorded in the manifest)")
    c.add_argument("--jobs", type=threads_arg, default=None,
                   help="worker processes compiling kernels ahead of time (default: the CPU count; same output)")
    c.set_defaults(func=cmd_compile)
