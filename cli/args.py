"""The command line's argument types and flag groups, shared by every command.

Every type refuses what it cannot take with one `error:` line (argparse's, see `ArgParser`).
"""

from __future__ import annotations

import argparse
import math
import sys

from ..errors import InputError, PassError
from ..targets import GPU_TARGET_NAMES
from ..threads import MAX_THREADS, TORCH_THREADS, default_threads

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


def float_arg(lo: float, hi: float, lo_included: bool = False):
    """An argparse type: a finite number in (lo, hi], or [lo, hi] with `lo_included`."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, found {text[:40]!r}") from None
        if not (math.isfinite(v) and (lo <= v if lo_included else lo < v) and v <= hi):
            raise argparse.ArgumentTypeError(f"expected a finite number in {'[' if lo_included else '('}{lo:g}, "
                                             f"{hi:g}], found {text[:40]}")
        return v
    parse.__name__ = "number"
    return parse


temperature_arg = float_arg(0.0, 1e6, lo_included=True)  # 0: greedy


def parse_ids(text: str) -> list[int]:
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


threads_arg = int_arg(1, MAX_THREADS)  # the API's bound (`v4compile.load(threads=)`)


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="CPU threads for torch (default: min(4, free cores), at least 1; "
                        "the count can change the last bits of results)")


def apply_threads(args) -> int:
    import torch

    n = args.threads or default_threads(TORCH_THREADS)
    torch.set_num_threads(n)
    args._threads = n  # recorded in the compile report: the count can change the last bits of results
    return n


def add_model_source(p: argparse.ArgumentParser, checkpoint_required: bool = False) -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory or .safetensors file (official or HF naming)")
    p.add_argument("--preset", help="a named config instead of a checkpoint: tiny, tiny-pro, v4-flash, v4-pro")


def add_source_flags(p: argparse.ArgumentParser, numerics: str = "hf", dtype: str | None = "fp32") -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", help="checkpoint directory or .safetensors file")
    p.add_argument("--preset", help="tiny (default), tiny-pro, v4-flash, v4-pro")
    p.add_argument("--weights", choices=("none", "random", "checkpoint"),
                   help="none: shape-only, weights typed as released (FP8/FP4); random: seeded random weights "
                        "(preset default); checkpoint: the checkpoint's (default with CHECKPOINT)")
    p.add_argument("--seed", type=int_arg(0, INT64_MAX), default=0,
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
    g = p.add_argument_group("pipeline")
    g.add_argument("--passes", help="comma-separated pass specs (name or name{k=v,...}); default: the target's pipeline")
    g.add_argument("--target", default=None,
                   help=f"what to compile for, comma-separated: {GPU_TARGET_NAMES} (or gpu: both; their pipeline "
                        "runs to the program) and cpu (the ONNX path's pipeline); default gpu, and with -o also cpu "
                        "for a model of up to 2 B parameters with weights")
    g.add_argument("--tp", type=int_arg(1, 1 << 12), default=1,
                   help="tensor parallel ranks: attention heads split over them (runs partition{tp,ep} first)")
    g.add_argument("--ep", type=int_arg(1, 1 << 14), default=1,
                   help="expert parallel ranks: routed experts split over them; the world is max(dp x tp, ep) ranks")
    g.add_argument("--dp", type=int_arg(1, 1 << 12), default=1,
                   help="data parallel attention: dp replicas of tp ranks, each with its own sequences, KV pool and "
                        "state (--batch / --decode-batch per replica); --ep 1 or dp x tp (the experts over the world, "
                        "every rank's tokens gathered to them)")
    g.add_argument("--allreduce", choices=("oneshot", "nccl"), default="oneshot",
                   help="GPU programs: tensor-parallel all-reduces within a node as one-shot kernel launches over peer "
                        "memory (or a trailing part of the MoE launch that produces them, or the leading phase of the "
                        "launch that reads them), summing the ranks in rank order bit for bit as the IR's reference, "
                        "and data parallelism's all-gather / reduce-scatter of the MoE rows alike (one replica a rank; "
                        "the leading phase and trailing part of the MoE launch between them) "
                        "(oneshot, the default: passes oneshot_allreduce, fuse_oneshot_rows, fuse_oneshot_producer, "
                        "fuse_oneshot_consumer), or all of them on NCCL / RCCL (nccl: its ring order rounds otherwise)")
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
    g.add_argument("--tol", type=float_arg(0.0, math.inf, lo_included=True), default=1e-5,
                   help="numerics tolerance: max |logit error| relative to the largest reference logit (default 1e-5)")
    g.add_argument("--check-prompt-len", type=int_arg(1, 1 << 20), default=100)
    g.add_argument("--check-steps", type=int_arg(0, 1 << 20), default=32, help="decode steps of the numerics scenario")


def split_specs(text: str) -> list[str]:
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
