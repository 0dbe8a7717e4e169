"""The done-when matrix of issue 18: partitioned artifacts against the same model in one process.

    python bench/parallel_matrix.py [--presets tiny,tiny-pro] [--numerics official,hf]
                                    [--layouts tp2ep2,ep4] [--devices cpu,host] [--new 32] [--out DIR]

For each preset and numerics (fp32): one unpartitioned artifact and one per layout, each with the cpu
target (ONNX; partitioned: segments cut at the collectives) and the sm_90a target (the GPU program; its
kernels are placeholders here, `tests/fake_aot.py`: no cell runs a GPU binary). Device cpu runs the ONNX
segments with gloo between the ranks; device host runs the GPU program in the C runtime with the ops'
reference kernels (the Triton interpreter would take minutes a cell), its collective launches on gloo.
Each cell: the ranks under torchrun's environment (tests/parallel_worker.py, tests/dist_launch.py: a
deadline, every process reaped) generate a ragged batch of 3 prompts (continuous batching over a decode
bucket of 2) for --new tokens; it prints whether every rank's greedy ids equal the single-process run's
and the largest logit difference of any rank and step over the logit scale (the largest |logit| of the
single-process run). A cell that fails prints its first error line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

PROMPTS = [[5, 17, 3, 99, 42], [7 + i for i in range(20)], [311]]  # tests/runtime/test_parallel_artifact.py
LAYOUTS = {"tp2ep2": ("--tp", "2", "--ep", "2"), "ep4": ("--ep", "4"), "tp2": ("--tp", "2"), "ep2": ("--ep", "2")}
WORLD = {"tp2ep2": 2, "ep4": 4, "tp2": 2, "ep2": 2}


def compile_art(out: Path, preset: str, numerics: str, layout: tuple[str, ...]) -> Path:
    from fake_aot import placeholder_compile_calls

    from v4compile.cli import main
    from v4compile.codegen import aot

    keep = aot.compile_calls
    aot.compile_calls = placeholder_compile_calls(loadable=True)
    try:
        rc = main(["-q", "compile", "--preset", preset, "--numerics", numerics, "--dtype", "fp32", "--target",
                   "cpu,sm_90a", "--decode-buckets", "2", "--prefill-buckets", "16", *layout, "-o", str(out)])
    finally:
        aot.compile_calls = keep
    if rc:
        raise SystemExit(f"compile of {out.name} failed ({rc})")
    return out


def single(art: Path, device: str, new: int):
    """Greedy ids and every step's logits of the artifact in this process."""
    import numpy as np

    import v4compile

    kw = {"kernels": "reference"} if device == "host" else {}
    sess = v4compile.load(art, device=device, threads=1, **kw)
    steps, run = [], sess.backend.run
    sess.backend.run = lambda f, i: steps.append(run(f, i).copy()) or steps[-1]
    ids = sess.generate(PROMPTS, new)
    sess.close()
    return [t for seq in ids for t in seq], np.concatenate(steps)


def cell(tmp: Path, art: Path, world: int, device: str, new: int, ref) -> dict:
    import numpy as np

    from dist_launch import launch

    (tmp / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "new": new}))
    t0 = time.monotonic()
    runs = launch([sys.executable, str(TESTS / "parallel_worker.py"), str(tmp), str(tmp / "prompts.json"), str(art)],
                  world, timeout_s=1800, env={"V4_TEST_DEVICE": device})
    secs = time.monotonic() - t0
    bad = [(r, code, err) for r, (code, _, err) in enumerate(runs) if code != 0]
    if bad:
        r, code, err = bad[0]
        last = (err.strip().splitlines() or [""])[-1][:160]
        return {"ids_equal": False, "error": f"rank {r} exit {code}: {last}", "seconds": secs}
    ids, logits = ref
    scale = float(np.abs(logits).max())
    got = [np.load(tmp / f"rank-{r}.npz") for r in range(world)]
    same = all(g["ids-0"].tolist() == ids for g in got)
    err = max(float(np.abs(g["logits-0"] - logits).max()) if g["logits-0"].shape == logits.shape else float("inf")
              for g in got)
    ranks_equal = all(np.array_equal(g["logits-0"], got[0]["logits-0"]) for g in got)
    return {"ids_equal": same, "err_over_scale": err / scale, "ranks_bit_equal": ranks_equal, "seconds": secs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,tiny-pro")
    ap.add_argument("--numerics", default="official,hf")
    ap.add_argument("--layouts", default="tp2ep2,ep4")
    ap.add_argument("--devices", default="cpu,host")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", help="working directory (default: a temporary one)")
    a = ap.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="parallel-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    head = f"{'preset':9} {'numerics':9} {'layout':7} {'ranks':>5} {'device':6} {'ids equal':9} {'max err / scale':>15} {'s':>6}"
    print(head, flush=True)
    for preset in a.presets.split(","):
        for numerics in a.numerics.split(","):
            base = compile_art(work / f"{preset}-{numerics}-1", preset, numerics, ())
            refs = {d: single(base, d, a.new) for d in a.devices.split(",")}
            for lay in a.layouts.split(","):
                art = compile_art(work / f"{preset}-{numerics}-{lay}", preset, numerics, LAYOUTS[lay])
                for dev in a.devices.split(","):
                    tmp = work / f"run-{preset}-{numerics}-{lay}-{dev}"
                    tmp.mkdir(exist_ok=True)
                    c = cell(tmp, art, WORLD[lay], dev, a.new, refs[dev])
                    err = f"{c['err_over_scale']:.1e}" if "err_over_scale" in c else c["error"]
                    line = (f"{preset:9} {numerics:9} {lay:7} {WORLD[lay]:>5} {dev:6} "
                            f"{'yes' if c['ids_equal'] else 'NO':9} {err:>15} {c['seconds']:6.0f}")
                    print(line, flush=True)
                    rows.append({"preset": preset, "numerics": numerics, "layout": lay, "ranks": WORLD[lay],
                                 "device": dev, **c})
    (work / "matrix.json").write_text(json.dumps(rows, indent=1))
    print(f"(rows in {work / 'matrix.json'})")
    return 0 if all(r["ids_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
