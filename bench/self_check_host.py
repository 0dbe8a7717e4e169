"""The self-check on the host device (issue 35), clean and with one deliberately broken kernel: minutes on a
busy 2-core machine (every kernel interpreted), so outside the test suite.

    python bench/self_check_host.py [--steps N] [--artifact DIR]

Compiles tiny (hf, fp32, decode buckets 1,2, prefill chunk 16, context 64) with its golden unless --artifact
names one, then runs `Session.self_check()` on the host device twice: as compiled, and with `hc_expand_kernel`
(the embedding's mHC expansion, `codegen/kernels/mhc.py`) storing x * 1.001 (the tests' broken-kernel helper,
`tests/kernel_check.install_broken_kernel`). `--steps N` checks the golden's first N steps only (default: all).
Prints each run's lines; exit 0 when the clean run passes and the broken one fails at step 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module loads
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class _Patch:
    """monkeypatch's setattr, for a script."""

    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def close(self):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--artifact", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    import v4compile
    import v4compile.runtime.self_check as SC
    from kernel_check import install_broken_kernel
    from v4compile import frontend
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_artifact
    from v4compile.codegen.kernels import mhc
    from v4compile.golden import Golden
    from v4compile.trace import TraceOptions

    work = Path(tempfile.mkdtemp(prefix="v4-self-check-"))
    art = args.artifact
    if art is None:
        fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
        art = compile_artifact(fe, work / "tiny", Buckets(decode=(1, 2), prefill=(16,)), golden=True)
    patch = _Patch()
    if args.steps:
        real, n = SC.read_golden, args.steps

        def first_steps(a):
            g = real(a)
            f = {**g.facts, "new_tokens": n, "ids": [i[:n] for i in g.facts["ids"]]}
            cut = ("logits", "margin", "topk_values", "topk_ids", "lse", "choice_margin", "indexer_margin")
            return Golden(f, {k: v[:, :n] if k in cut else v for k, v in g.tensors.items()})
        patch.setattr(SC, "read_golden", first_steps)
    results = []
    for broken in (False, True):
        if broken:
            install_broken_kernel(patch, work, mhc, "hc_expand_kernel", "out_ptr + t * O_S + k * O_SN + c, x,",
                                  "out_ptr + t * O_S + k * O_SN + c, x * 1.001,")
        t0 = time.perf_counter()
        r = v4compile.load(art, device="host").self_check()
        print(f"--- host, {'broken hc_expand_kernel' if broken else 'as compiled'} ({time.perf_counter() - t0:.0f} s)")
        print("\n".join(r.lines()), flush=True)
        results.append(r)
    patch.close()
    clean, bad = results
    return 0 if clean.passed and not bad.passed and bad.first_step == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
