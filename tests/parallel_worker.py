"""One rank of partitioned artifacts loaded with `v4compile.load` under torchrun's environment, for
tests/runtime/test_parallel_artifact.py:

    python parallel_worker.py OUT PROMPTS.json ART [ART ...]

For each artifact: load it (device `V4_TEST_DEVICE`: cpu, or host with the reference kernels or
`V4_TEST_KERNELS`), generate PROMPTS.json's prompts (`{"prompts": [...], "new": N}`,
continuous batching over the decode bucket), recording every step's logits; writes `OUT/rank-<r>.npz`
(`ids-<i>`, `logits-<i>` per artifact i; `V4_TEST_KERNELS`: the host device's kernels, one mode or one per
artifact, `oneshot` the references but for the one-shot all-reduce's kernel and the launches it is folded into,
`oneshot_skipped` the same with the leading folded phase broken, `oneshot_unsummed` with the trailing one broken). The process group is joined here once, so one launch checks
several artifacts of the same world size. `V4_TEST_DIE_AT=K` (tests of a rank that dies): rank 1 exits
abruptly at its K-th step. `V4_TEST_NCCL=FAKE_DRIVER:FAKE_NCCL`: then the first artifact's GPU program on the
fake CUDA driver and fake NCCL (`parallel_gpu_worker.nccl_check`), written to `OUT/nccl-<r>.json`. A V4Error prints one `error:` line and exits with status 2.
The rank prints `dist_launch.print_ready`'s line after its imports. `V4_TEST_FAULT=local rank` (the planted
fault of a test): each rank maps the weights of its LOCAL_RANK instead of its global rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def main(out: Path, prompts_file: Path, arts: list[str]) -> int:
    import onnxruntime  # noqa: F401 (imported by the load: before the ready line)
    import torch.distributed  # noqa: F401

    import v4compile
    import v4compile.runtime.cpu_backend  # noqa: F401
    from dist_launch import print_ready, run_rank
    from v4compile.runtime.distributed import timeout_from_env

    print_ready()
    if os.environ.get("V4_TEST_FAULT") == "local rank":  # the planted fault: weights picked by LOCAL_RANK
        from v4compile.artifact import Artifact

        by_global = Artifact.weights
        Artifact.weights = lambda self, rank=0: by_global(self, int(os.environ["LOCAL_RANK"]))

    spec = json.loads(prompts_file.read_text())
    die_at = int(os.environ.get("V4_TEST_DIE_AT", "0"))
    device = os.environ.get("V4_TEST_DEVICE", "cpu")
    # host: the ops' references (fast; see the test), or V4_TEST_KERNELS=auto: the Triton kernels, interpreted;
    # V4_TEST_KERNELS=oneshot: the references but for the one-shot all-reduce's kernel (interpreted, its regions
    # in shared memory, mapped by the peers), standalone or folded into its consumer's launch. A comma-separated
    # list: the i-th artifact's mode.
    modes = os.environ.get("V4_TEST_KERNELS", "reference").split(",")
    if "oneshot" in modes:
        import v4compile.runtime.program_backend as pb
        from v4compile.codegen.program_kernels import calls_of
        from v4compile.ops.fused_allreduce import CONSUMERS, consumer_of, producer_of
        from v4compile.runtime.kernels import kernel_calls_for

        os.environ["TRITON_INTERPRET"] = "1"
        # the one-shot's launches; layer 1's MoE and the next attention's front where the all-reduces are folded
        # into them (`ar_mhc_moe_ep_ar`: the MoE's one launch, the attention's all-reduce its leading phase, its own
        # a trailing part; the front then reads the reduced MoE output) or, unfolded, those ops (the same kernels:
        # a bit-for-bit comparison; the Triton interpreter being slow: decode steps only); the other layers' and
        # prefill's by the reference (a folded op's sums on gloo, at 2 ranks the kernel's a + b). `V4_TEST_FOLDED`
        # lists the folded launches whose kernel runs
        folded = os.environ.get("V4_TEST_FOLDED")

        def oneshot_calls(l):
            if l.op != "all_reduce_oneshot" and (not consumer_of(l.op) and l.op not in CONSUMERS
                                                 or not l.loc.startswith(("layers.1.ffn", "layers.2.attn"))
                                                 or dict(l.operands)["y"].type.shape[-2] != 1):  # decode only
                return None
            calls = calls_of(l)
            if folded and (consumer_of(l.op) or producer_of(l.op)):
                with open(folded, "a") as f:
                    f.write(calls[0].name + "\n")
            return calls

        def skipped_calls(l):
            """The broken fold of mode `oneshot_skipped`: the leading phase's programs publish without reducing
            (no tile: AR_NUMEL 0), so the consumer reads whatever its scratch held."""
            calls = oneshot_calls(l)
            if calls and consumer_of(l.op):
                calls[0].constexprs["AR_NUMEL"] = 0
            return calls

        def unsummed_calls(l):
            """The broken fold of mode `oneshot_unsummed`: the trailing part neither publishes nor sums (no tile:
            TR_NUMEL 0), so the MoE's output stays this rank's partial."""
            calls = oneshot_calls(l)
            if calls and calls[0].constexprs.get("NP", 0) > 0:
                calls[0].constexprs["TR_NUMEL"] = 0
            return calls

        broken = {"oneshot": oneshot_calls, "oneshot_skipped": skipped_calls, "oneshot_unsummed": unsummed_calls}
        pb.kernel_calls_for = lambda mode, dev: broken[mode] if mode in broken else kernel_calls_for(mode, dev)

    def body(rank: int) -> None:
        res = {}
        for i, art in enumerate(arts):
            kw = {"kernels": modes[min(i, len(modes) - 1)]} if device == "host" else {}
            sess = v4compile.load(art, device=device, threads=1, **kw)  # ranks share the cores
            steps, run = [], sess.backend.run

            def recorded(fname, inputs, run=run, steps=steps):
                if rank == 1 and die_at and len(steps) + 1 == die_at:
                    os._exit(3)  # no clean-up, no goodbye: as a killed process
                steps.append(run(fname, inputs).copy())
                return steps[-1]

            sess.backend.run = recorded
            ids = sess.generate(spec["prompts"], spec["new"])
            res[f"ids-{i}"] = np.asarray([x for seq in ids for x in seq], dtype=np.int64)
            res[f"lens-{i}"] = np.asarray([len(seq) for seq in ids], dtype=np.int64)
            res[f"logits-{i}"] = np.concatenate(steps)
            sess.close()
        np.savez(out / f"rank-{rank}.npz", **res)
        if os.environ.get("V4_TEST_NCCL"):  # then the first artifact on the fake CUDA driver and fake NCCL
            from parallel_gpu_worker import nccl_check
            from v4compile.parallel import ParallelLayout
            from v4compile.runtime.distributed import Ranks

            p = json.loads((Path(arts[0]) / "manifest.json").read_text())["parallel"]
            driver, nccl = os.environ["V4_TEST_NCCL"].split(":")
            got = nccl_check(arts[0], Ranks(ParallelLayout(p["tp"], p["ep"]), owns=False, timeout_s=timeout_from_env()),
                             driver, nccl, 3)
            (out / f"nccl-{rank}.json").write_text(json.dumps(got))

    return run_rank(body)

if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]))
