"""The `v4compile` command line.

    v4compile generate [CHECKPOINT | --preset NAME] --ids 0,5,9 --max-new-tokens 16 [--json]
    v4compile inspect (--preset NAME | CHECKPOINT) [--json]
    v4compile init-random --preset tiny -o DIR [--seed N] [--quantized]
    v4compile ir (dump | diff | verify | bisect | passes) ...   IR dump and pass debugging
    v4compile compile (--preset NAME | CHECKPOINT) [--weights none] [--report] [-o DIR [--target cpu]] ...
    v4compile run ARTIFACT --ids 1,2,3 --max-new-tokens N [--device cpu] [--temperature T --seed S] [--json]
    v4compile run ARTIFACT --prompt TEXT [--chat] [--stop S] ...   text streamed (the artifact's tokenizer)
    v4compile serve ARTIFACT [--host H] [--port P] [--device cpu]  an OpenAI-compatible server

Errors in the user's input (including argparse's own) print one line `error: ...` and exit with status 2;
no traceback. SIGTERM and SIGHUP are handled like Ctrl-C: whatever was being written is removed, and the
command ends as interrupted (exit 128 + signal), never with an error its interruption caused.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from ..errors import CodegenError, V4Error
from ..signals import outside_imports, take_pending

log = logging.getLogger("v4compile")


def build_parser() -> argparse.ArgumentParser:
    from . import compile as compile_cmd
    from . import ir, model, run, serve
    from .args import ArgParser

    ap = ArgParser(prog="v4compile", description="Ahead-of-time compiler for DeepSeek-V4.")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v: debug)")
    ap.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only (no info lines)")
    sub = ap.add_subparsers(dest="command", required=True)
    model.add_generate(sub)
    run.add_command(sub)
    model.add_commands(sub)
    ir.add_command(sub)
    compile_cmd.add_command(sub)
    serve.add_command(sub)
    return ap


class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, raised in the main thread so that every writer cleans up as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


RECEIVED: list[int] = []  # the signals this process got (`__main__` records the early ones too)


def _on_signal(signum, frame) -> None:
    RECEIVED.append(signum)
    for s in (signal.SIGTERM, signal.SIGHUP):  # one clean-up is enough; ignore repeats while it runs
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


def _on_interrupt(signum, frame) -> None:
    RECEIVED.append(signum)
    raise KeyboardInterrupt


class _Formatter(logging.Formatter):
    """`info: ...` / `warning: ...` for the user; debug lines also name their logger."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno <= logging.DEBUG:
            return f"debug {record.name}: {msg}"
        return f"{record.levelname.lower()}: {msg}"


def main(argv: Sequence[str] | None = None) -> int:
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, outside_imports(_on_signal))
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, outside_imports(_on_interrupt))  # Ctrl-C: KeyboardInterrupt, cleaned up below
    try:  # from the first moment: a signal during the (slow) imports below is no traceback either
        rc = _main(argv)
        late = take_pending()  # a signal deferred by an import the command finished before its timer fired
        if late is not None:
            RECEIVED.append(late)
            return interrupted_exit(late)
        return rc
    except BaseException as e:
        # Not always KeyboardInterrupt: a signal inside a C extension's import can surface as that import's
        # own error (numpy: "cannot load module more than once per process"); see `signalled`.
        if not isinstance(e, KeyboardInterrupt) and not signalled():
            raise
        return interrupted_exit(e.signum if isinstance(e, Terminated) else RECEIVED[-1] if RECEIVED else signal.SIGINT)


def signalled() -> bool:
    """Whether a signal reached this process. Then any error after it is its doing, never a fault of the input,
    the artifact or the kernels: an interrupted import fails as that import's error, an interrupted host
    kernel as the C runtime's failure, an interrupted write as a missing file."""
    return bool(RECEIVED)


def interrupted_exit(signum: int) -> int:
    """Say so (one line) and give the shell's exit code of a process ended by `signum`."""
    if signum == signal.SIGINT:
        print("interrupted", file=sys.stderr)
        return 130
    print(f"interrupted by signal {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum


def _main(argv: Sequence[str] | None) -> int:
    from .. import ops

    ops.load_all()  # every command may read or build IR of any op set
    ap = build_parser()
    args = ap.parse_args(argv)
    level = logging.WARNING if args.quiet else logging.INFO - 10 * min(args.verbose, 1)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if getattr(args, "checkpoint", None) and getattr(args, "preset", None):
        print("error: give either CHECKPOINT or --preset, not both", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (V4Error, OSError) as e:
        if signalled():  # `main` reports the signal
            raise
        print(f"error: {_message(e)}", file=sys.stderr)
        return 1 if isinstance(e, CodegenError) else 2


def _message(e: V4Error | OSError) -> str:
    if isinstance(e, V4Error):
        return str(e)
    where = f"{e.filename}: " if e.filename else ""  # the environment, not the program: a full disk, a file removed
    return f"{where}{e.strerror or e}"
