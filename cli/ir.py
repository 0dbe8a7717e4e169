"""`v4compile ir (dump | diff | verify | bisect | passes)`: IR dump and pass debugging."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import InputError
from ..targets import GPU_TARGET_NAMES
from .args import add_pipeline_flags, add_source_flags
from .pipeline import (NumericsOutcome, check_outputs, finish, frontend_of, numerics_check, pipeline_name, pipeline_of,
                       read_ir, run_pipeline, stages_of, targets_of, write_file)


def cmd_ir_dump(args) -> int:
    from ..ir.export import to_dot, to_json
    from ..ir.text import print_module

    check_outputs(args)
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
            from ..program.build import program_of
            from ..program.text import print_program

            if args.format == "json":
                raise InputError("the program prints as text or dot", found=f"--format {args.format}")
            prog = program_of(module)
            if args.format == "dot":
                from ..program.graph import to_dot as program_dot
                text = "".join(program_dot(prog.functions[f]) for f in (funcs or list(prog.functions)))
            else:
                text = print_program(prog, funcs)
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
            write_file(Path(args.output), text, what, check_ir=parses and stage != "program",
                   check_program=stage == "program" and args.format == "text")
    else:
        sys.stdout.write(text)
    return finish(args, outcome)


def _pipeline_flags_given(args) -> bool:
    return bool(args.passes or args.print_ir_after_all or args.print_ir_after_change or args.print_ir_after
                or args.dump_ir or args.verify_each or args.disable_pass or args.stop_after or args.start_from
                or args.time_passes or args.check_numerics)


def cmd_ir_diff(args) -> int:
    from ..ir.diff import diff_modules

    d = diff_modules(read_ir(args.a), read_ir(args.b))
    sys.stdout.write(d or "no differences\n")
    return 0


def cmd_ir_verify(args) -> int:
    # One process for many files: a pass's dumps are verified together (start-up costs more than a file).
    # The first bad file stops it with its one error; the ok lines before it stand.
    for path in args.files:
        m = read_ir(path)
        print(f"ok: @{m.name}, {len(m.weights)} weights, "
              + ", ".join(f"@{n} {len(f.ops)} ops" for n, f in m.functions.items()), flush=True)
    return 0


def cmd_ir_bisect(args) -> int:
    from ..passes.numerics import ERROR_UNIT, bisect

    unused = [flag for flag, given in (("--dump-ir", args.dump_ir), ("--start-from", args.start_from),
                                       ("--print-ir-after-all", args.print_ir_after_all),
                                       ("--print-ir-after-change", args.print_ir_after_change),
                                       ("--print-ir-after", args.print_ir_after), ("--stop-after", args.stop_after),
                                       ("--verify-each", args.verify_each)) if given]
    if unused:
        raise InputError(f"ir bisect does not take {', '.join(unused)}", expected="ir dump or compile for those")
    check_outputs(args)
    fe = frontend_of(args, need_weights=True, announce="ir bisect")
    check = numerics_check(args, fe)
    pipeline = [p for p in pipeline_of(args) if p.split("{", 1)[0].strip() not in args.disable_pass]
    with stages_of(args)("bisect", progress="bisecting"):
        d = bisect(fe.module, pipeline, check)
    if d is None:
        print(f"no pass breaks numerics (tolerance {check.tol:g}; error = {ERROR_UNIT}) in: {', '.join(pipeline)}")
        return finish(args, None)
    print(d.render())
    return finish(args, NumericsOutcome(False, f"pass {d.pass_name} breaks the tolerance {check.tol:g} "
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
    from ..errors import PassError
    from ..passes import PIPELINES
    from ..passes.base import load_all

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


def add_command(sub) -> None:
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

    v = irs.add_parser("verify", help="parse and verify IR files (one ok line each)")
    v.add_argument("files", metavar="FILE.ir", nargs="+")
    v.set_defaults(func=cmd_ir_verify)

    b = irs.add_parser("bisect", help="find the first pass, and the op in each function, that breaks numerics "
                                      "(exit status 1 when one does)")
    add_source_flags(b)
    add_pipeline_flags(b)
    b.set_defaults(func=cmd_ir_bisect)

    ps = irs.add_parser("passes", help="list the registered passes and each target's pipeline; with NAME, one "
                                       "pass in full")
    ps.add_argument("name", nargs="?", metavar="NAME", help="a pass: print its requirements, guarantees and options")
    ps.add_argument("--target", default=None, help=f"show only this target's pipeline (gpu, {GPU_TARGET_NAMES}, cpu)")
    ps.set_defaults(func=cmd_ir_passes)
