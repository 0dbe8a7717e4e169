"""What `v4compile ir ...` and `v4compile compile` share: the model traced from the command line, the
pipeline run with the instruments its flags ask for, the numerics check and its verdict, outputs checked
before any work and written atomically.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path

from ..errors import InputError, IRError, V4Error
from ..targets import GPU_TARGET_NAMES, GPU_TARGETS
from ..timing import Stages
from .args import MAX_RANDOM_PARAMS, apply_threads, split_specs

log = logging.getLogger("v4compile")

# Module attributes a `--start-from` dump must share with the module the command line traces.
TRACE_ATTRS = ("config", "batch", "chunk", "decode_batch", "capacity", "numerics", "dtype", "weights")

_T0 = time.perf_counter()  # the command's start (this module is imported while parsing arguments)
NUMERICS_FAILED = 1  # exit status of a check that found a broken tolerance (bad input is 2)


def targets_of(args) -> list[str]:
    """The requested targets, `gpu` expanded to every GPU target; an unknown name is an error."""
    out: list[str] = []
    for t in (x.strip() for x in str(getattr(args, "target", None) or "gpu").split(",")):
        names = list(GPU_TARGETS) if t == "gpu" else [t]
        for n in names:
            if n not in (*GPU_TARGETS, "cpu"):
                raise InputError("unknown --target", expected=f"{GPU_TARGET_NAMES}, gpu or cpu", found=t)
            if n not in out:
                out.append(n)
    if not out:
        raise InputError("--target names no target", expected=f"{GPU_TARGET_NAMES}, gpu or cpu")
    return out


def pipeline_name(target: str) -> str:
    return "cpu" if target == "cpu" else "gpu"


def pipeline_of(args) -> list[str]:
    from ..passes import PIPELINES

    passes = split_specs(args.passes) if args.passes else list(PIPELINES[pipeline_name(targets_of(args)[0])])
    passes = allreduce_choice(args, passes)
    spec = partition_spec(args)
    if spec is not None:
        if any(p.split("{", 1)[0].strip() == "partition" for p in passes):
            raise InputError("--tp / --ep / --dp add the partition pass; --passes names it too", found=args.passes)
        passes.insert(0, spec)
    return passes


def allreduce_choice(args, passes: list[str]) -> list[str]:
    """The pipeline without `oneshot_allreduce` under `--allreduce nccl` (the all-reduces and the rows collectives stay
    on NCCL / RCCL; `fuse_oneshot_rows` / `_producer` / `_consumer` then find nothing to fold); a command without the
    option keeps the pipeline as it is (the option's default is in `cli/args.py`)."""
    if getattr(args, "allreduce", None) != "nccl":
        return passes
    return [p for p in passes if p.split("{", 1)[0].strip() != "oneshot_allreduce"]


def partition_spec(args) -> str | None:
    """The partition pass that --tp / --ep / --dp ask for (None: none); `dp` named only when > 1."""
    tp, ep, dp = getattr(args, "tp", 1), getattr(args, "ep", 1), getattr(args, "dp", 1)
    if tp == 1 and ep == 1 and dp == 1:
        return None
    return f"partition{{tp={tp},ep={ep}" + (f",dp={dp}}}" if dp > 1 else "}")


def trace_options(args):
    from ..trace import TraceOptions

    return TraceOptions(batch=args.batch, chunk=args.chunk, decode_batch=args.decode_batch, capacity=args.max_context,
                        numerics=args.numerics, dtype=args.dtype,
                        draft_sinkhorn_iters=getattr(args, "draft_sinkhorn_iters", 0))


def stages_of(args) -> Stages:
    """The command's stage timer (one per command, kept on its arguments)."""
    st = getattr(args, "_stages", None)
    if st is None:
        st = args._stages = Stages()
    return st


def _too_big_for_random_weights(name: str) -> bool:
    from ..accounting import account
    from ..config import preset

    return account(preset(name)).logical_params > MAX_RANDOM_PARAMS


def frontend_of(args, need_weights: bool = False, shape_only_default: bool = False, announce: str | None = None,
                trace: bool = True):
    """The model the user named, traced unless `trace` is false (`compile -o` traces per bucket instead).
    `shape_only_default`: a preset too large for random weights gets `--weights none` unless weights were
    asked for (with a note). `announce`: the command's name, for the info line that states the settings in
    use."""
    from .. import frontend

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
        fe = frontend.load(args.checkpoint, args.preset, weights, trace_options(args), seed=args.seed,
                           allow_nonfinite=getattr(args, "allow_nonfinite", False))
        if trace:
            fe.module  # noqa: B018 (traced here, inside the stage)
    return fe


def numerics_check(args, fe):
    from ..harness import Scenario
    from ..passes.numerics import NumericsCheck

    if args.decode_batch != args.batch:
        raise InputError("--check-numerics carries caches from prefill to decode: --batch must equal --decode-batch",
                         found=(args.batch, args.decode_batch))
    if args.check_prompt_len + args.check_steps > args.max_context:
        raise InputError("the numerics scenario does not fit the max context",
                         expected=f"--check-prompt-len + --check-steps <= {args.max_context}")
    # data parallel: --batch sequences on each replica (`harness.DPRunner`), the reference on all of them
    sc = Scenario.make(fe.cfg.vocab_size, args.batch * getattr(args, "dp", 1), args.check_prompt_len,
                       args.check_steps, seed=args.seed)
    with stages_of(args)("reference model on the numerics scenario", progress="running the reference model"):
        return NumericsCheck(fe.reference(), fe.source, sc, args.chunk, args.tol, capacity=args.max_context,
                             replicas=getattr(args, "dp", 1))


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
    from ..passes import PassManager, PipelineOptions
    from ..passes.manager import passes_run

    st = stages_of(args)
    if args.start_from:
        with st("read --start-from"):
            module = read_ir(args.start_from)
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

    from ..passes import PassManager, PipelineOptions

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
    from ..passes.numerics import ERROR_UNIT

    tol = check.tol
    o = sys.stderr
    o.write(f"// ----- numerics{' (' + what + ')' if what else ''}: error = {ERROR_UNIT} (max |reference logit| "
            f"{check.scale:.3g}); tolerance {tol:g} -----\n")
    if result.traced_error is not None:
        o.write(f"  {'input' if before else 'traced':<40} {result.traced_error:.3g}\n")
    gap = check.layout_error(result.module)
    if gap is not None:
        p = result.module.attrs
        dp = f" dp {p['parallel.dp']}" if "parallel.dp" in p else ""
        o.write(f"  (partitioned modules: against the reference of their layout,{dp} tp {p['parallel.tp']} ep "
                f"{p['parallel.ep']}, whose sums split per rank as theirs do; it lies {gap:.3g} from the reference)\n")
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


def finish(args, outcome) -> int:
    """The command's last lines: --time-passes, then the numerics verdict (exit status 1 if broken)."""
    if args.time_passes:
        from ..timing import process_seconds

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


def check_outputs(args, artifact_dir: bool = False) -> None:
    """Output paths are checked before any work starts (`-o`: an artifact directory or a file)."""
    from ..files import check_output_dir, check_output_file

    if getattr(args, "dump_ir", None):
        check_output_dir(args.dump_ir, InputError, force=True, what="--dump-ir directory")
    out = getattr(args, "output", None)
    if out and artifact_dir:
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


def write_file(path: Path, text: str, what: str, check_ir: bool = False, shown: Path | None = None,
           check_program: bool = False) -> None:
    """Write one artifact atomically and say so (path, size, what was checked)."""
    from ..files import write_text_atomic

    write_text_atomic(path, text)
    checked = ""
    if check_ir:
        from ..ir.text import parse_module
        from ..ir.verify import verify

        verify(parse_module(text))
        checked = "; parses back and verifies"
    if check_program:
        from ..program.text import parse_program
        from ..program.verify import verify_program

        verify_program(parse_program(text))
        checked = "; parses back and verifies"
    log.info("wrote %s (%s bytes, %s%s)", shown or path, f"{path.stat().st_size:,}", what, checked)


def read_ir(path: str):
    from ..files import read_text
    from ..ir.text import parse_module
    from ..ir.verify import verify

    text = read_text(path, IRError, "IR file")
    try:
        return verify(parse_module(text))
    except V4Error as e:
        raise type(e)(e.what, where=f"{path}: {e.where}" if e.where else path, expected=e.expected,
                      found=e.found) from None
