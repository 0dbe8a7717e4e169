"""`v4compile run ARTIFACT`: generate with a compiled artifact through the runtime (`v4compile.load`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ..errors import InputError
from ..runtime.session import DEVICES
from ..speculation import MAX_DRAFT_TOKENS
from .args import float_arg, int_arg, parse_ids, temperature_arg, threads_arg


def cmd_run(args: argparse.Namespace) -> int:
    from ..runtime import load

    if args.speculative and args.prompt is not None:
        raise InputError("--speculative needs --ids")
    if os.environ.get("RANK", "0") != "0":
        # under torchrun every rank runs the same steps (a partitioned artifact) and only rank 0 prints;
        # the others' errors still print (stderr, one `error:` line each)
        logging.getLogger("v4compile").setLevel(logging.WARNING)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout until it exits)
        args.quiet_rank = True
    if args.self_check:
        return _self_check(args)
    if args.prompt is not None:
        from .text import run_prompt

        return run_prompt(args)
    if args.chat or args.stop:
        raise InputError("--chat and --stop need --prompt (text)")
    ids = parse_ids(args.ids)
    if not ids:
        raise InputError("empty prompt", expected="at least one id in --ids")
    if args.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be >= 1", found=args.max_new_tokens)
    t_load = time.perf_counter()
    sess = load(args.artifact, device=args.device, threads=args.threads, prefix_cache=not args.no_prefix_cache)
    t_load = time.perf_counter() - t_load
    sess.check_prompt(ids, "--ids")
    if len(ids) + args.max_new_tokens > sess.max_context:
        raise InputError("prompt + --max-new-tokens exceed the compiled maximum context",
                         expected=f"<= {sess.max_context} tokens", found=len(ids) + args.max_new_tokens)
    if args.speculative:
        from ..runtime.speculative import mtp_draft

        mtp_draft(sess)  # the artifact's compiled MTP block, or one line saying why not
        return _run_speculative(args, sess, ids, None, t_load)
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
                          "warmup_s": round(t_warm, 4), "prefill_s": round(prefill, 4),
                          "cached_tokens": sum(sess.last_cached_tokens)}))
    elif not getattr(args, "quiet_rank", False):
        print(",".join(map(str, out)))
        print(f"{len(out)} tokens in {dt:.3f} s ({tps:.1f} tokens/s, prefill included) on {args.device}",
              file=sys.stderr)
        ttft = t_load + t_warm + prefill
        print(f"time to first token {ttft:.3f} s: load {t_load:.3f} s (weights "
              f"{getattr(sess.backend, 'weights_s', 0.0):.3f} s), warmup {t_warm:.3f} s, prefill "
              f"{prefill:.3f} s", file=sys.stderr)
    return 0


SELF_CHECK_FAILED = 1  # exit status of a device whose output departs from the golden (bad input is 2)


def _self_check(args) -> int:
    """`run ART --self-check`: the artifact's golden on this device (`Session.self_check`), one line per check
    with its error beside its tolerance, then the verdict; exit 0 (passed) or 1 (FAILED). Under torchrun every
    rank checks and rank 0 prints."""
    from ..runtime import load

    for flag, given in (("--speculative", args.speculative), ("--chat", args.chat), ("--stop", args.stop)):
        if given:
            raise InputError(f"--self-check runs the golden: {flag} does not apply")
    sess = load(args.artifact, device=args.device, threads=args.threads)
    res = sess.self_check()
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        print("\n".join(res.lines()))
    return 0 if res.passed else SELF_CHECK_FAILED


def _run_speculative(args, sess, ids, draft, t_load: float) -> int:
    """Speculative decoding (`runtime/speculative.py`; `draft` None: the compiled MTP block): the ids of plain
    greedy decoding (sampled ones distributed as plain sampling's), fewer steps."""
    from ..runtime.speculative import speculative_generate

    if args.temperature != 0 and args.top_p != 1:
        raise InputError("--speculative samples without --top-p", expected="--top-p 1", found=args.top_p)
    t0 = time.perf_counter()
    out, stats = speculative_generate(sess, [ids], args.max_new_tokens, args.draft_tokens, draft,
                                      temperature=args.temperature, seed=args.seed)
    dt = time.perf_counter() - t0
    tps = len(out[0]) / dt if dt > 0 else 0.0
    if args.json:
        print(json.dumps({"ids": out[0], "tokens_per_s": round(tps, 2), "load_s": round(t_load, 4),
                          "acceptance": [round(r, 4) for r in stats.rates()],
                          "tokens_per_step": round(stats.tokens_per_step(), 4)}))
    else:
        print(",".join(map(str, out[0])))
        print(f"{len(out[0])} tokens in {dt:.3f} s ({tps:.1f} tokens/s, prefill included) on {args.device}; "
              f"{stats.tokens_per_step():.2f} tokens per verify step", file=sys.stderr)
    return 0


def draft_tokens_arg(text: str):
    """--draft-tokens: "auto" or an integer 1..MAX_DRAFT_TOKENS."""
    return "auto" if text == "auto" else int_arg(1, MAX_DRAFT_TOKENS)(text)


def add_command(sub) -> None:
    rn = sub.add_parser("run", help="generate with a compiled artifact (v4compile compile -o DIR)")
    rn.add_argument("artifact", metavar="ARTIFACT", help="artifact directory")
    src = rn.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    src.add_argument("--prompt", help="prompt text (the artifact's tokenizer); the text is streamed to stdout")
    src.add_argument("--self-check", action="store_true",
                     help="run the artifact's golden (the reference model's answer, written by compile -o) on this "
                          "device and compare: one line per check, then `self-check: passed` (exit 0) or `FAILED` "
                          "with the first departing step and lane (exit 1); --json: the figures")
    rn.add_argument("--chat", action="store_true", help="--prompt is a user message of the chat template")
    rn.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (--prompt; repeatable)")
    rn.add_argument("--max-new-tokens", type=int_arg(1, 1 << 24), default=16)
    rn.add_argument("--device", choices=DEVICES, default="auto",
                    help="auto (default), cpu (ONNX Runtime), host (the C runtime on host memory, reference kernels), "
                         "hip / cuda (the C runtime on a GPU)")
    rn.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 (default): greedy")
    rn.add_argument("--top-p", type=float_arg(0.0, 1.0), default=1.0)
    rn.add_argument("--seed", type=int_arg(0, 2 ** 64 - 1), default=None, help="sampling seed, in [0, 2^64)")
    rn.add_argument("--threads", type=threads_arg, default=None,
                    help="CPU threads: ONNX Runtime's intra-op threads on cpu (default: free cores, at most 8, at least 1)")
    rn.add_argument("--speculative", choices=("mtp",), default=None,
                    help="speculative decoding: the artifact's MTP block drafts, a verify step checks (--ids only; "
                         "sampling without --top-p)")
    rn.add_argument("--draft-tokens", type=draft_tokens_arg, default="auto",
                    help="drafts per step, 1..%d, or auto (default: chosen per step from the running acceptance and "
                         "the step costs; 0 = a plain decode step)" % MAX_DRAFT_TOKENS)
    rn.add_argument("--no-prefix-cache", action="store_true",
                    help="compute every prompt whole (the prefix cache, on by default, is bit-exact)")
    rn.add_argument("--json", action="store_true", help='print {"ids": [...], "tokens_per_s", "load_s", "warmup_s", '
                                                        '"prefill_s", "cached_tokens"} (with --prompt also "text"; '
                                                        'with --speculative "acceptance" per draft position and '
                                                        '"tokens_per_step")')
    rn.set_defaults(func=cmd_run)
