"""One rank of a partitioned function's ONNX segments under torch.distributed (gloo), for
`test_partition.py`: `python dist_worker.py DIR` with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). DIR holds `plan.json` (tp, ep, the segments' files and the collective after
each), `rank-<r>.npz` (the rank's weights), `inputs.npz` and `states.npz`; the rank writes its logits to
`out-<r>.npz`. A V4Error or a failed collective (a rank that never arrives: the group's timeout) prints
one `error:` line and exits with status 2. The rank prints `dist_launch.print_ready`'s line after its
imports."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def main(d: Path) -> int:
    import onnxruntime as ort
    import torch.distributed  # noqa: F401 (imported by `join`: before the ready line)

    from dist_launch import print_ready
    from v4compile.errors import V4Error
    from v4compile.parallel import ParallelLayout
    from v4compile.runtime.distributed import join, run_segment

    print_ready()

    plan = json.loads((d / "plan.json").read_text())
    ranks = None
    try:
        ranks = join(ParallelLayout(plan["tp"], plan["ep"]), timeout_s=float(plan["timeout_s"]))
        r = ranks.rank
        load = (lambda name: dict(np.load(d / name, allow_pickle=False)))
        weights, env, state = load(f"rank-{r}.npz"), load("inputs.npz"), load("states.npz")
        for seg in plan["segments"]:
            sess = ort.InferenceSession(str(d / seg["file"]), providers=["CPUExecutionProvider"])
            run_segment(sess, env, state, weights)
            c = seg["collective"]
            if c is not None:
                env[c["result"]] = ranks.all_reduce(env[c["operand"]], c["group"])
        np.savez(d / f"out-{r}.npz", logits=env["logits"])
        return 0
    except V4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # torch.distributed: a timeout, a peer gone
        print(f"error: rank {os.environ.get('RANK')}: collective failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    finally:
        if ranks is not None:
            ranks.close()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
