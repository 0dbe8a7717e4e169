"""One rank of a partitioned GPU-target artifact on the fake CUDA driver and the fake NCCL, for
tests/runtime/test_parallel_artifact.py:

    python parallel_gpu_worker.py OUT ART FAKE_DRIVER FAKE_NCCL STEPS

Joins the process group from torchrun's environment, loads the artifact through `ProgramBackend` (device
cuda: the real path, which joins the NCCL communicators with their ids through the store) with two
test-only substitutions: the fake driver's code objects for the binaries (its kernels run nothing) and
no binary read. Runs STEPS decode steps as a captured graph, then writes `OUT/rank-<r>.json`: the
differences between what NCCL received and the program's collectives (`test_fake_nccl.differences`: empty
when exact), the collectives per step, the communicators NCCL created, the unique ids this rank made and
the ids it joined with. A V4Error prints one `error:` line and exits with status 2.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "runtime")]


def main(out: Path, art_path: str, driver: str, nccl_path: str, steps: int) -> int:
    import v4compile.runtime.program_backend as pb
    from runtime_helpers import Fake, fake_table
    from test_fake_nccl import Nccl, _inputs, differences, expected
    from v4compile.artifact import load_artifact
    from v4compile.errors import V4Error
    from v4compile.parallel import ParallelLayout
    from v4compile.runtime.distributed import join
    from v4compile.runtime.kernels import make_kernel_calls

    rank = int(os.environ["RANK"])
    os.environ["FAKE_NCCL_DRIVER"] = driver
    made, joined = [], []
    unique_id = pb.comm_unique_id
    pb.comm_unique_id = lambda *a, **k: made.append(unique_id(*a, **k)) or made[-1]

    class Runtime(pb.CRuntime):
        def comm_init(self, r, ids, lib=None):
            joined.append({str(k): v.hex() for k, v in ids.items()})
            super().comm_init(r, ids, lib)

    pb.CRuntime = functools.partial(Runtime, table=fake_table())
    pb.artifact_binaries = lambda art, device: None
    ranks = None
    try:
        art = load_artifact(art_path)
        p = art.manifest["parallel"]
        ranks = join(ParallelLayout(p["tp"], p["ep"]))
        fake, nccl = Fake("cuda"), Nccl()
        assert fake.path == driver and nccl.path == nccl_path
        be = pb.ProgramBackend(art, "cuda", driver_lib=driver, ranks=ranks, comm_lib=nccl_path)
        fname = next(n for n in be.functions() if n.startswith("decode"))
        for s in range(steps):
            be.rt.run(fname, _inputs(be.program, fname, s), graph=True)
        calls = make_kernel_calls()
        colls, _ = expected(be.rt, be.program, fname, calls)
        diffs = differences(be.rt, be.program, nccl, fake, steps, fname, calls)
        res = {"differences": [list(map(str, d)) for d in diffs],
               "collectives": len(colls), "comms": [[n, r, i.hex()] for n, r, i in nccl.comms()],
               "made": [m.hex() for m in made], "joined": joined, "captures": fake.counts()["captures"]}
        be.rt.close()
        (out / f"rank-{rank}.json").write_text(json.dumps(res))
        return 0
    except V4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if ranks is not None:
            ranks.close()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
