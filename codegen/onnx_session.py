"""ONNX Runtime's session options for the cpu target: chosen when compiling, recorded in the artifact's
manifest (`targets[cpu].session`), applied by the runtime (`runtime/cpu_backend.py`).

Measured (issue 22; bench/bench_cpu.py's configs, decode b1, 1 thread, min of 48 / 12 steps in process CPU
time on a shared 2-core machine): tiny 3.1-4.2 ms a step at every level (within the noise), mid 58.3 ms
("all"), 58.6 ("basic"), 59.6 ("disable"), 63.0 ("extended"); creating mid's sessions took 10.6 s
("all") against 9.1 s ("disable"). The step is bound by reading the weights (~9.5 GB/s for a 1-row Gemm on
one core here), which no graph rewrite changes, and the graphs are exported small already (grouped experts,
one Gemm per weight): "all" is kept for ONNX Runtime's Gemm weight pre-packing and fusions, which larger
batches gain from, at ~15 % more session creation time. Re-measured after the Sinkhorn rewrite
(`codegen/onnx/mhc.py`; tiny decode b1, interleaved in one process, median of 15 rounds, a loaded machine):
"basic" +8 %, memory pattern off +6 %, CPU arena off -1 %, both off -7 %: all within that run's noise
(+-8 %), so the choice stands.

`allow_spinning` false: an idle intra-op thread sleeps instead of spinning (ONNX Runtime's default
spins, which takes cores from other processes on a shared machine).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from v4compile.errors import ArtifactError

LEVELS = ("disable", "basic", "extended", "all")


@dataclass(frozen=True)
class SessionOptions:
    graph_optimization_level: str = "all"
    inter_op_threads: int = 1  # the graphs are one chain of dependent ops: sequential execution
    allow_spinning: bool = False

    def to_manifest(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_manifest(cls, d: Any, where: str) -> "SessionOptions":
        """The options an artifact records (defaults for an artifact that records none); one clear error
        for anything else."""
        if d is None:
            return cls()
        names = {f.name: f.type for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != set(names):
            raise ArtifactError("the cpu target's session options are not {%s}" % ", ".join(sorted(names)),
                                where=where, found=sorted(d)[:6] if isinstance(d, dict) else type(d).__name__)
        if d["graph_optimization_level"] not in LEVELS:
            raise ArtifactError("the cpu target's graph optimisation level is unknown", where=where,
                                expected=", ".join(LEVELS), found=str(d["graph_optimization_level"])[:40])
        n = d["inter_op_threads"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise ArtifactError("the cpu target's inter-op threads must be an integer in [1, 256]", where=where,
                                found=repr(n)[:40])
        if not isinstance(d["allow_spinning"], bool):
            raise ArtifactError("the cpu target's allow_spinning must be a boolean", where=where,
                                found=repr(d["allow_spinning"])[:40])
        return cls(**d)

    def apply(self, ort, so) -> None:
        """Set these options on an `onnxruntime.SessionOptions`."""
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[self.graph_optimization_level]
        so.inter_op_num_threads = self.inter_op_threads
        so.execution_mode = (ort.ExecutionMode.ORT_SEQUENTIAL if self.inter_op_threads == 1
                             else ort.ExecutionMode.ORT_PARALLEL)
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.allow_spinning else "0")
