"""`v4compile ir ...` (IR dump and pass debugging) and `v4compile compile ...`.

Shared by both: the model source (CHECKPOINT or --preset), the trace knobs (--batch, --chunk,
--decode-batch, --max-context, --numerics, --dtype, --weights) and the pipeline flags
(--passes, --print-ir-after-all, --print-ir-after-change, --print-ir-after PASS, --dump-ir DIR,
--verify-each, --disable-pass PASS, --stop-after PASS, --start-from FILE.ir, --time-passes,
--check-numerics).

What the user sees: one `info:` line with the settings in use (compile and ir have different defaults:
deployment vs debugging), one line per file written (path, size, what was checked), progress for
stages over ~2 s, and with `--check-numerics` a table whose last line says whether every pass is within
tolerance; a broken tolerance exits with status 1 and prints the `ir bisect` command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path

from .artifact import GPU_TARGETS
from .errors import InputError, IRError, PassError, V4Error
from .timing import Stages

log = logging.getLogger("v4compile")

# Module attributes a `--start-from` dump must share with the module the command line traces.
TRACE_ATTRS = ("config", "batch", "chunk", "decode_batch", "capacity", "numerics", "dtype", "weights")


def _ints():
    from .cli import INT64_MAX, float_arg, int_arg
    return INT64_MAX, int_arg, float_arg

_T0 = time.perf_counter()  # the command's start (this module is imported while parsing arguments)
NUMERICS_FAILED = 1  # exit status of a check that found a broken tolerance (bad input is 2)
MAX_DEFAULT_THREADS = 4


def default_threads() -> int:
    """min(4, the cores this process may use, minus the ones other processes keep busy), at least 1.
    Torch's default (every core) oversubscribes a shared machine: two such processes on 2 cores took
    3 minutes for a 9 s compile; one thread each, 19 s."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(MAX_DEFAULT_THREADS, cores, cores - busy))


MAX_THREADS = 256  # the same bound as the API's (runtime/session.py)


def threads_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, found {text[:40]!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_THREADS}], found {text[:40]}")
    return n


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="CPU threads for torch (default: min(4, free cores), at least 1; "
                        "the count can change the last bits of results)")


def apply_threads(args) -> int:
    import torch

    n = args.threads or default_threads()
    torch.set_num_threads(n)
    args._threads = n  # recorded in the compile report: the count can change the last bits of results
    return n


def _tolerance(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, found {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, found {text}")
    return v


def add_source_flags(p: argparse.ArgumentParser, numerics: str = "hf", dtype: str | None = "fp32") -> None:
    int64_max, int_arg, _ = _ints()
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", help="checkpoint directory or .safetensors file")
    p.add_argument("--preset", help="tiny (default), tiny-pro, v4-flash, v4-pro")
    p.add_argument("--weights", choices=("none", "random", "checkpoint"),
                   help="none: shape-only, weights typed as released (FP8/FP4); random: seeded random weights "
                        "(preset default); checkpoint: the checkpoint's (default with CHECKPOINT)")
    p.add_argument("--seed", type=int_arg(0, int64_max), default=0,
                   help="seed of random weights and of the numerics scenario")
    p.add_argument("--allow-nonfinite", action="store_true", help="load NaN / Inf weights instead of refusing them")
    g = p.add_argument_group("trace")
    g.add_argument("--batch", type=int_arg(1, 1024), default=2, help="prefill batch (sequences per prefill call)")
    g.add_argument("--chunk", type=int_arg(1, 1 << 16), default=16,
                   help="prefill chunk (tokens per sequence per call)")
    g.add_argument("--decode-batch", type=int_arg(1, 1024), default=2, help="decode batch")
    g.add_argument("--max-context", type=int_arg(1, 1 << 22), default=256,
                   help="max tokens per sequence (sizes the caches)")
    g.add_argument("--numerics", choices=("hf", "official"), default=numerics,
                   help=f"hf: match transformers; official: + the QAT roundings (default {numerics})")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default=dtype,
                   help=f"compute dtype (default {dtype or 'fp32 for an artifact (cpu target), else bf16'})")
    add_threads_flag(p)


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    _, int_arg, _ = _ints()
    g = p.add_argument_group("pipeline")
    g.add_argument("--passes", help="comma-separated pass specs (name or name{k=v,...}); default: the target's pipeline")
    g.add_argument("--target", default=None,
                   help="what to compile for, comma-separated: gfx950, sm_90a (or gpu: both; their pipeline runs to "
                        "the program) and cpu (the ONNX path's pipeline); default gpu, and with -o also cpu for a "
                        "model of up to 2 B parameters with weights")
    g.add_argument("--tp", type=int_arg(1, 1 << 12), default=1,
                   help="tensor parallel ranks: attention heads split over them (runs partition{tp,ep} first)")
    g.add_argument("--ep", type=int_arg(1, 1 << 14), default=1,
                   help="expert parallel ranks: routed experts split over them; the world is max(tp, ep) ranks")
    g.add_argument("--print-ir-after-all", action="store_true")
    g.add_argument("--print-ir-after-change", action="store_true")
    g.add_argument("--print-ir-after", action="append", default=[], metavar="PASS")
    g.add_argument("--dump-ir", metavar="DIR", help="write NN-<pass>.ir after every pass (00-traced.ir first)")
    g.add_argument("--verify-each", action="store_true", help="run the verifier after every pass")
    g.add_argument("--disable-pass", action="append", default=[], metavar="PASS")
    g.add_argument("--stop-after", metavar="PASS")
    g.add_argument("--start-from", metavar="FILE.ir",
                   help="resume from a dumped module, after the passes it records having run (attribute passes_run)")
    g.add_argument("--time-passes", action="store_true",
                   help="time every stage (tracing, each pass, change detection, checks, output) against the wall clock")
    g.add_argument("--check-numerics", action="store_true",
                   help="after each pass, interpret the module on a seeded scenario against ReferenceModel")
    g.add_argument("--tol", type=_tolerance, default=1e-5,
                   help="numerics tolerance: max |logit error| relative to the largest reference logit (default 1e-5)")
    g.add_argument("--check-prompt-len", type=int_arg(1, 1 << 20), default=100)
    g.add_argument("--check-steps", type=int_arg(0, 1 << 20), default=32, help="decode steps of the numerics scenario")


def _split_specs(text: str) -> list[str]:
    """Split `a,b{x=1,y=2},c` at top-level commas; braces must balance and not nest."""
    out, depth, cur = [], 0, ""
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
            if depth > 1:
                raise PassError("nested '{' in --passes", where=f"--passes column {i + 1}", found=text[:80])
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise PassError("unbalanced '}' in --passes", where=f"--passes column {i + 1}", found=text[:80])
        if ch == "," and depth == 0:
            if not cur.strip():
                raise PassError("empty pass name in --passes", where=f"--passes column {i + 1}", found=text[:80])
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if depth:
        raise PassError("unclosed '{' in --passes", found=text[:80])
    if cur.strip():
        out.append(cur.strip())
    elif out:
        raise PassError("--passes ends with ','", found=text[:80])
    return out


def targets_of(args) -> list[str]:
    """The requested targets, `gpu` expanded to every GPU target; an unknown name is an error."""
    out: list[str] = []
    for t in (x.strip() for x in str(getattr(args, "target", None) or "gpu").split(",")):
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

    passes = _split_specs(args.passes) if args.passes else list(PIPELINES[pipeline_name(targets_of(args)[0])])
    tp, ep = getattr(args, "tp", 1), getattr(args, "ep", 1)
    if tp > 1 or ep > 1:
        if not args.passes and pipeline_name(targets_of(args)[0]) == "gpu":
            # The program stage has no collective launches yet (nor the C runtime a collective entry): a
            # partitioned module goes down the gpu pipeline to its memory plan (reports), not to a program.
            passes = [p for p in passes if p != "lower_to_program"]
        if any(p.split("{", 1)[0].strip() == "partition" for p in passes):
            raise InputError("--tp / --ep add the partition pass; --passes names it too", found=args.passes)
        passes.insert(0, f"partition{{tp={tp},ep={ep}}}")
    return passes


def trace_options(args):
    from .trace import TraceOptions

    return TraceOptions(batch=args.batch, chunk=args.chunk, decode_batch=args.decode_batch, capacity=args.max_context,
                        numerics=args.numerics, dtype=args.dtype)


def stages_of(args) -> Stages:
    """The command's stage timer (one per command, kept on its arguments)."""
    st = getattr(args, "_stages", None)
    if st is None:
        st = args._stages = Stages()
    return st


def _too_big_for_random_weights(name: str) -> bool:
    from .accounting import account
    from .cli import MAX_RANDOM_PARAMS
    from .config import preset

    return account(preset(name)).logical_params > MAX_RANDOM_PARAMS


def frontend_of(args, need_weights: bool = False, shape_only_default: bool = False, announce: str | None = None):
    """Trace the model the user named. `shape_only_default`: a preset too large for random weights gets
    `--weights none` unless weights were asked for (with a note). `announce`: the command's name, for
    the info line that states the settings in use."""
    from . import frontend

    if args.checkpoint and args.preset:
        raise InputError("give either CHECKPOINT or --preset, not both")
    weights = args.weights
    if need_weights and weights == "none":
        raise InputError("numerics checks need weights", expected="--weights random or a checkpoint")
    if (weights is None and shape_only_default and not need_weights and not args.checkpoint
            and _too_big_for_random_weights(args.preset or "tiny")):
        weights = "none"
        log.info("%s: shape-only weights (as --weights none): random weights for a model this size would not fit in "
                 "memory", args.preset)
    threads = apply_threads(args)
    if announce:
        src = f"checkpoint {args.checkpoint}" if args.checkpoint else f"preset {args.preset or 'tiny'}"
        w = weights or ("checkpoint" if args.checkpoint else "random")
        passes = "--passes " + args.passes if args.passes else "the default pipeline"
        log.info("%s: %s (weights %s, seed %d), numerics %s, dtype %s, batch %d, chunk %d, decode batch %d, "
                 "max context %d, %s, threads %d", announce, src, w, args.seed, args.numerics, args.dtype, args.batch,
                 args.chunk, args.decode_batch, args.max_context, passes, threads)
    with stages_of(args)("trace", progress="tracing"):
        return frontend.load(args.checkpoint, args.preset, weights, trace_options(args), seed=args.seed,
                             allow_nonfinite=getattr(args, "allow_nonfinite", False))


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
    with stages_of(args)("reference model on the numerics scenario", progress="running the reference model"):
        return NumericsCheck(fe.reference(), fe.source, sc, args.chunk, args.tol, capacity=args.max_context)


def bisect_command(args, passes: list[str], dtype: str) -> str:
    """The `ir bisect` command line that reproduces a numerics check: every setting that matters."""
    cmd = ["v4compile", "ir", "bisect"]
    cmd += [args.checkpoint] if args.checkpoint else ["--preset", args.preset or "tiny"]
    if args.weights:
        cmd += ["--weights", args.weights]
    cmd += ["--seed", str(args.seed), "--numerics", args.numerics, "--dtype", dtype, "--batch", str(args.batch),
            "--chunk", str(args.chunk), "--decode-batch", str(args.decode_batch), "--max-context", str(args.max_context),
            "--tol", f"{args.tol:g}", "--check-prompt-len", str(args.check_prompt_len), "--check-steps",
            str(args.check_steps), "--passes", ",".join(passes)]
    return " ".join(shlex.quote(c) for c in cmd)


class NumericsOutcome:
    """What a `--check-numerics` run found: ok, or the failing pass and the command to bisect it."""

    def __init__(self, ok: bool, summary: str):
        self.ok = ok
        self.summary = summary


def run_pipeline(args, fe, module=None):
    """Run the pipeline with the instruments the flags ask for. Returns (RunResult, NumericsOutcome or None)."""
    from .passes import PassManager, PipelineOptions
    from .passes.manager import passes_run

    st = stages_of(args)
    if args.start_from:
        with st("read --start-from"):
            module = _read_ir(args.start_from)
            _check_same_trace(module, fe.module, args.start_from)
    module = module or fe.module
    check = outcome = None
    if args.check_numerics and args.dtype != "fp32":
        outcome = _check_fp32_shadow(args)
    elif args.check_numerics:
        check = numerics_check(args, fe)
    opts = PipelineOptions(print_after_all=args.print_ir_after_all, print_after_change=args.print_ir_after_change,
                           print_after=tuple(args.print_ir_after), dump_ir=args.dump_ir, verify_each=args.verify_each,
                           disable=tuple(args.disable_pass), stop_after=args.stop_after, check_numerics=check,
                           stages=st)
    try:
        history = passes_run(module)
        result = PassManager(pipeline_of(args), opts).run(module)
    except V4Error as e:
        if not args.start_from:
            raise
        raise type(e)(e.what, where=f"{args.start_from}: {e.where}" if e.where else args.start_from,
                      expected=e.expected, found=e.found) from None
    for path in opts.dump_written:
        log.info("wrote %s (%s bytes)", path, f"{path.stat().st_size:,}")
    if args.verify_each:
        log.info("verified the IR before the pipeline and after each of its %d passes", len(result.records))
    if check is not None:
        ran = list(history) + [r.spec for r in result.records]
        outcome = _report_numerics(args, result, check, ran, len(history), args.dtype)
    return result, outcome


def _check_fp32_shadow(args) -> NumericsOutcome:
    """bf16 rounding differences flip discrete choices (indexer / router top-k) on random weights, so
    logit comparisons in bf16 say nothing about a pass. The passes are dtype-independent rewrites: check
    the same pipeline on an fp32 trace of the same model instead."""
    import copy

    from .passes import PassManager, PipelineOptions

    shadow = copy.copy(args)
    shadow.dtype = "fp32"
    if args.start_from:
        raise InputError("--check-numerics with --start-from needs --dtype fp32 (the dump is the module to check)")
    log.info("--check-numerics checks the passes on an fp32 trace of the same model and pipeline: in %s, rounding "
             "flips the indexer's and router's top-k choices on random weights, so %s logits cannot tell a broken "
             "pass from a flipped choice (the passes do not depend on the dtype)", args.dtype, args.dtype)
    fe = frontend_of(shadow, need_weights=True)
    check = numerics_check(shadow, fe)
    result = PassManager(pipeline_of(args), PipelineOptions(disable=tuple(args.disable_pass),
                                                            stop_after=args.stop_after, check_numerics=check,
                                                            stages=stages_of(args))).run(fe.module)
    return _report_numerics(args, result, check, [r.spec for r in result.records], 0, "fp32", "fp32 shadow")


def _report_numerics(args, result, check, ran: list[str], before: int, dtype: str, what: str = "") -> NumericsOutcome:
    from .passes.numerics import ERROR_UNIT

    tol = check.tol
    o = sys.stderr
    o.write(f"// ----- numerics{' (' + what + ')' if what else ''}: error = {ERROR_UNIT} (max |reference logit| "
            f"{check.scale:.3g}); tolerance {tol:g} -----\n")
    if result.traced_error is not None:
        o.write(f"  {'input' if before else 'traced':<40} {result.traced_error:.3g}\n")
    for r in result.records:
        flag = "  <-- breaks tolerance" if r.numerics_error is not None and r.numerics_error > tol else ""
        o.write(f"  {r.spec:<40} {r.numerics_error:.3g}{flag}\n")
    bad = result.first_numerics_failure(tol)
    if result.traced_error is not None and result.traced_error > tol:
        o.write("  the module before the passes already breaks tolerance\n")
        return NumericsOutcome(False, f"the module before the passes breaks the tolerance {tol:g} "
                                      f"(error {result.traced_error:.3g})")
    if bad is None:
        o.write("  every pass within tolerance\n")
        return NumericsOutcome(True, "")
    upto = ran[: before + result.records.index(bad) + 1]
    o.write(f"  first pass that breaks tolerance: {bad.spec}; to find the op, run:\n"
            f"    {bisect_command(args, upto, dtype)}\n")
    return NumericsOutcome(False, f"pass {bad.spec} breaks the tolerance {tol:g} (error {bad.numerics_error:.3g})")


def _finish(args, outcome) -> int:
    """The command's last lines: --time-passes, then the numerics verdict (exit status 1 if broken)."""
    if args.time_passes:
        from .timing import process_seconds

        wall = process_seconds()
        sys.stderr.write(stages_of(args).render(wall if wall is not None else time.perf_counter() - _T0))
    if outcome is not None and not outcome.ok:
        print(f"error: numerics check failed: {outcome.summary}", file=sys.stderr)
        return NUMERICS_FAILED
    return 0


def _check_same_trace(loaded, traced, path: str) -> None:
    """A resumed module must come from the trace the command line asks for (same model, shapes, numerics)."""
    for k in TRACE_ATTRS:
        if k in traced.attrs and loaded.attrs.get(k) != traced.attrs[k]:
            raise IRError(f"--start-from module was traced with another `{k}` than this command line asks for",
                          where=path, expected=traced.attrs[k], found=loaded.attrs.get(k, "absent"))
    for name, fn in traced.functions.items():
        got = loaded.functions.get(name)
        if got is None or [v.type for v in got.inputs] != [v.type for v in fn.inputs]:
            raise IRError(f"--start-from module's @{name} inputs differ from this command line's trace", where=path,
                          expected=", ".join(str(v.type) for v in fn.inputs),
                          found="absent" if got is None else ", ".join(str(v.type) for v in got.inputs))


def _check_outputs(args) -> None:
    """Output paths are checked before any work starts."""
    from .files import check_output_dir, check_output_file

    if getattr(args, "dump_ir", None):
        check_output_dir(args.dump_ir, InputError, force=True, what="--dump-ir directory")
    out = getattr(args, "output", None)
    if out and args.func is cmd_compile:
        if Path(out).is_symlink():  # replacing it would replace the link, not the directory it names
            raise InputError("-o output directory is a symlink", where=out, expected="the directory it points to")
        ckpt = getattr(args, "checkpoint", None)
        if ckpt:
            o, c = Path(out).resolve(), Path(ckpt).resolve()
            if o == c or o in c.parents:
                raise InputError("-o would replace the input checkpoint", where=out,
                                 expected="an output directory apart from the checkpoint", found=str(c))
        check_output_dir(out, InputError, force=args.force, what="-o output directory")
    elif out:
        check_output_file(out, InputError, what="-o output file")


def _write(path: Path, text: str, what: str, check_ir: bool = False, shown: Path | None = None,
           check_program: bool = False) -> None:
    """Write one artifact atomically and say so (path, size, what was checked)."""
    from .files import write_text_atomic

    write_text_atomic(path, text)
    checked = ""
    if check_ir:
        from .ir.text import parse_module
        from .ir.verify import verify

        verify(parse_module(text))
        checked = "; parses back and verifies"
    if check_program:
        from .program.text import parse_program
        from .program.verify import verify_program

        verify_program(parse_program(text))
        checked = "; parses back and verifies"
    log.info("wrote %s (%s bytes, %s%s)", shown or path, f"{path.stat().st_size:,}", what, checked)


# ---- ir ----------------------------------------------------------------------------------------

def cmd_ir_dump(args) -> int:
    from .ir.export import to_dot, to_json
    from .ir.text import print_module

    _check_outputs(args)
    fe = frontend_of(args, need_weights=args.check_numerics, shape_only_default=True, announce="ir dump")
    stage = args.stage or ("final" if _pipeline_flags_given(args) else "traced")
    outcome = None
    if stage == "traced" and not args.start_from:
        module = fe.module
    else:
        if stage.startswith("after:"):
            args.stop_after = stage.split(":", 1)[1]
        elif stage not in ("final", "program", "traced"):
            raise InputError("unknown --stage", expected="traced, final, program or after:PASS", found=stage)
        result, outcome = run_pipeline(args, fe)
        module = result.module
    funcs = None if args.function == "all" else [args.function]
    if funcs and funcs[0] not in module.functions:
        raise InputError(f"no function @{funcs[0]}", expected=", ".join(module.functions))
    st = stages_of(args)
    with st("print IR"):
        if stage == "program":
            from .program.build import build_program
            from .program.text import print_program
            from .program.verify import verify_program

            if args.format != "text":
                raise InputError("the program prints as text only", found=f"--format {args.format}")
            text = print_program(verify_program(build_program(module)), funcs)
        elif args.format == "text":
            weights = "none" if args.no_weights else ("last" if args.functions_first else "first")
            text = print_module(module, funcs, weights=weights)
        elif args.format == "json":
            text = to_json(module, funcs)
        else:
            text = "".join(to_dot(module.functions[f]) for f in (funcs or list(module.functions)))
    if args.output:
        with st("write output"):
            parses = args.format == "text" and not args.no_weights and not args.functions_first
            what = f"{'program' if stage == 'program' else args.format}, " \
                   f"{'all functions' if funcs is None else '@' + funcs[0]}"
            _write(Path(args.output), text, what, check_ir=parses and stage != "program",
                   check_program=stage == "program")
    else:
        sys.stdout.write(text)
    return _finish(args, outcome)


def _pipeline_flags_given(args) -> bool:
    return bool(args.passes or args.print_ir_after_all or args.print_ir_after_change or args.print_ir_after
                or args.dump_ir or args.verify_each or args.disable_pass or args.stop_after or args.start_from
                or args.time_passes or args.check_numerics)


def _read_ir(path: str):
    from .files import read_text
    from .ir.text import parse_module
    from .ir.verify import verify

    text = read_text(path, IRError, "IR file")
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
    from .passes.numerics import ERROR_UNIT, bisect

    unused = [flag for flag, given in (("--dump-ir", args.dump_ir), ("--start-from", args.start_from),
                                       ("--print-ir-after-all", args.print_ir_after_all),
                                       ("--print-ir-after-change", args.print_ir_after_change),
                                       ("--print-ir-after", args.print_ir_after), ("--stop-after", args.stop_after),
                                       ("--verify-each", args.verify_each)) if given]
    if unused:
        raise InputError(f"ir bisect does not take {', '.join(unused)}", expected="ir dump or compile for those")
    _check_outputs(args)
    fe = frontend_of(args, need_weights=True, announce="ir bisect")
    check = numerics_check(args, fe)
    pipeline = [p for p in pipeline_of(args) if p.split("{", 1)[0].strip() not in args.disable_pass]
    with stages_of(args)("bisect", progress="bisecting"):
        d = bisect(fe.module, pipeline, check)
    if d is None:
        print(f"no pass breaks numerics (tolerance {check.tol:g}; error = {ERROR_UNIT}) in: {', '.join(pipeline)}")
        return _finish(args, None)
    print(d.render())
    return _finish(args, NumericsOutcome(False, f"pass {d.pass_name} breaks the tolerance {check.tol:g} "
                                                f"(error {d.pass_error:.3g})"))


def pass_summary(cls) -> str:
    """The first sentence of a pass's module docstring (its one-line summary)."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    para = " ".join(doc.split("\n\n", 1)[0].split())
    for stop in (". ", ": "):
        if stop in para:
            para = para.split(stop, 1)[0] + "."
            break
    return para


def cmd_ir_passes(args) -> int:
    from .errors import PassError
    from .passes import PIPELINES
    from .passes.base import load_all

    passes = load_all()
    if args.name:
        if args.name not in passes:
            raise PassError(f"unknown pass '{args.name}'", expected=", ".join(sorted(passes)))
        cls = passes[args.name]
        print(f"{args.name}\n\n{(sys.modules[cls.__module__].__doc__ or '').strip()}")
        import dataclasses
        opts = [f"{f.name} = {f.default!r}" for f in dataclasses.fields(cls)]
        print("\noptions: " + (", ".join(opts) if opts else "none"))
        return 0
    for name, cls in sorted(passes.items()):
        print(f"{name:<32} {pass_summary(cls)}")
    shown = [pipeline_name(t) for t in targets_of(args)] if args.target else list(PIPELINES)
    for name in dict.fromkeys(shown):
        print(f"\npipeline '{name}'{' (default)' if name == 'gpu' else ''}: " + ", ".join(PIPELINES[name]))
    print("\n`v4compile ir passes NAME` prints a pass's requirements, guarantees and options.")
    return 0


# ---- compile -----------------------------------------------------------------------------------

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
    from .artifact import Buckets, gpu_default_buckets

    buckets = Buckets(_int_list(args.decode_buckets, "--decode-buckets"),
                      _int_list(args.prefill_buckets, "--prefill-buckets"))
    buckets.validate()
    gpu_buckets = gpu_default_buckets(buckets)
    if args.gpu_decode_buckets or args.gpu_prefill_buckets:
        gpu_buckets = Buckets(_int_list(args.gpu_decode_buckets, "--gpu-decode-buckets") if args.gpu_decode_buckets
                              else gpu_buckets.decode,
                              _int_list(args.gpu_prefill_buckets, "--gpu-prefill-buckets") if args.gpu_prefill_buckets
                              else gpu_buckets.prefill)
        gpu_buckets.validate()
    return buckets, gpu_buckets


SMALL_MODEL_PARAMS = 2_000_000_000  # the cpu target comes by default with models up to this size


def cmd_compile(args) -> int:
    from .report import build_report, render_report

    _check_outputs(args)
    targets = targets_of(args)
    if args.output:
        _buckets_of(args)  # before any work
        targets = artifact_targets(args, targets)
        if args.tp > 1 or args.ep > 1:
            # Built so far: the per-rank weights (artifact.write_rank_weights), the manifest's layout, the ONNX
            # segments (codegen/onnx_segments.py) and gloo between them (runtime/distributed.py); missing: the
            # segments in the artifact and its cpu backend, `run` under torchrun, the GPU program's collective
            # launches. Refused before any work rather than failing after the weights.
            raise InputError("-o with --tp / --ep: a partitioned artifact cannot be written yet (the artifact "
                             "does not carry the ONNX segments, nor the GPU program collective launches)",
                             expected="--report / --check-numerics with --tp / --ep, or -o without them")
    if args.dtype is None:
        # ONNX Runtime's CPU kernels compute in fp32; GPU targets alone default to bf16.
        args.dtype = "fp32" if "cpu" in targets else "bf16"
    fe = frontend_of(args, need_weights=args.check_numerics, shape_only_default=bool(args.output) and "cpu" not in targets,
                     announce="compile")
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
    if args.json:
        print(json.dumps(rep, indent=1))
    elif args.report:
        sys.stdout.write(render_report(rep))
        if rep.get("parallel"):
            from .codegen.parallel_model import render_parallel

            sys.stdout.write(render_parallel(rep["parallel"]))
    if args.output:
        with st("write output", progress="writing the artifact"):
            _write_artifact(args, fe, targets)
    if not (args.output or args.report or args.json or args.dump_ir):
        log.info("compiled %s: %d passes, nothing written (use -o DIR, --report or --dump-ir)", result.module.name,
                 len(result.records))
    return _finish(args, outcome)


def _parallel_report(args, fe, result, targets) -> dict | None:
    """The report's "parallel" entry of a partitioned compile (codegen/parallel_model.py)."""
    from .parallel import ParallelLayout

    if ParallelLayout.of(result.module) is None or "decode" not in result.module.functions:
        return None
    from .codegen.parallel_model import parallel_section
    from .passes.base import get_pass

    partitioned = get_pass("partition", {"tp": args.tp, "ep": args.ep}).run(fe.module).module
    return parallel_section(fe.cfg, fe.module, partitioned, result.module, tuple(t for t in targets if t != "cpu")
                            or ("gfx950", "sm_90a"))


def _config_only(args):
    """The config of the model named (preset or checkpoint directory), without tracing it."""
    from .config import V4Config, preset

    if args.checkpoint:
        return V4Config.from_dir(args.checkpoint)
    return preset(args.preset or "tiny")


def artifact_targets(args, targets: list[str]) -> list[str]:
    """What `-o` writes: the requested targets, plus, unless --target was given, the cpu target for a
    small model with weights (so that its artifact runs on any machine)."""
    from .accounting import account

    out = list(targets)
    if (args.target is not None or "cpu" in out or args.weights == "none"
            or account(_config_only(args)).logical_params > SMALL_MODEL_PARAMS):
        return out
    if args.checkpoint:
        from .checkpoint import Checkpoint

        if set(Checkpoint.open(args.checkpoint).stored_formats().values()) - {"dense"}:
            log.info("compile: the cpu target is left out: its ONNX lowering has no FP8 / FP4 weights yet")
            return out
    return out + ["cpu"]


def _write_artifact(args, fe, targets) -> None:
    """The artifact directory (v4compile/artifact.py): every target's pipeline, traced per bucket."""
    from .artifact import compile_artifact
    from .passes import CPU_PIPELINE, GPU_PIPELINE

    if args.start_from:
        raise InputError("an artifact is traced per bucket: --start-from cannot be combined with -o")
    if "cpu" in targets and args.dtype != "fp32":
        raise InputError("the cpu target computes in fp32", expected="--dtype fp32 (or --target gfx950,sm_90a)",
                         found=args.dtype)
    if "cpu" in targets and fe.source is None:
        raise InputError("the cpu target needs weights", expected="--weights random (presets), a checkpoint, or "
                                                                  "--target gfx950,sm_90a for a shape-only artifact")
    gpu = [t for t in targets if t != "cpu"]
    cpu_pipeline, gpu_pipeline = list(CPU_PIPELINE), list(GPU_PIPELINE)
    if args.tp > 1 or args.ep > 1:
        cpu_pipeline.insert(0, f"partition{{tp={args.tp},ep={args.ep}}}")
    if args.passes:
        if gpu and "cpu" in targets:
            raise InputError("--passes with -o names one pipeline: give either GPU targets or cpu", found=targets)
        if gpu:
            gpu_pipeline = _split_specs(args.passes)
        else:
            cpu_pipeline = _split_specs(args.passes)
    buckets, gpu_buckets = _buckets_of(args)
    compile_artifact(fe, args.output, buckets, cpu_pipeline, tuple(targets), tuple(args.disable_pass),
                     force=args.force, gpu_pipeline=gpu_pipeline, jobs=args.jobs, gpu_buckets=gpu_buckets)


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
    d.add_argument("--no-weights", action="store_true",
                   help="leave out the weight declarations (a view: the text then does not parse back)")
    d.add_argument("--functions-first", action="store_true",
                   help="print the functions before the weight declarations (a view: does not parse back)")
    d.set_defaults(func=cmd_ir_dump)

    df = irs.add_parser("diff", help="op-level difference of two IR files")
    df.add_argument("a", metavar="A.ir")
    df.add_argument("b", metavar="B.ir")
    df.set_defaults(func=cmd_ir_diff)

    v = irs.add_parser("verify", help="parse and verify an IR file")
    v.add_argument("file", metavar="FILE.ir")
    v.set_defaults(func=cmd_ir_verify)

    b = irs.add_parser("bisect", help="find the first pass, and the op in each function, that breaks numerics "
                                      "(exit status 1 when one does)")
    add_source_flags(b)
    add_pipeline_flags(b)
    b.set_defaults(func=cmd_ir_bisect)

    ps = irs.add_parser("passes", help="list the registered passes and each target's pipeline; with NAME, one "
                                       "pass in full")
    ps.add_argument("name", nargs="?", metavar="NAME", help="a pass: print its requirements, guarantees and options")
    ps.add_argument("--target", default=None, help="show only this target's pipeline (gpu, gfx950, sm_90a, cpu)")
    ps.set_defaults(func=cmd_ir_passes)

    c = sub.add_parser("compile", help="run the compiler pipeline (and report)")
    add_source_flags(c, numerics="official", dtype=None)  # deployment defaults (dtype: by target)
    add_pipeline_flags(c)
    c.add_argument("--report", action="store_true", help="print launches, pass hits, arena and KV bytes")
    c.add_argument("--json", action="store_true", help="the report as JSON")
    c.add_argument("-o", "--output", help="write the artifact directory (manifest, weights, onnx/, module.ir, report)")
    c.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    c.add_argument("--decode-buckets", default="1,2,4,8", help="decode batch buckets (default 1,2,4,8)")
    c.add_argument("--prefill-buckets", default="16,64", help="prefill chunk buckets, batch 1 (default 16,64)")
    c.add_argument("--gpu-decode-buckets", default=None,
                   help="decode batch buckets of the GPU targets (default: the largest --decode-buckets; smaller "
                        "batches run padded)")
    c.add_argument("--gpu-prefill-buckets", default=None,
                   help="prefill chunk buckets of the GPU targets (default: the largest --prefill-buckets)")
    c.add_argument("--jobs", type=threads_arg, default=None,
                   help="worker processes compiling kernels ahead of time (default: the CPU count; same output)")
    c.set_defaults(func=cmd_compile)
