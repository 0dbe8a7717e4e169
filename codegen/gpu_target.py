"""The GPU targets of an artifact (`targets.GPU_TARGETS`): the program and its kernels compiled ahead of time.

    write_gpu_targets(module, targets, out_dir, jobs) -> GpuTargets

`module` is the final module of the `gpu` pipeline (down to `lower_to_program`). Written under `out_dir`:
    gpu/program.txt                  the program (buffers + ordered launches), parsed back at load
    kernels/<target>/<name>.<hsaco|cubin>, <name>.json   each distinct specialisation's binary + sidecar
The returned entries go into the manifest (`targets`, `kernels`) and report.json (`kernels`: the static
report rows; `decode_step`: the roofline model of every decode bucket per target; `spec_step`: that of the
one-call speculative steps per decode bucket, drafting 1 .. K, when the program has them). Nothing here depends on
time or paths, so the files are byte-reproducible (compile times and cache hits are only logged).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifact import spec_buckets, spec_name
from ..errors import CodegenError, InputError
from ..program.build import program_of
from ..program.text import print_program
from . import aot
from .pdl_check import pdl_violations
from .program_kernels import program_kernels
from .roofline import step_model

log = logging.getLogger(__name__)

PROGRAM_FILE = "gpu/program.txt"
# Per-machine facts of a report row: logged, never written (they would break byte-reproducibility).
VOLATILE = ("compile_s", "cached")


@dataclass
class GpuTargets:
    targets: list[dict[str, Any]] = field(default_factory=list)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    decode_step: dict[str, dict[str, Any]] = field(default_factory=dict)
    spec_step: dict[str, dict[str, Any]] = field(default_factory=dict)  # per target, per spec_b<B> (`spec_model`)

    @property
    def spilling(self) -> list[dict[str, Any]]:
        """The specialisations that spill registers, per target (report.json `spilling`)."""
        return spilling(self.rows)


# What a report row's `spills` counts on each target's backend (codegen/aot.py's stats).
SPILL_UNIT = {"hip": "registers", "cuda": "bytes"}


def spilling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(({"name": r["name"], "target": r["target"], "spills": int(r["spills"]),
                    "unit": SPILL_UNIT[aot.TARGETS[r["target"]].backend]} for r in rows if r["spills"]),
                  key=lambda x: (x["target"], x["name"]))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_gpu_targets(module, targets: list[str] | tuple[str, ...], out_dir: str | Path,
                      jobs: int | None = None) -> GpuTargets:
    out = Path(out_dir)
    prog = program_of(module)
    pk = program_kernels(prog)
    if not pk.complete:
        raise InputError("no Triton kernels for some launches of the program",
                         found=", ".join(f"{k} ({v})" for k, v in sorted(pk.missing.items())))
    for t in targets:
        if aot.TARGETS[t].pdl and (races := pdl_violations(prog, pk, t)):
            raise CodegenError(f"{len(races)} kernel call(s) would race under programmatic dependent launch on "
                               f"{t}", found="; ".join(races[:3]))
    (out / "gpu").mkdir(parents=True, exist_ok=True)
    (out / PROGRAM_FILE).write_text(print_program(prog))
    calls = list(pk.unique.values())
    log.info("aot: %d kernel specialisations x %d targets (%s)", len(calls), len(targets), ", ".join(targets))
    rows = aot.compile_calls(calls, list(targets), out / "kernels", jobs)
    res = GpuTargets()
    for r in rows:
        binary, sidecar = out / "kernels" / r["path"], out / "kernels" / r["sidecar"]
        res.kernels.append({"target": r["target"], "name": r["name"], "path": f"kernels/{r['path']}",
                            "sidecar": f"kernels/{r['sidecar']}", "sha256": _sha(binary),
                            "sidecar_sha256": _sha(sidecar)})
        res.rows.append({k: v for k, v in r.items() if k not in VOLATILE})
    funcs = {fname: {"kind": fname.split("_")[0], "batch": int(f.attrs["batch"]), "tokens": int(f.attrs["tokens"]),
                     "launches": len(f.launches), "kernel_calls": sum(len(c) for c in pk.calls[fname])}
             for fname, f in prog.functions.items() if not fname.startswith("spec_")}  # the program's own steps
    greedy = {spec_name(b) for b in spec_buckets(prog.functions)}
    for t in targets:
        res.targets.append({"name": t, "format": "triton-aot", "backend": aot.TARGETS[t].backend,
                            "program": PROGRAM_FILE, "kernels_dir": f"kernels/{t}",
                            "kernels": sum(1 for r in rows if r["target"] == t), "functions": funcs})
        res.decode_step[t] = {fname: step_model(prog, pk, fname, t, rows)
                              for fname in prog.functions if fname.startswith("decode")}
        # the greedy step drafting one (`spec_s<B>`: the same launches but its acceptance); its `spec_b<B>_d<k>`
        # drafting k in the model's `steps_us`
        if spec := {f: spec_model(prog, pk, f, t, rows, res.decode_step[t]) for f in prog.functions
                    if f in greedy}:
            res.spec_step[t] = spec
            for f, m in spec.items():
                log.info("spec step %s on %s (modeled): %.1f us = %.2f decode steps; at %.0f %% acceptance %.2f "
                         "tokens a step, %.2fx tokens/s", f, t, m["step_us"], m["cost_ratio"], 100 * m["acceptance"],
                         m["tokens_per_step"], m["tokens_s_gain"])
    return res


def spec_model(prog, pk, fname: str, target: str, rows, decode: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The modeled speculative step of bucket B from the compiled program (report.json `spec_step`): `spec_b<B>`
    (verify on 1 + K lanes, the acceptance, the first MTP draft: one call) and, drafting k > 1, `spec_b<B>_d<k>`
    (the same with the k - 1 recursive drafts in the call; `steps_us`: k = 1 .. K; a program without it: plus
    k - 1 `draft_b<B>` calls), each at the roofline of its own launches (`step_model`), against `decode_b<B>`'s;
    the tokens a step makes at K drafts at the V3 report's acceptance per draft (`spec_cost.V3_ACCEPTANCE`), and
    the tokens/s gain that buys. Modeled, not measured."""
    from .spec_cost import V3_ACCEPTANCE, tokens_per_step

    B = int(fname[len("spec_b"):])
    step = step_model(prog, pk, fname, target, rows)
    f = prog.functions[fname]
    K = int(f.attrs["tokens"]) - 1
    draft_us = step_model(prog, pk, f"draft_b{B}", target, rows)["modeled_us"] if K > 1 else 0.0
    steps, launches = [step["modeled_us"]], [step["launches"]]
    for k in range(2, K + 1):
        if (name := spec_name(B, drafts=k)) in prog.functions:
            m = step_model(prog, pk, name, target, rows)
            steps.append(m["modeled_us"])
            launches.append(m["launches"])
        else:
            steps.append(step["modeled_us"] + (k - 1) * draft_us)
    dec_us = decode[f"decode_b{B}"]["modeled_us"]
    total = steps[-1]
    tps = tokens_per_step([V3_ACCEPTANCE] * K)
    return {"batch": int(f.attrs["batch"]), "draft_tokens": K, "launches": step["launches"],
            "launches_k": launches, "steps_us": [round(x, 2) for x in steps],
            "kernel_calls": step["kernel_calls"], "spec_us": step["modeled_us"], "draft_us": draft_us,
            "step_us": round(total, 2), "decode_us": dec_us, "cost_ratio": round(total / dec_us, 3),
            "acceptance": V3_ACCEPTANCE, "tokens_per_step": round(tps, 3),
            "tokens_s_gain": round(tps * dec_us / total, 3), "kernels_spilling": step["kernels_spilling"]}
