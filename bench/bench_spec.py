"""Speculative decoding with the MTP block on the trained example model (examples/tiny-doc): acceptance and
tokens/s against plain greedy decoding in the same run, and the modeled V4-Pro gain at that acceptance.

    python bench/bench_spec.py [--new 64] [--k 1,2,3] [--repeat 7] [--reference] [--no-model] [--checkpoint DIR]
                               [--json OUT]

What runs: the example compiled with `--draft-tokens k` for the cpu device, one artifact per k (ONNX Runtime,
one thread, batch 1), so the artifact carries the MTP block (`draft_b1` / `draft_c16`): `runtime/speculative.py`'s
steps (greedy: one call of the fused verify + acceptance + MTP graph, `codegen/onnx_spec.py`; for k > 1 the
recursive drafts' `draft_b1` calls, their ring writes undone) against the session's plain decode steps, the
MTP's own cost included. Plain and every k are timed in interleaved
rounds (plain, k=1, k=2, ... then again), `--repeat` rounds; tokens/s from the median time, the speedup the
median of the rounds' own ratios (with their range); times are this process's CPU time (`time.process_time`), which stays fair on a shared, loaded machine. Greedy ids must match
plain decoding (checked, not timed). `--reference` adds the same for the eager reference decoder
(`v4compile/model/speculative.py`, torch on the CPU). The modeled part (`codegen/spec_cost.py`) traces
V4-Pro's decode and verify steps shape-only (~10 s per k). Not a test: run it once. `PROMPTS` are held out of
the example's MTP distillation (`scripts/distill_tiny_doc_mtp.py` imports them and trains on no prompt that
contains one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from v4compile.config import preset
from v4compile.model import ReferenceModel
from v4compile.model.speculative import speculative_generate
from v4compile.tokenizer import Tokenizer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-doc"
PROMPTS = ("The shutil module", "Return the", "import os\n", "This function")  # held out (module doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--k", default="1,2,3", help="draft counts")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved rounds (the figures are medians)")
    ap.add_argument("--reference", action="store_true", help="also the eager reference decoder")
    ap.add_argument("--no-model", action="store_true", help="skip the modeled V4-Pro gain")
    ap.add_argument("--checkpoint", type=Path, default=EXAMPLE, help="the trained example (default examples/tiny-doc)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_bytes((a.checkpoint / "tokenizer.json").read_bytes(),
                               (a.checkpoint / "tokenizer_config.json").read_bytes(), str(a.checkpoint))
    prompts = [tok.encode(p) for p in PROMPTS]
    ks = [int(x) for x in a.k.split(",")]
    res = {"model": str(a.checkpoint), "new_tokens": a.new, "prompts": len(prompts), "batch": 1,
           "repeat": a.repeat, "compiled_cpu": compiled_cpu(a, prompts, ks)}
    rates = {k: v["acceptance"] for k, v in res["compiled_cpu"]["speculative"].items()}
    if a.reference:
        res["reference"] = reference(a, prompts, ks)
    if not a.no_model:
        from v4compile.codegen.spec_cost import render, verify_models

        res["v4_pro_modeled"] = verify_models(preset("v4-pro"), tuple(ks), ("sm_90a", "gfx950"), rates=rates)
        print("modeled V4-Pro verify vs decode step (measured acceptance above, and the V3 report's 85 %):")
        for ms in res["v4_pro_modeled"].values():
            for m in ms:
                print(render(m))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


def interleaved(runs: dict, prompts, repeat: int) -> dict:
    """{name: (its results on the prompts, CPU seconds of each round)}: `repeat` rounds, each running every
    prompt through every run in turn (plain, k=1, ... for prompt 0, then prompt 1, ...), so that the runs a
    ratio compares are measured seconds apart."""
    times: dict = {n: [0.0] * repeat for n in runs}
    out: dict = {n: [None] * len(prompts) for n in runs}
    for r in range(repeat):
        for i, p in enumerate(prompts):
            for n, fn in runs.items():
                t0 = time.process_time()
                out[n][i] = fn(p)
                times[n][r] += time.process_time() - t0
    return {n: (out[n], times[n]) for n in runs}


def merged(stats):
    """Acceptance statistics of several runs as one."""
    acc = stats[0]
    for r in stats[1:]:
        acc.offered = [x + y for x, y in zip(acc.offered, r.offered)]
        acc.accepted = [x + y for x, y in zip(acc.accepted, r.accepted)]
        acc.steps += r.steps
        acc.tokens += r.tokens
    return acc


def report(label: str, ks: list[int], res: dict, n_tokens: int) -> dict:
    """Tokens/s from the median CPU time; the speedup is the median of the rounds' own ratios (plain over
    speculative in the same round), with their range: the spread a loaded machine leaves."""
    plain_ids, plain_t = res["plain"]
    res = {k: (([ids for ids, _ in v], [st for _, st in v]), ts) for k, (v, ts) in res.items() if k != "plain"}
    plain_s = statistics.median(plain_t)
    out = {"plain_tokens_s": round(n_tokens / plain_s, 2), "speculative": {}}
    print(f"{label}, plain greedy: {out['plain_tokens_s']:.1f} tokens/s (median CPU time, batch 1, {n_tokens} tokens)")
    for k in ks:
        (ids, stats), ts = res[k]
        if ids != plain_ids:
            raise SystemExit(f"{label} k={k}: speculative ids differ from plain greedy decoding")
        acc = merged(stats)
        tps = n_tokens / statistics.median(ts)
        ratios = sorted(p / t for p, t in zip(plain_t, ts))
        out["speculative"][k] = {"acceptance": [round(x, 3) for x in acc.rates()],
                                 "tokens_per_step": round(acc.tokens_per_step(), 3), "tokens_s": round(tps, 2),
                                 "speedup": round(statistics.median(ratios), 3),
                                 "speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)]}
        print(f"{label} k={k}: acceptance {'/'.join(f'{x:.2f}' for x in acc.rates())}, {acc.tokens_per_step():.2f} "
              f"tokens per step, {tps:.1f} tokens/s; {statistics.median(ratios):.2f}x plain (median of "
              f"{len(ratios)} rounds, range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    return out


def reference(a, prompts, ks: list[int]) -> dict:
    """The eager reference decoder (its own MTP drafts) against `ReferenceModel.generate`."""
    model = ReferenceModel.from_pretrained(a.checkpoint)
    model.generate(prompts[0], 4)  # warm up
    runs = {"plain": lambda p: model.generate(p, a.new)}
    for k in ks:
        def spec(p, k=k):
            r = speculative_generate(model, [p], a.new, k)
            return r.ids[0], r.acceptance
        runs[k] = spec
    return report("reference", ks, interleaved(runs, prompts, a.repeat), a.new * len(prompts))


def compiled_cpu(a, prompts, ks: list[int]) -> dict:
    """Plain vs speculative greedy decoding (the compiled MTP drafts) on the compiled cpu device, batch 1: one
    artifact per k (`--draft-tokens k`: its verify and draft functions have exactly 1 + k lanes)."""
    import tempfile

    import v4compile
    from v4compile.cli import main as cli
    from v4compile.runtime.speculative import speculative_generate as compiled_generate

    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for k in ks:
            art = Path(tmp) / f"tiny-doc-k{k}"
            if cli(["-q", "compile", str(a.checkpoint), "-o", str(art), "--target", "cpu", "--decode-buckets", "1",
                    "--prefill-buckets", "16", "--draft-tokens", str(k), "--numerics", "hf", "--dtype", "fp32"]) != 0:
                raise SystemExit("compiling the example failed")
            sessions[k] = sess = v4compile.load(art, device="cpu", threads=1)
            sess.backend.prepare(sorted(sess.backend.functions()))  # every session built before timing
            compiled_generate(sess, [prompts[0]], 4, k)  # and the one-call greedy step's (built at first use)
        plain = sessions[ks[0]]
        runs = {"plain": lambda p: plain.generate([p], a.new)[0]}
        for k in ks:
            def spec(p, k=k):
                ids, stats = compiled_generate(sessions[k], [p], a.new, k)
                return ids[0], stats
            runs[k] = spec
        out = report("compiled cpu", ks, interleaved(runs, prompts, a.repeat), a.new * len(prompts))
        for sess in sessions.values():
            sess.close()
    return out


if __name__ == "__main__":
    main()
