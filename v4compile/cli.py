"""The `v4compile` command line.

    v4compile generate [CHECKPOINT | --preset NAME] --ids 0,5,9 --max-new-tokens 16 [--json]
    v4compile inspect (--preset NAME | CHECKPOINT) [--json]
    v4compile init-random --preset tiny -o DIR [--seed N] [--quantized]
    v4compile ir (dump | diff | verify | bisect | passes) ...   IR dump and pass debugging
    v4compile compile (--preset NAME | CHECKPOINT) [--weights none] [--report] [-o DIR [--target cpu]] ...
    v4compile run ARTIFACT --ids 1,2,3 --max-new-tokens N [--device cpu] [--temperature T --seed S] [--json]

Errors in the user's input (including argparse's own) print one line `error: ...` and exit with status 2;
no traceback. SIGTERM and SIGHUP are handled like Ctrl-C: whatever was being written is removed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Sequence

from .errors import CodegenError, InputError, V4Error

log = logging.getLogger("v4compile")

DEFAULT_PRESET = "tiny"
MAX_RANDOM_PARAMS = 2_000_000_000  # in-memory random weights beyond this would not fit a laptop
INT64_MAX = 2 ** 63 - 1
MAX_IDS = 1 << 20


class ArgParser(argparse.ArgumentParser):
    """argparse with the project's error convention: one `error:` line, then the usage, exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        self.print_usage(sys.stderr)
        raise SystemExit(2)


def int_arg(lo: int, hi: int):
    """An argparse type: a decimal integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, found {text[:40]!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], found {text[:40]}")
        return v
    parse.__name__ = "integer"
    return parse


def float_arg(lo: float, hi: float):
    """An argparse type: a finite number in (lo, hi]."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, found {text[:40]!r}") from None
        if not (math.isfinite(v) and lo < v <= hi):
            raise argparse.ArgumentTypeError(f"expected a finite number in ({lo:g}, {hi:g}], found {text[:40]}")
        return v
    parse.__name__ = "number"
    return parse


def temperature_arg(text: str) -> float:
    """--temperature: a finite number >= 0 (0: greedy)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text[:40]!r}") from None
    if not (math.isfinite(v) and 0 <= v <= 1e6):
        raise argparse.ArgumentTypeError(f"expected a finite number in [0, 1e6], found {text[:40]}")
    return v


temperature_arg.__name__ = "number"


def _parse_ids(text: str) -> list[int]:
    parts = [x for x in text.replace(" ", "").split(",") if x != ""]
    if len(parts) > MAX_IDS:
        raise InputError("too many --ids", expected=f"<= {MAX_IDS}", found=len(parts))
    try:
        ids = [int(x, 10) for x in parts]
    except ValueError:
        raise InputError("--ids must be comma-separated integers", found=text[:80]) from None
    bad = next((i for i in ids if not -INT64_MAX - 1 <= i <= INT64_MAX), None)
    if bad is not None:
        raise InputError("--ids: id out of the 64-bit integer range", found=str(bad)[:40])
    return ids


def load_model(args: argparse.Namespace):
    """A `ReferenceModel` from a checkpoint, or from a preset with seeded random weights."""
    import torch

    from .accounting import account
    from .config import preset
    from .init_random import random_source
    from .model import ReferenceModel
    from .model.reference import build_weights
    from .weights import spec_table

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.checkpoint:
        return ReferenceModel.from_pretrained(args.checkpoint, numerics=args.numerics, dtype=dtype,
                                              allow_nonfinite=args.allow_nonfinite)
    cfg = preset(args.preset or DEFAULT_PRESET)
    n = account(cfg).logical_params
    if n > MAX_RANDOM_PARAMS:
        raise InputError(f"preset '{cfg.name}' is too large for in-memory random weights",
                         expected=f"<= {MAX_RANDOM_PARAMS:,} parameters (or pass a CHECKPOINT)", found=f"{n:,}")
    src = random_source(cfg, args.seed)
    specs = spec_table(cfg)
    log.debug("preset %s with random weights (seed %d)", cfg.name, args.seed)
    return ReferenceModel(cfg, build_weights(cfg, lambda name: src(specs[name]), dtype), numerics=args.numerics,
                          dtype=dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .compile_cli import apply_threads

    ids = _parse_ids(args.ids)
    if not ids:
        raise InputError("empty prompt", expected="at least one id in --ids")
    apply_threads(args)
    model = load_model(args)
    t0 = time.perf_counter()
    out = model.generate(torch.tensor(ids), args.max_new_tokens)
    dt = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"model": model.cfg.name, "numerics": model.numerics, "prompt": ids, "generated": out,
                          "seconds": round(dt, 4)}))
    else:
        print(",".join(map(str, out)))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .runtime import load

    ids = _parse_ids(args.ids)
    if not ids:
        raise InputError("empty prompt", expected="at least one id in --ids")
    if args.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be >= 1", found=args.max_new_tokens)
    t_load = time.perf_counter()
    sess = load(args.artifact, device=args.device, threads=args.threads)
    t_load = time.perf_counter() - t_load
    sess.check_prompt(ids, "--ids")
    if len(ids) + args.max_new_tokens > sess.max_context:
        raise InputError("prompt + --max-new-tokens exceed the compiled maximum context",
                         expected=f"<= {sess.max_context} tokens", found=len(ids) + args.max_new_tokens)
    t_warm = time.perf_counter()
    sess.warmup(len(ids))
    t_warm = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    out = sess.generate([ids], args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)[0]
    dt = time.perf_counter() - t0
    tps = len(out) / dt if dt > 0 else 0.0
    prefill = sess.first_token_s or 0.0
    if args.json:
        print(json.dumps({"ids": out, "tokens_per_s": round(tps, 2), "load_s": round(t_load, 4),
                          "warmup_s": round(t_warm, 4), "prefill_s": round(prefill, 4)}))
    else:
        print(",".join(map(str, out)))
        print(f"{len(out)} tokens in {dt:.3f} s ({tps:.1f} tokens/s, prefill included) on {args.device}",
              file=sys.stderr)
        ttft = t_load + t_warm + prefill
        print(f"time to first token {ttft:.3f} s: load {t_load:.3f} s (weights "
              f"{getattr(sess.backend, 'weights_s', 0.0):.3f} s), warmup {t_warm:.3f} s, prefill "
              f"{prefill:.3f} s", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .accounting import account, render
    from .checkpoint import Checkpoint
    from .config import preset

    if args.checkpoint:
        from .errors import CheckpointError

        with Checkpoint.open(args.checkpoint) as ckpt:
            cfg = ckpt.cfg
            missing = ckpt.missing()
            if missing:  # the accounting would count tensors that are not there
                raise CheckpointError(f"{len(missing)} tensor(s) missing", where=str(args.checkpoint),
                                      expected="every tensor of the config", found=", ".join(missing[:3]) +
                                      (", ..." if len(missing) > 3 else ""))
            a = account(cfg, ckpt.header_specs())
    else:
        cfg = preset(args.preset or DEFAULT_PRESET)
        a = account(cfg)
    if args.json:
        print(json.dumps({"config": cfg.name, **a.to_json()}, indent=1))
    else:
        sys.stdout.write(render(cfg, a))
    return 0


def cmd_init_random(args: argparse.Namespace) -> int:
    from .accounting import account
    from .config import V4Config, preset
    from .init_random import init_random

    from .errors import CheckpointError
    from .files import check_output_dir

    if args.config and args.preset:
        raise InputError("give either --preset or --config, not both")
    check_output_dir(args.output, CheckpointError, force=args.force)
    cfg = V4Config.from_file(args.config) if args.config else preset(args.preset or DEFAULT_PRESET)
    n = account(cfg).logical_params
    if n > MAX_RANDOM_PARAMS:
        raise InputError(f"config '{cfg.name}' is too large to write random weights for",
                         expected=f"<= {MAX_RANDOM_PARAMS:,} parameters", found=f"{n:,}")
    last = [0.0]

    def progress(i: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 2 or i == total:
            last[0] = now
            log.info("init-random: %d / %d tensors", i, total)

    path = init_random(args.output, cfg, seed=args.seed, quantized=args.quantized, progress=progress, force=args.force)
    print(str(path))
    return 0


def _add_model_source(p: argparse.ArgumentParser, checkpoint_required: bool = False) -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory or .safetensors file (official or HF naming)")
    p.add_argument("--preset", help="a named config instead of a checkpoint: tiny, tiny-pro, v4-flash, v4-pro")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="v4compile", description="Ahead-of-time compiler for DeepSeek-V4.")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v: debug)")
    ap.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only (no info lines)")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy generation with the reference model")
    _add_model_source(g)
    g.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    g.add_argument("--max-new-tokens", type=int_arg(0, 1 << 24), default=16)
    g.add_argument("--numerics", choices=("hf", "official"), default="official",
                   help="official (default, as `compile` and the deployed model) or hf (transformers)")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    g.add_argument("--seed", type=int_arg(0, INT64_MAX), default=0, help="seed of the random weights of a preset")
    g.add_argument("--allow-nonfinite", action="store_true", help="load NaN / Inf weights instead of refusing them")
    g.add_argument("--json", action="store_true")
    from .compile_cli import add_threads_flag, threads_arg
    add_threads_flag(g)
    g.set_defaults(func=cmd_generate)

    rn = sub.add_parser("run", help="generate with a compiled artifact (v4compile compile -o DIR)")
    rn.add_argument("artifact", metavar="ARTIFACT", help="artifact directory")
    rn.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    rn.add_argument("--max-new-tokens", type=int_arg(1, 1 << 24), default=16)
    rn.add_argument("--device", choices=("auto", "cpu", "host", "hip", "cuda"), default="auto",
                    help="auto (default), cpu (ONNX Runtime), host (the C runtime on host memory, reference kernels), "
                         "hip / cuda (the C runtime on a GPU)")
    rn.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 (default): greedy")
    rn.add_argument("--top-p", type=float_arg(0.0, 1.0), default=1.0)
    rn.add_argument("--seed", type=int_arg(0, 2 ** 64 - 1), default=None, help="sampling seed, in [0, 2^64)")
    rn.add_argument("--threads", type=threads_arg, default=None,
                    help="CPU threads: ONNX Runtime's intra-op threads on cpu (default: min(4, free cores), at least 1)")
    rn.add_argument("--json", action="store_true", help='print {"ids": [...], "tokens_per_s", "load_s", "warmup_s", "prefill_s"}')
    rn.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="parameter, disk and KV-cache accounting")
    _add_model_source(i)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser("init-random", help="write a seeded random checkpoint for a preset or a config file")
    r.add_argument("--preset", help=f"a named config (default {DEFAULT_PRESET})")
    r.add_argument("--config", help="a config.json in either layout (official or HF)")
    r.add_argument("-o", "--output", required=True, help="output directory (must not exist or be empty)")
    r.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    r.add_argument("--seed", type=int_arg(0, INT64_MAX), default=0)
    r.add_argument("--quantized", action="store_true",
                   help="released formats: FP8 128x128 dense weights, FP4 1x32 experts (default: fp32)")
    r.set_defaults(func=cmd_init_random)

    from .compile_cli import add_compile_commands
    add_compile_commands(sub)
    return ap


class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, raised in the main thread so that every writer cleans up as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame) -> None:
    for s in (signal.SIGTERM, signal.SIGHUP):  # one clean-up is enough; ignore repeats while it runs
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


class _Formatter(logging.Formatter):
    """`info: ...` / `warning: ...` for the user; debug lines also name their logger."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno <= logging.DEBUG:
            return f"debug {record.name}: {msg}"
        return f"{record.levelname.lower()}: {msg}"


def main(argv: Sequence[str] | None = None) -> int:
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt, cleaned up below
    try:  # from the first moment: a signal during the (slow) imports below is no traceback either
        return _main(argv)
    except Terminated as e:
        print(f"interrupted by signal {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    from . import ops

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
    except CodegenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except V4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment, not the program: a full disk, a file removed under us
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
