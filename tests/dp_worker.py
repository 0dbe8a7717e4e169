"""One rank of a data-parallel artifact (`compile --dp N`) under torchrun's environment, for
tests/runtime/test_dp_artifact.py:

    python dp_worker.py OUT PROMPTS.json ART

For each device of `V4_TEST_DEVICES` (comma-separated: cpu, host with the ops' reference kernels, and
`spec`: the cpu device decoding speculatively, the MTP block drafting K tokens a step, on the artifact
SPEC_ART (a cpu-only one: the GPU programs carry no MTP block); `nocache`: the cpu device with the prefix
cache off; `die`: the cpu device
once more, in which rank 1 exits abruptly at its third decode step), in one process
group joined here once: loads ART, generates the prompts (`{"prompts": [...], "new": N, "draft_tokens": K, "spec_art": SPEC_ART, "nccl_art": NCCL_ART}`) and writes
`OUT/<device>-rank-<r>.npz`: the ids (`ids`, `lens`), every logits row each request sampled from, in its
order (`rows-<i>`, request i), where the sequences were (`placed`: per decode step, the live
sequences of each replica; `replicas`: each request's), and each prompt's tokens taken from its replica's
prefix cache (`cached`). `oneshot_off`: the host device on the first two prompts, ONESHOT_NEW tokens, on NCCL_ART
(the program compiled with `--allreduce nccl`: the rows collectives on gloo), the references but for layer 1's MoE
at decode (the seam before it, `mhc_post_pre`, and `moe_router_experts_dp`, by their kernels, interpreted); `oneshot`:
the same on ART, the references but for layer 1's MoE at decode with the seam before it and its one-shot all-gather and
reduce-scatter of rows folded in (`mhc_ag_moe_router_experts_dp_rs`: `moe_router.moe_fused_kernel`, the seam first,
the seam's pointers through the call's table, its leading phase and trailing part `allreduce.rows_tiles` /
`scatter_tiles`; or, where the artifact has them apart, those launches: `rows_kernel`),
interpreted, the symmetric regions in shared memory; the mode and each call's kernel name appended to
`OUT/oneshot-ran-<r>.txt`; `oneshot_reversed`: the same with the all-gather placing the ranks' rows in reverse
order (a broken kernel, as tests/allreduce_worker.py edits it).
A V4Error prints one `error:` line and exits with status 2. The rank prints
`dist_launch.print_ready`'s line after its imports, and `DIE_START <time.time()>` before the `die` run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def main(out: Path, prompts_file: Path, art: str) -> int:
    import onnxruntime  # noqa: F401 (imported by the load: before the ready line)
    import torch.distributed  # noqa: F401

    import v4compile.runtime.cpu_backend  # noqa: F401
    import v4compile.runtime.distributed  # noqa: F401
    from dist_launch import print_ready, run_rank

    devices = os.environ.get("V4_TEST_DEVICES", "cpu").split(",")
    if any(d.startswith("oneshot") for d in devices):
        os.environ["TRITON_INTERPRET"] = "1"  # (before a kernel module is imported)
        os.environ["V4_TEST_DIR"] = str(out)
        rows_kernels()
    print_ready()
    spec = json.loads(prompts_file.read_text())

    def body(rank: int) -> None:
        for device in devices:
            if device == "die":
                print(f"{DIE_START} {time.time():.3f}", file=sys.stderr, flush=True)
            np.savez(out / f"{device}-rank-{rank}.npz",
                     **generate(spec["spec_art"] if device == "spec" else spec["nccl_art"] if device == "oneshot_off"
                                else art, device, spec, rank))

    return run_rank(body)


DIE_START = "v4-test-die-start"
ONESHOT_NEW = 4
REVERSED = (("owner = idx // PART", "owner = GROUP - 1 - idx // PART"),)  # the all-gather's rows in reverse order
# what the folded launch computes, unfolded (NCCL_ART's): the seam before the MoE and the MoE, by their kernels
UNFOLDED = ("mhc_post_pre", "moe_router_experts_dp")


def rows_kernels() -> None:
    """The host device's kernels modes `oneshot` / `oneshot_reversed` (the module docstring): layer 1's one-shot
    rows collectives at decode by their kernel (the Triton interpreter being slow: one layer), every other launch
    by its reference (the one-shots' on gloo)."""
    import v4compile.runtime.program_backend as pb
    from allreduce_worker import edited, kernel_variant
    from v4compile.codegen.kernels import moe_router
    from v4compile.codegen.program_kernels import calls_of
    from v4compile.ops.fused_allreduce import rows_folded
    from v4compile.runtime.kernels import kernel_calls_for

    def calls(l, name, edits=()):
        if not ((l.op.endswith("_rows_oneshot") or rows_folded(l.op) or l.op in UNFOLDED)
                and l.loc.startswith("layers.1.") and l.operands[0][1].type.shape[1] == 1):  # decode only
            return None
        out = calls_of(l)
        with open(Path(os.environ["V4_TEST_DIR"]) / f"oneshot-ran-{os.environ['RANK']}.txt", "a") as f:
            f.write(f"{name} {out[0].name}\n")  # (the test checks which kernels ran)
        if edits and out[0].constexprs.get("GATHER"):
            out[0].fn = kernel_variant(edits)[1]
        return out

    rows_tiles = moe_router.rows_tiles

    def mode(name):
        # the folded MoE's leading phase calls moe_router's import of `rows_tiles`: the edited one in the broken
        # mode (the interpreter looks it up as the kernel runs; the modes' runs come one after another)
        moe_router.rows_tiles = edited(REVERSED)["rows_tiles"] if name == "oneshot_reversed" else rows_tiles
        return lambda l: calls(l, name, REVERSED if name == "oneshot_reversed" else ())

    pb.kernel_calls_for = lambda m, dev: mode(m) if m.startswith("oneshot") else kernel_calls_for(m, dev)


def generate(art: str, device: str, spec: dict, rank: int) -> dict[str, np.ndarray]:
    import v4compile
    from v4compile.runtime.batcher import Batcher

    die_at = 3 if device == "die" else 0
    speculative = device == "spec"
    cache = device != "nocache"
    kernels = device if device.startswith("oneshot") else "reference"
    # the one-shot runs: two prompts (one a replica), a few tokens (the kernels are interpreted)
    prompts, new = ((spec["prompts"][:2], ONESHOT_NEW) if device.startswith("oneshot")
                    else (spec["prompts"], spec["new"]))
    device = "cpu" if device in ("die", "spec", "nocache") else "host" if device.startswith("oneshot") else device
    rows: dict[int, list] = {}
    replicas: dict[int, int] = {}
    placed: list = []
    sess = v4compile.load(art, device=device, threads=1, prefix_cache=cache,
                          **({"kernels": kernels} if device == "host" else {}))
    decode = sess.decode

    def recorded_decode(seqs, tokens):
        if rank == 1 and len(placed) + 1 == die_at:
            os._exit(3)  # no clean-up, no goodbye: as a killed process
        placed.append([sum(1 for s in seqs if s.replica == d) for d in range(sess.dp)])
        return decode(seqs, tokens)

    pick = Batcher._pick

    def recorded_pick(self, r, row):
        rows.setdefault(r.index, []).append(np.asarray(row, dtype=np.float32).copy())
        replicas[r.index] = r.seq.replica
        return pick(self, r, row)

    sess.decode = recorded_decode
    Batcher._pick = recorded_pick
    try:
        ids = sess.generate(prompts, new, **({"speculative": "mtp", "draft_tokens": spec["draft_tokens"]}
                                                            if speculative else {}))
        cached = list(sess.last_cached_tokens)
    finally:
        Batcher._pick = pick
        sess.close()
    return {"ids": np.asarray([x for seq in ids for x in seq], dtype=np.int64),
            "lens": np.asarray([len(seq) for seq in ids], dtype=np.int64), "placed": np.asarray(placed),
            "replicas": np.asarray([replicas.get(i, -1) for i in range(len(ids))]), "cached": np.asarray(cached),
            **{f"rows-{i}": np.stack(v) for i, v in rows.items()}}


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
