"""The fake-NCCL check of one rank of a partitioned GPU-target artifact, for
tests/runtime/test_parallel_artifact.py (run by tests/parallel_worker.py after its generation, when
`V4_TEST_NCCL=FAKE_DRIVER:FAKE_NCCL`, in the same process group: one launch of the ranks for both).

`nccl_check(art, ranks, driver, nccl_path, steps)` loads the artifact through `ProgramBackend` (device
cuda: the real path, which joins the NCCL communicators with their ids through the store) with two
test-only substitutions: the fake driver's code objects for the binaries (its kernels run nothing) and no
binary read. It runs `steps` decode steps as a captured graph and returns: the differences between what
NCCL received and the program's collectives (`test_fake_nccl.differences`: empty when exact), the
collectives per step, the communicators NCCL created, the unique ids this rank made and the ids it
joined with, the graph captures, and the fake's IPC counts (the one-shot all-reduce's regions) while loaded
and after the close.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def nccl_check(art_path: str, ranks, driver: str, nccl_path: str, steps: int) -> dict:
    import os

    sys.path.insert(0, str(HERE / "runtime"))
    import v4compile.runtime.program_backend as pb
    from runtime_helpers import Fake, fake_table
    from test_fake_nccl import Nccl, _inputs, differences, expected
    from v4compile.artifact import load_artifact
    from v4compile.runtime.kernels import make_kernel_calls

    os.environ["FAKE_NCCL_DRIVER"] = driver
    made, joined = [], []
    keep = pb.comm_unique_id, pb.CRuntime, pb.artifact_binaries

    class Runtime(pb.CRuntime):
        def comm_init(self, r, ids, lib=None):
            joined.append({str(k): v.hex() for k, v in ids.items()})
            super().comm_init(r, ids, lib)

    pb.comm_unique_id = lambda *a, **k: made.append(keep[0](*a, **k)) or made[-1]
    pb.CRuntime = functools.partial(Runtime, table=fake_table())
    pb.artifact_binaries = lambda art, device: None
    try:
        fake, nccl = Fake("cuda"), Nccl()
        assert fake.path == driver and nccl.path == nccl_path
        be = pb.ProgramBackend(load_artifact(art_path), "cuda", driver_lib=driver, ranks=ranks, comm_lib=nccl_path)
        fname = next(n for n in be.functions() if n.startswith("decode"))
        for s in range(steps):
            be.rt.run(fname, _inputs(be.program, fname, s), graph=True)
        calls = make_kernel_calls()
        colls, _ = expected(be.rt, be.program, fname, calls)
        diffs = differences(be.rt, be.program, nccl, fake, steps, fname, calls)
        loaded = fake.ipc()
        be.rt.close()
        return {"differences": [list(map(str, d)) for d in diffs], "collectives": len(colls),
                "ipc_loaded": loaded, "ipc": fake.ipc(),
                "comms": [[n, r, i.hex()] for n, r, i in nccl.comms()], "made": [m.hex() for m in made],
                "joined": joined, "captures": fake.counts()["captures"]}
    finally:
        pb.comm_unique_id, pb.CRuntime, pb.artifact_binaries = keep
