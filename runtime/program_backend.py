"""Devices `host`, `hip`, `cuda`: an artifact's program run by the C runtime, behind the session's backend
interface (`backend.py`: `functions()`, `run(function, step inputs) -> logits`, `close()`).

The program: an artifact with GPU targets carries it (`gpu/program.txt`, hash-checked at load, parsed and
verified); `hip` / `cuda` launch the binaries compiled ahead of time for their target
(`kernels/<gfx950|sm_90a>/`, each checked against the manifest's sha256 and the call it serves), and
`host` runs the same program with the same kernels interpreted. An artifact with the cpu target only is
run on `host` from the program it carries (`program.txt`: its final IR continued through `plan_memory`
and `lower_to_program` at compile time). Decode functions run as a graph captured on their first step and
replayed after that; prefill functions run launch by launch.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from v4compile.artifact import Artifact
from v4compile.errors import ArtifactError, DeviceError
from v4compile.ir.registry import get_op
from v4compile.targets import DEVICE_TARGET, DRIVER_LIB

from .artifact_checks import check_sidecar, program_interface, program_weight_types
from .backend import FunctionInfo
from .c_backend import CRuntime, comm_unique_id
from .kernels import kernel_calls_for
from .schedule import compiled_params

log = logging.getLogger(__name__)



def gpu_entry(art: Artifact) -> dict | None:
    """The artifact's first GPU target entry (they share one program), or None."""
    return next((t for t in art.manifest["targets"] if t.get("format") == "triton-aot"), None)


def artifact_program(art: Artifact):
    """The program the artifact carries (its GPU targets', else its cpu target's), parsed and verified."""
    from v4compile import ops
    from v4compile.program.text import parse_program
    from v4compile.program.verify import verify_program

    ops.load_all()  # the program names ops of every set (its verifier and the kernel families look them up)
    entry = gpu_entry(art) or art.target("cpu")
    if "program" not in entry:
        raise ArtifactError("the artifact carries no program for the C runtime (compiled by an older version?)",
                            where=str(art.path), expected="an artifact of this version, or --device cpu")
    return verify_program(parse_program(_text(art, entry["program"], "program")))


def _text(art: Artifact, rel: str, what: str) -> str:
    try:
        return art.read_bytes(rel, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{what} is not UTF-8 text", where=rel, found=f"offset {e.start}") from None


def read_sidecar(art: Artifact, k: dict) -> dict:
    """A kernel's sidecar, strict JSON checked against the manifest and its target's limits."""
    from v4compile.safetensors_io import loads_strict

    raw = art.read_bytes(k["sidecar"], "kernel sidecar", limit=1 << 24)
    return check_sidecar(loads_strict(raw, k["sidecar"], "kernel sidecar", ArtifactError), k, k["target"])


def artifact_binaries(art: Artifact, device: str):
    """[KernelCall] -> {name: (binary, sidecar)} from the artifact's kernels for the device's target; a
    kernel the artifact lacks, or whose sidecar disagrees with the call (grid, binary, or a parameter's
    name or type), is one clear error (the files' bytes were checked against the manifest by
    `load_artifact`)."""
    target = DEVICE_TARGET[device]
    art.target(target)  # "the artifact has no 'sm_90a' target" when it was compiled without it
    have = {k["name"]: k for k in art.manifest["kernels"] if k["target"] == target}

    def get(kcs) -> dict:
        out = {}
        for kc in kcs:
            k = have.get(kc.name)
            if k is None:
                raise DeviceError(f"the artifact has no {target} kernel '{kc.name}' (compiled by another version?)",
                                  where=str(art.path))
            binary = art.read_bytes(k["path"], "kernel binary")
            side = read_sidecar(art, k)
            if list(side["grid"]) != list(kc.grid) or side["binary_sha256"] != k["sha256"]:
                raise DeviceError(f"kernel sidecar disagrees with the program's call {kc.name}", where=k["sidecar"])
            compiled_params(kc, side, where=k["sidecar"])  # the compiled parameters are the call's, by name and type
            out[kc.name] = (binary, side)
        return out
    return get


def artifact_weights(art: Artifact, program=None, rank: int = 0):
    """The artifact's weights (rank `rank`'s of a partitioned one), mapped (no copy; `Artifact.weights()`:
    each shard's header checked against the manifest); with `program`, the program's weight buffers are
    checked against the manifest first."""
    if program is not None:
        program_weight_types(art, program)
    return art.weights(rank)


COMM_LIB_ENV = "V4COMPILE_COMM_LIB"  # the NCCL / RCCL library to dlopen (default: libnccl.so.2, librccl.so)


def join_communicators(rt: CRuntime, ranks, device: str, comm_lib: str | None = None) -> None:
    """The runtime's NCCL / RCCL communicators, one per group size of the layout: the first rank of each
    group makes the unique id, every rank of the group reads it from torch.distributed's store
    (`distributed.Ranks.comm_ids`), then joins. `comm_lib`: else `V4COMPILE_COMM_LIB`, else the device's."""
    import os

    lib = comm_lib or os.environ.get(COMM_LIB_ENV) or None
    rt.comm_init(ranks.rank, ranks.comm_ids(lambda: comm_unique_id(device, lib)), lib)


class ProgramBackend:
    def __init__(self, art: Artifact, device: str = "host", *, driver_lib: str | None = None, graphs: bool = True,
                 kernels: str = "auto", threads: int | None = None, ranks=None, comm_lib: str | None = None):
        t0 = time.perf_counter()
        # a partitioned artifact: this process's rank (`distributed.Ranks`): its weights, its collectives
        self.ranks = ranks
        if device == "host":
            # The host kernels are many tiny torch ops: one thread runs them 5-10x faster than several on a
            # shared machine (measured: tiny, 8 tokens, 1.6 s vs 19.9 s on 2 busy cores). Process-wide.
            import torch

            torch.set_num_threads(threads or 1)
        self.device = device
        self.graphs = graphs
        self.program = artifact_program(art)
        program_interface(art, self.program, gpu_entry(art) is not None, host=device == "host")
        for k in art.manifest["kernels"]:  # every sidecar, whichever device: the artifact is checked as a whole
            read_sidecar(art, k)
        if device != "host":  # before compiling any kernel: no driver, nothing to compile for
            import ctypes

            lib = driver_lib or DRIVER_LIB[device]
            try:
                ctypes.CDLL(lib)
            except OSError as e:
                raise DeviceError(f"device '{device}': cannot open the driver library {lib}: {e}") from None
        calls = kernel_calls_for(kernels, device)
        if device != "host":
            missing = sorted({l.kernel for f in self.program.functions.values() for l in f.launches
                              if not get_op(l.op).communicator and (calls is None or calls(l) is None)})
            if missing:
                raise DeviceError(f"device '{device}' needs compiled kernels for every launch; none for the "
                                  f"families {', '.join(missing)} (the reference kernels mode runs on the host "
                                  f"device only): use --device host or cpu")
        if device != "host" and any(int(l.attrs.get("tp", 1)) > 1 for f in self.program.functions.values()
                                    for l in f.launches if get_op(l.op).collective):
            # NCCL / RCCL's gather and reduce-scatter have no replicas: `--dp` with `--tp` runs on cpu and host
            raise DeviceError(f"device '{device}': the collectives of --dp with --tp > 1 are not built on "
                              "NCCL / RCCL yet: use --device host or cpu")
        binaries = artifact_binaries(art, device) if device != "host" else None
        t1 = time.perf_counter()
        weights = artifact_weights(art, self.program, ranks.rank if ranks is not None else 0)
        try:
            self.rt = CRuntime(self.program, weights, device, driver_lib=driver_lib, kernel_calls=calls,
                               binaries=binaries, collective=ranks.collective if ranks is not None else None,
                               exchange=ranks.exchange if ranks is not None else None)
        finally:
            weights.close()
        if device == "host":  # the prefix cache's copies checked as every launch is (`copy_check.py`)
            from .copy_check import CopyCheck

            self.rt.copy_check = CopyCheck(self.program)
        if ranks is not None and device != "host":  # GPUs: the collective launches run on NCCL / RCCL
            join_communicators(self.rt, ranks, device, comm_lib)
        self.weights_s = time.perf_counter() - t1
        self._funcs = {n: FunctionInfo(n, n.split("_")[0], int(f.attrs["batch"]), int(f.attrs["tokens"]))
                       for n, f in self.program.functions.items()}
        log.info("%s backend: program of %d functions loaded in %.2f s", device, len(self._funcs),
                 time.perf_counter() - t0)

    def functions(self) -> dict[str, FunctionInfo]:
        return dict(self._funcs)

    def timed(self, fname: str, inputs: dict[str, np.ndarray], graph: bool, reps: int = 20) -> float:
        """Seconds per run of `fname` (inputs uploaded once; launch by launch or graph replay), synchronised."""
        self.rt.run(fname, inputs, graph=graph)  # warm up (and capture)
        self.rt.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            self.rt.launch(fname, graph=graph)
        self.rt.sync()
        return (time.perf_counter() - t0) / reps

    def run(self, fname: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.run_outputs(fname, inputs)["logits"]

    def run_outputs(self, fname: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`run`, returning every output buffer: float ones as float32 (logits; a speculative artifact's
        `streams`), integer ones as they are (`spec_b<B>`'s `spec.next_ids`, `spec.kept_pos`; `spec_b<B>_d<k>`'s
        `spec.draft<j>`)."""
        # decode and the one-call speculative steps (`spec_*`): the same launches every step, captured once
        graph = self.graphs and self._funcs[fname].kind in ("decode", "spec")
        if self.ranks is not None:  # every rank runs rank 0's step
            inputs = self.ranks.step(sorted(self._funcs).index(fname), fname, inputs)
        out = {n: (t.float() if t.is_floating_point() else t).numpy()  # the acceptance's ids stay integers
               for n, t in self.rt.run(fname, inputs, graph=graph).items()}
        return out if self.ranks is None else self.ranks.replicas(out)

    def share_ids(self, ids: list[int]) -> list[int]:
        """Sampled ids as every rank takes them: rank 0's (`distributed.Ranks.share_ids`)."""
        return ids if self.ranks is None else self.ranks.share_ids(ids)

    def close(self) -> None:
        self.rt.close()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
