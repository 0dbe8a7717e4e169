"""`v4compile ir ...` (IR dump and pass debugging) and `v4compile compile ...`.

Shared by both: the model source (CHECKPOINT or --preset), the trace knobs (--batch, --chunk,
--decode-batch, --max-context, --numerics, --dtype, --weights) and the pipeline flags
(--passes, --print-ir-after-all, --print-ir-after-change, --print-ir-after PASS, --dump-ir DIR,
--verify-each, --disable-pass PASS, --stop-after PASS, --start-from FILE.ir, --time-passes,
--check-numerics).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .errors import InputError, V4Error

log = logging.getLogger("v4compile")


def add_source_flags(p: argparse.ArgumentParser, numerics: str = "hf", dtype: str | None = "fp32") -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", help="checkpoint directory or .safetensors file")
    p.add_argument("--preset", help="tiny (default), tiny-pro, v4-flash, v4-pro")
    p.add_argument("--weights", choices=("none", "random", "checkpoint"),
                   help="none: shape-only, weights typed as released (FP8/FP4); random: seeded random weights "
                        "(preset default); checkpoint: the checkpoint's (default with CHECKPOINT)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and of the numerics scenario")
    g = p.add_argument_group("trace")
    g.add_argument("--batch", type=int, default=2, help="prefill batch (sequences per prefill call)")
    g.add_argument("--chunk", type=int, default=16, help="prefill chunk (tokens per sequence per call)")
    g.add_argument("--decode-batch", type=int, default=2, help="decode batch")
    g.add_argument("--max-context", type=int, default=256, help="max tokens per sequence (sizes the caches)")
    g.add_argument("--numerics", choices=("hf", "official"), default=numerics,
                   help=f"hf: match transformers; official: + the QAT roundings (default {numerics})")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default=dtype,
                   help=f"compute dtype (default {dtype or 'fp32 for the cpu target, else bf16'})")


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline")
    g.add_argument("--passes", help="comma-separated pass specs (name or name{k=v,...}); default: the target's pipeline")
    g.add_argument("--target", default="gpu",
                   help="what to compile for, comma-separated: gfx950, sm_90a (or gpu: both; their pipeline runs to "
                        "the program) and cpu (the ONNX path's pipeline); default gpu")
    g.add_argument("--print-ir-after-all", action="store_true")
    g.add_argument("--print-ir-after-change", action="store_true")
    g.add_argument("--print-ir-after", action="append", default=[], metavar="PASS")
    g.add_argument("--dump-ir", metavar="DIR", help="write NN-<pass>.ir after every pass (00-traced.ir first)")
    g.add_argument("--verify-each", action="store_true", help="run the verifier after every pass")
    g.add_argument("--disable-pass", action="append", default=[], metavar="PASS")
    g.add_argument("--stop-after", metavar="PASS")
    g.add_argument("--start-from", metavar="FILE.ir", help="resume from a dumped module (after the pass it names)")
    g.add_argument("--time-passes", action="store_true")
    g.add_argument("--check-numerics", action="store_true",
                   help="after each pass, interpret the module on a seeded scenario against ReferenceModel")
    g.add_argument("--tol", type=float, default=1e-5,
                   help="numerics tolerance: max |logit error| relative to the largest reference logit (default 1e-5)")
    g.add_argument("--check-prompt-len", type=int, default=100)
    g.add_argument("--check-steps", type=int, default=32, help="decode steps of the numerics scenario")


def _split_specs(text: str) -> list[str]:
    """Split `a,b{x=1,y=2},c` at top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


GPU_TARGETS = ("gfx950", "sm_90a")


def targets_of(args) -> list[str]:
    """The requested targets, `gpu` expanded to every GPU target; an unknown name is an error."""
    out: list[str] = []
    for t in (x.strip() for x in str(getattr(args, "target", "gpu")).split(",")):
        names = list(GPU_TARGETS) if t == "gpu" else [t]
        for n in names:
            if n not in (*GPU_TARGETS, "cpu"):
                raise InputError("unknown --target", expected="gfx950, sm_90a, gpu or cpu", found=t)
            if n not in out:
                out.append(n)
    if not out:
        raise InputError("--target names no target", expected="gfx950, sm_90a, gpu or cpu")
    return out


def pipeline_name(target: str) -> str:
    return "cpu" if target == "cpu" else "gpu"


def pipeline_of(args) -> list[str]:
    from .passes import PIPELINES

    if args.passes:
        return _split_specs(args.passes)
    return list(PIPELINES[pipeline_name(targets_of(args)[0])])


def trace_options(args):
    from .trace import TraceOptions

    return TraceOptions(batch=args.batch, chunk=args.chunk, decode_batch=args.decode_batch, capacity=args.max_context,
                        numerics=args.numerics, dtype=args.dtype)


def frontend_of(args, need_weights: bool = False):
    from . import frontend

    if args.checkpoint and args.preset:
        raise InputError("give either CHECKPOINT or --preset, not both")
    weights = args.weights
    if need_weights and weights == "none":
        raise InputError("numerics checks need weights", expected="--weights random or a checkpoint")
    return frontend.load(args.checkpoint, args.preset, weights, trace_options(args), seed=args.seed)


def numerics_check(args, fe):
    from .harness import Scenario
    from .passes.numerics import NumericsCheck

    if args.decode_batch != args.batch:
        raise InputError("--check-numerics carries caches from prefill to decode: --batch must equal --decode-batch",
                         found=(args.batch, args.decode_batch))
    if args.check_prompt_len + args.check_steps > args.max_context:
        raise InputError("the numerics scenario does not fit the max context",
                         expected=f"--check-prompt-len + --check-steps <= {args.max_context}")
    sc = Scenario.make(fe.cfg.vocab_size, args.batch, args.check_prompt_len, args.check_steps, seed=args.seed)
    check = NumericsCheck(fe.reference(), fe.source, sc, args.chunk, 0.0, capacity=args.max_context)
    check.tol = args.tol * check.scale
    return check


def run_pipeline(args, fe, module=None):
    from .ir.text import parse_module
    from .passes import PassManager, PipelineOptions
    from .passes.manager import stage_of_dump

    start_after = None
    if args.start_from:
        try:
            text = Path(args.start_from).read_text()
        except OSError as e:
            raise InputError(f"cannot read IR file: {e.strerror}", where=args.start_from) from None
        module = parse_module(text)
        from .ir.verify import verify
        verify(module)
        start_after = stage_of_dump(args.start_from) or "traced"
    module = module or fe.module
    check = None
    if args.check_numerics and args.dtype != "fp32":
        _check_fp32_shadow(args, start_after)
    elif args.check_numerics:
        check = numerics_check(args, fe)
    opts = PipelineOptions(print_after_all=args.print_ir_after_all, print_after_change=args.print_ir_after_change,
                           print_after=tuple(args.print_ir_after), dump_ir=args.dump_ir, verify_each=args.verify_each,
                           disable=tuple(args.disable_pass), stop_after=args.stop_after, time_passes=args.time_passes,
                           check_numerics=check)
    result = PassManager(pipeline_of(args), opts).run(module, start_after=start_after)
    if check is not None:
        _report_numerics(result, check.tol, check.scale)
    return result


def _check_fp32_shadow(args, start_after) -> None:
    """bf16 rounding differences flip discrete choices (indexer / router top-k) on random weights, so
    logit comparisons in bf16 say nothing about a pass. The passes are dtype-independent rewrites: check
    the same pipeline on an fp32 trace of the same model instead."""
    import copy

    from .passes import PassManager, PipelineOptions

    shadow = copy.copy(args)
    shadow.dtype = "fp32"
    if args.start_from:
        raise InputError("--check-numerics with --start-from needs --dtype fp32 (the dump is the module to check)")
    log.warning("checking numerics on an fp32 trace of the same model and pipeline (compute dtype here: %s)",
                args.dtype)
    fe = frontend_of(shadow, need_weights=True)
    check = numerics_check(shadow, fe)
    result = PassManager(pipeline_of(args), PipelineOptions(disable=tuple(args.disable_pass),
                                                            stop_after=args.stop_after,
                                                            check_numerics=check)).run(fe.module)
    _report_numerics(result, check.tol, check.scale, "fp32 shadow")


def _report_numerics(result, tol: float, scale: float, what: str = "") -> None:
    o = sys.stderr
    o.write(f"// ----- numerics{' (' + what + ')' if what else ''}: max |logit error| vs ReferenceModel, "
            f"relative to max |logit| {scale:.3g}; tolerance {tol / scale:g} -----\n")
    if result.traced_error is not None:
        o.write(f"  {'traced':<40} {result.traced_error / scale:.3g}\n")
    for r in result.records:
        flag = "  <-- breaks tolerance" if r.numerics_error is not None and r.numerics_error > tol else ""
        o.write(f"  {r.spec:<40} {r.numerics_error / scale:.3g}{flag}\n")
    bad = result.first_numerics_failure(tol)
    if result.traced_error is not None and result.traced_error > tol:
        o.write("  the traced module already breaks tolerance\n")
    elif bad is not None:
        o.write(f"  first pass that breaks tolerance: {bad.spec} (run `v4compile ir bisect` to find the op)\n")
    else:
        o.write("  every pass within tolerance\n")


# ---- ir ----------------------------------------------------------------------------------------

def cmd_ir_dump(args) -> int:
    from .ir.export import to_dot, to_json
    from .ir.text import print_module

    fe = frontend_of(args, need_weights=args.check_numerics)
    stage = args.stage or ("final" if _pipeline_flags_given(args) else "traced")
    if stage == "traced":
        module = fe.module
    else:
        if stage.startswith("after:"):
            args.stop_after = stage.split(":", 1)[1]
        elif stage not in ("final", "program"):
            raise InputError("unknown --stage", expected="traced, final, program or after:PASS", found=stage)
        module = run_pipeline(args, fe).module
    funcs = None if args.function == "all" else [args.function]
    if funcs and funcs[0] not in module.functions:
        raise InputError(f"no function @{funcs[0]}", expected=", ".join(module.functions))
    if stage == "program":
        from .program.build import build_program
        from .program.text import print_program
        from .program.verify import verify_program

        if args.format != "text":
            raise InputError("the program prints as text only", found=f"--format {args.format}")
        text = print_program(verify_program(build_program(module)), funcs)
    elif args.format == "text":
        text = print_module(module, funcs)
    elif args.format == "json":
        text = to_json(module, funcs)
    else:
        text = "".join(to_dot(module.functions[f]) for f in (funcs or list(module.functions)))
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _pipeline_flags_given(args) -> bool:
    return bool(args.passes or args.print_ir_after_all or args.print_ir_after_change or args.print_ir_after
                or args.dump_ir or args.verify_each or args.disable_pass or args.stop_after or args.start_from
                or args.time_passes or args.check_numerics)


def _read_ir(path: str):
    from .ir.text import parse_module
    from .ir.verify import verify

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InputError(f"cannot read IR file: {e.strerror}", where=path) from None
    try:
        return verify(parse_module(text))
    except V4Error as e:
        raise type(e)(e.what, where=f"{path}: {e.where}" if e.where else path, expected=e.expected,
                      found=e.found) from None


def cmd_ir_diff(args) -> int:
    from .ir.diff import diff_modules

    d = diff_modules(_read_ir(args.a), _read_ir(args.b))
    sys.stdout.write(d or "no differences\n")
    return 0


def cmd_ir_verify(args) -> int:
    m = _read_ir(args.file)
    print(f"ok: @{m.name}, {len(m.weights)} weights, "
          + ", ".join(f"@{n} {len(f.ops)} ops" for n, f in m.functions.items()))
    return 0


def cmd_ir_bisect(args) -> int:
    from .passes.numerics import bisect

    fe = frontend_of(args, need_weights=True)
    check = numerics_check(args, fe)
    d = bisect(fe.module, pipeline_of(args), check)
    if d is None:
        print(f"no pass breaks numerics (tolerance {check.tol:g}) in: {', '.join(pipeline_of(args))}")
    else:
        print(d.render())
    return 0


def cmd_ir_passes(args) -> int:
    from .passes import PIPELINES
    from .passes.base import load_all

    for name, cls in sorted(load_all().items()):
        doc = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        print(f"{name:<32} {doc[0] if doc else ''}")
    shown = [pipeline_name(t) for t in targets_of(args)] if args.target else list(PIPELINES)
    for name in dict.fromkeys(shown):
        print(f"\npipeline '{name}'{' (default)' if name == 'gpu' else ''}: " + ", ".join(PIPELINES[name]))
    return 0


# ---- compile -----------------------------------------------------------------------------------

def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers", found=text) from None


SMALL_MODEL_PARAMS = 2_000_000_000  # the cpu target comes by default with models up to this size


def cmd_compile(args) -> int:
    from .report import build_report, render_report

    targets = targets_of(args)
    if args.dtype is None:
        # ONNX Runtime's CPU kernels compute in fp32, and the cpu target is the only one an artifact holds
        # until GPU codegen lands; a report of the GPU pipeline defaults to bf16.
        args.dtype = "fp32" if (args.output or targets == ["cpu"]) else "bf16"
    fe = frontend_of(args, need_weights=args.check_numerics)
    if args.output is None or args.report or args.json or args.check_numerics:
        result = run_pipeline(args, fe)
        if args.report or args.json:
            rep = build_report(fe.cfg, fe.module, result)
            if args.json:
                print(json.dumps(rep, indent=1))
            else:
                sys.stdout.write(render_report(rep))
    if args.output:
        from .accounting import account
        from .artifact import Buckets, compile_artifact
        from .passes import CPU_PIPELINE

        if args.start_from:
            raise InputError("an artifact is traced per bucket: --start-from cannot be combined with -o")
        gpu = [t for t in targets if t != "cpu"]
        small = account(fe.cfg).logical_params <= SMALL_MODEL_PARAMS
        if gpu:
            log.warning("GPU targets (%s) are not generated yet (kernel codegen pending): the artifact holds the cpu "
                        "target only", ", ".join(gpu))
        if "cpu" not in targets and not small:
            raise InputError("nothing to write: GPU targets are not generated yet and the cpu target comes by "
                             "default only with small models", expected="--target cpu")
        if args.dtype != "fp32":
            raise InputError("the cpu target computes in fp32", expected="--dtype fp32", found=args.dtype)
        buckets = Buckets(_int_list(args.decode_buckets, "--decode-buckets"),
                          _int_list(args.prefill_buckets, "--prefill-buckets"))
        pipeline = _split_specs(args.passes) if args.passes else list(CPU_PIPELINE)
        compile_artifact(fe, args.output, buckets, pipeline, ("cpu",), tuple(args.disable_pass))
        log.info("wrote %s", args.output)
    return 0


def add_compile_commands(sub) -> None:
    ir = sub.add_parser("ir", help="IR dump and pass debugging")
    irs = ir.add_subparsers(dest="ir_command", required=True)

    d = irs.add_parser("dump", help="print the IR at a stage of the pipeline")
    add_source_flags(d)
    add_pipeline_flags(d)
    d.add_argument("--stage", help="traced, final, program (the launch-level program of the final module), or "
                                   "after:PASS (default: traced, or final when a pipeline flag is given)")
    d.add_argument("--func", dest="function", default="decode", help="decode (default), prefill or all")
    d.add_argument("--format", choices=("text", "dot", "json"), default="text")
    d.add_argument("-o", "--output", help="write to a file instead of stdout")
    d.set_defaults(func=cmd_ir_dump)

    df = irs.add_parser("diff", help="op-level difference of two IR files")
    df.add_argument("a", metavar="A.ir")
    df.add_argument("b", metavar="B.ir")
    df.set_defaults(func=cmd_ir_diff)

    v = irs.add_parser("verify", help="parse and verify an IR file")
    v.add_argument("file", metavar="FILE.ir")
    v.set_defaults(func=cmd_ir_verify)

    b = irs.add_parser("bisect", help="find the first pass, and op, that breaks numerics")
    add_source_flags(b)
    add_pipeline_flags(b)
    b.set_defaults(func=cmd_ir_bisect)

    ps = irs.add_parser("passes", help="list the registered passes and each target's pipeline")
    ps.add_argument("--target", default=None, help="show only this target's pipeline (gpu, gfx950, sm_90a, cpu)")
    ps.set_defaults(func=cmd_ir_passes)

    c = sub.add_parser("compile", help="run the compiler pipeline (and report)")
    add_source_flags(c, numerics="official", dtype=None)  # deployment defaults (dtype: by target)
    add_pipeline_flags(c)
    c.add_argument("--report", action="store_true", help="print launches, pass hits, arena and KV bytes")
    c.add_argument("--json", action="store_true", help="the report as JSON")
    c.add_argument("-o", "--output", help="write the artifact directory (manifest, weights, onnx/, module.ir, report)")
    c.add_argument("--decode-buckets", default="1,2,4,8", help="decode batch buckets (default 1,2,4,8)")
    c.add_argument("--prefill-buckets", default="16,64", help="prefill chunk buckets, batch 1 (default 16,64)")
    c.set_defaults(func=cmd_compile)
