"""`v4compile generate` (the reference model), `inspect` (accounting) and `init-random` (a seeded checkpoint)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ..errors import InputError
from .args import (DEFAULT_PRESET, INT64_MAX, MAX_RANDOM_PARAMS, add_model_source, add_threads_flag, apply_threads,
                   int_arg, parse_ids)

log = logging.getLogger("v4compile")


def load_model(args: argparse.Namespace):
    """A `ReferenceModel` from a checkpoint, or from a preset with seeded random weights."""
    import torch

    from ..accounting import account
    from ..config import preset
    from ..init_random import random_source
    from ..model import ReferenceModel
    from ..model.reference import build_weights
    from ..weights import spec_table

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

    ids = parse_ids(args.ids)
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


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..accounting import account, render
    from ..checkpoint import Checkpoint
    from ..config import preset

    if args.checkpoint:
        from ..errors import CheckpointError

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
        print(json.dumps({"config": cfg.name, "defaults": dict(cfg.defaults), **a.to_json()}, indent=1))
    else:
        sys.stdout.write(render(cfg, a))
    return 0


def cmd_init_random(args: argparse.Namespace) -> int:
    from ..accounting import account
    from ..config import V4Config, preset
    from ..init_random import init_random

    from ..errors import CheckpointError
    from ..files import check_output_dir

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


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="greedy generation with the reference model")
    add_model_source(g)
    g.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    g.add_argument("--max-new-tokens", type=int_arg(0, 1 << 24), default=16)
    g.add_argument("--numerics", choices=("hf", "official"), default="official",
                   help="official (default, as `compile` and the deployed model) or hf (transformers)")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    g.add_argument("--seed", type=int_arg(0, INT64_MAX), default=0, help="seed of the random weights of a preset")
    g.add_argument("--allow-nonfinite", action="store_true", help="load NaN / Inf weights instead of refusing them")
    g.add_argument("--json", action="store_true")
    add_threads_flag(g)
    g.set_defaults(func=cmd_generate)


def add_commands(sub) -> None:
    """inspect, init-random."""
    i = sub.add_parser("inspect", help="parameter, disk and KV-cache accounting")
    add_model_source(i)
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
