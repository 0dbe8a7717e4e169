"""One rank of a data-parallel artifact (`compile --dp N`) under torchrun's environment, for
tests/runtime/test_dp_artifact.py:

    python dp_worker.py OUT PROMPTS.json ART

Loads ART (device `V4_TEST_DEVICE`: cpu, or host with the ops' reference kernels), generates the prompts
(`{"prompts": [...], "new": N}`) and writes `OUT/rank-<r>.npz`: the ids (`ids`, `lens`), every logits row
each request sampled from, in its order (`rows-<i>`), and the replica of each step's sequences
(`placed`: per decode step, the number of live sequences of each replica). A V4Error prints one `error:`
line and exits with status 2. `V4_TEST_DIE_AT=K`: rank 1 exits abruptly at its K-th step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def main(out: Path, prompts_file: Path, art: str) -> int:
    import onnxruntime  # noqa: F401 (imported by the load: before the ready line)

    import v4compile
    import v4compile.runtime.cpu_backend  # noqa: F401
    from dist_launch import print_ready
    from v4compile.errors import V4Error
    from v4compile.runtime.batcher import Batcher

    print_ready()
    spec = json.loads(prompts_file.read_text())
    rank = int(os.environ["RANK"])
    die_at = int(os.environ.get("V4_TEST_DIE_AT", "0"))
    device = os.environ.get("V4_TEST_DEVICE", "cpu")
    kw = {"kernels": "reference"} if device == "host" else {}
    rows: dict[int, list] = {}
    placed: list = []
    pick = Batcher._pick

    def recorded_pick(self, r, row):
        rows.setdefault(r.index, []).append(np.asarray(row, dtype=np.float32).copy())
        return pick(self, r, row)

    Batcher._pick = recorded_pick
    try:
        sess = v4compile.load(art, device=device, threads=1, **kw)
        decode, steps = sess.decode, [0]

        def recorded_decode(seqs, tokens):
            steps[0] += 1
            if rank == 1 and die_at and steps[0] == die_at:
                os._exit(3)  # no clean-up, no goodbye: as a killed process
            placed.append([sum(1 for s in seqs if s.replica == d) for d in range(sess.dp)])
            return decode(seqs, tokens)

        sess.decode = recorded_decode
        ids = sess.generate(spec["prompts"], spec["new"])
        sess.close()
        res = {"ids": np.asarray([x for seq in ids for x in seq], dtype=np.int64),
               "lens": np.asarray([len(seq) for seq in ids], dtype=np.int64), "placed": np.asarray(placed)}
        res.update({f"rows-{i}": np.stack(v) for i, v in rows.items()})
        np.savez(out / f"rank-{rank}.npz", **res)
        return 0
    except V4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
