"""The done-when matrix of issue 18: partitioned artifacts against the same model in one process.

    python bench/parallel_matrix.py [--presets tiny,tiny-pro] [--numerics official,hf]
                                    [--layouts tp2ep2,ep4,dp2ep2,dp4ep4] [--devices cpu,host] [--new 32] [--out DIR]

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

Data-parallel layouts (`dp2ep2`, `dp4ep4`; `compile --dp`): the ranks run tests/dp_worker.py on five ragged
prompts (more than a replica's decode bucket holds: the last waits and then runs alone on its replica);
the error is that of every logits row a request sampled from against the single-process run's rows.
`dp2tp2ep4`: two replicas of two ranks (attention heads split inside a replica, the experts over all four).
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
DP_PROMPTS = PROMPTS + [[8, 9], [40 + i for i in range(7)]]  # tests/runtime/test_dp_artifact.py
LAYOUTS = {"tp2ep2": ("--tp", "2", "--ep", "2"), "ep4": ("--ep", "4"), "tp2": ("--tp", "2"), "ep2": ("--ep", "2"),
           "dp2ep2": ("--dp", "2", "--ep", "2"), "dp4ep4": ("--dp", "4", "--ep", "4"),
           "dp2tp2ep4": ("--dp", "2", "--tp", "2", "--ep", "4")}
WORLD = {"tp2ep2": 2, "ep4": 4, "tp2": 2, "ep2": 2, "dp2ep2": 2, "dp4ep4": 4, "dp2tp2ep4": 4}


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
        raise CompileFailed(f"compile of {out.name} failed ({rc})")
    return out


class CompileFailed(Exception):
    pass


def single_rows(art: Path, device: str, new: int):
    """Greedy ids and each request's logits rows (the data-parallel cells' reference)."""
    import numpy as np

    import v4compile
    from v4compile.runtime.batcher import Batcher

    rows: dict[int, list] = {}
    pick = Batcher._pick
    Batcher._pick = lambda self, r, row: rows.setdefault(r.index, []).append(np.asarray(row, np.float32)) or \
        pick(self, r, row)
    try:
        kw = {"kernels": "reference"} if device == "host" else {}
        sess = v4compile.load(art, device=device, threads=1, **kw)
        ids = sess.generate(DP_PROMPTS, new)
        sess.close()
    finally:
        Batcher._pick = pick
    return [t for seq in ids for t in seq], {i: np.stack(v) for i, v in rows.items()}


def _ranks(tmp: Path, worker: str, prompts, art: Path, world: int, new: int, env: dict) -> tuple[float, dict | None]:
    """Run `worker` on `world` ranks over the prompts: its seconds, and the cell of the first failing rank (None
    when every rank exited 0; each wrote its results under `tmp`)."""
    from dist_launch import launch

    (tmp / "prompts.json").write_text(json.dumps({"prompts": prompts, "new": new}))
    t0 = time.monotonic()
    runs = launch([sys.executable, str(TESTS / worker), str(tmp), str(tmp / "prompts.json"), str(art)],
                  world, timeout_s=1800, env=env)
    secs = time.monotonic() - t0
    bad = [(r, code, err) for r, (code, _, err) in enumerate(runs) if code != 0]
    if not bad:
        return secs, None
    r, code, err = bad[0]
    last = (err.strip().splitlines() or [""])[-1][:160]
    return secs, {"ids_equal": False, "error": f"rank {r} exit {code}: {last}", "seconds": secs}


def dp_cell(tmp: Path, art: Path, world: int, device: str, new: int, ref) -> dict:
    import numpy as np

    secs, failed = _ranks(tmp, "dp_worker.py", DP_PROMPTS, art, world, new, {"V4_TEST_DEVICES": device})
    if failed:
        return failed
    ids, rows = ref
    scale = max(float(np.abs(v).max()) for v in rows.values())
    got = [np.load(tmp / f"{device}-rank-{r}.npz") for r in range(world)]
    same = all(g["ids"].tolist() == ids for g in got)
    err = max(float(np.abs(g[f"rows-{i}"] - v).max()) if g[f"rows-{i}"].shape == v.shape else float("inf")
              for g in got for i, v in rows.items())
    return {"ids_equal": same, "err_over_scale": err / scale, "seconds": secs}


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

    secs, failed = _ranks(tmp, "parallel_worker.py", PROMPTS, art, world, new, {"V4_TEST_DEVICE": device})
    if failed:
        return failed
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
            refs, dp_refs = {}, {}
            for lay in a.layouts.split(","):
                dp = lay.startswith("dp")
                try:
                    art = compile_art(work / f"{preset}-{numerics}-{lay}", preset, numerics, LAYOUTS[lay])
                except CompileFailed as e:
                    print(f"{preset:9} {numerics:9} {lay:7} {WORLD[lay]:>5} {'-':6} {'-':9} {str(e)}", flush=True)
                    rows.append({"preset": preset, "numerics": numerics, "layout": lay, "ids_equal": None,
                                 "error": str(e)})
                    continue
                for dev in a.devices.split(","):
                    tmp = work / f"run-{preset}-{numerics}-{lay}-{dev}"
                    tmp.mkdir(exist_ok=True)
                    if dp:
                        if dev not in dp_refs:
                            dp_refs[dev] = single_rows(base, dev, a.new)
                        c = dp_cell(tmp, art, WORLD[lay], dev, a.new, dp_refs[dev])
                    else:
                        if dev not in refs:
                            refs[dev] = single(base, dev, a.new)
                        c = cell(tmp, art, WORLD[lay], dev, a.new, refs[dev])
                    err = f"{c['err_over_scale']:.1e}" if "err_over_scale" in c else c["error"]
                    line = (f"{preset:9} {numerics:9} {lay:7} {WORLD[lay]:>5} {dev:6} "
                            f"{'yes' if c['ids_equal'] else 'NO':9} {err:>15} {c['seconds']:6.0f}")
                    print(line, flush=True)
                    rows.append({"preset": preset, "numerics": numerics, "layout": lay, "ranks": WORLD[lay],
                                 "device": dev, **c})
    (work / "matrix.json").write_text(json.dumps(rows, indent=1))
    print(f"(rows in {work / 'matrix.json'})")
    return 0 if all(r["ids_equal"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
