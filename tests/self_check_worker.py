"""One rank of a partitioned artifact's self-check under torchrun's environment, for
tests/runtime/test_self_check_host.py:

    python self_check_worker.py OUT ART [PICKS_ART DP_ART]

Joins the gloo group once, then runs `Session.self_check()` on the cpu device twice: as compiled, then with the
planted fault (rank 1 maps rank 0's weights: `Artifact.weights` asked for rank 0 on every rank); then the faulty
one on the host device (the ops' reference kernels), whose ranks localise the layer through the C runtime's
probes. PICKS_ART (bf16: near ties everywhere, so the rows judged depend on the ranks' router picks) is checked as
compiled on the cpu device, again with the picks unread (`ChoiceReader.attach` giving None: the broken variant),
and on the host device; DP_ART (data parallel, its routers on the gathered rows of both replicas) on the cpu
device as compiled, then with each rank reading the other replica's block of the gathered rows (broken).
Writes `OUT/rank-<r>.json`: each run's `SelfCheckResult.to_json()`. Prints `dist_launch.print_ready`'s line
after its imports."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path


def main(out: Path, art: str, more: list[str]) -> int:
    import numpy as np
    import onnxruntime  # noqa: F401 (imported by the load: before the ready line)
    import torch.distributed as dist

    import v4compile
    import v4compile.runtime.cpu_backend  # noqa: F401
    from dist_launch import print_ready
    from v4compile.artifact import Artifact
    from v4compile.runtime.self_check import ChoiceReader
    from v4compile.runtime.distributed import timeout_from_env

    print_ready()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_from_env()))
    res = []
    by_rank = Artifact.weights
    try:
        for device, fault in (("cpu", False), ("cpu", True), ("host", True)):
            if fault:
                Artifact.weights = lambda self, rank=0: by_rank(self, 0)
            sess = (v4compile.load(art, device="cpu", threads=1) if device == "cpu" else
                    v4compile.load(art, device="host", kernels="reference"))
            res.append(sess.self_check().to_json())
            sess.close()
        Artifact.weights = by_rank
        record, attach = ChoiceReader.record, ChoiceReader.__dict__["attach"]

        def other_block(self, inputs, outs):  # dp 2: the gathered rows' halves swapped
            return record(self, inputs, {k: tuple(None if a is None else np.roll(a.reshape(-1, a.shape[-1]),
                                                                               a.size // a.shape[-1] // 2, 0)
                                                  for a in v) for k, v in outs.items()})

        picks, dp = more or (None, None)
        runs = [(picks, "cpu", None, None), (picks, "cpu", "attach", classmethod(lambda cls, s, g: None)),
                (picks, "host", None, None), (dp, "cpu", None, None), (dp, "cpu", "record", other_block)]
        for a, device, name, broken in runs if more else ():
            sess = (v4compile.load(a, device="cpu", threads=1) if device == "cpu" else
                    v4compile.load(a, device="host", kernels="reference"))
            if name is not None:
                setattr(ChoiceReader, name, broken)
            try:
                res.append(sess.self_check().to_json())
            finally:
                ChoiceReader.record, ChoiceReader.attach = record, attach
                sess.close()
    finally:
        Artifact.weights = by_rank
        dist.destroy_process_group()
    (out / f"rank-{rank}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:]))
