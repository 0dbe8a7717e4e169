"""Lower to the program: buffers and ordered launches with exact argument places (see v4compile/program).

Requires: a memory-planned module (`plan_memory` last before it: every op annotated `_arena`, `_strides`).
Guarantees: the module is unchanged except for the module attribute `stage = "program"`; its program
(`v4compile.program.build.build_program(module)`, a pure function of the module) builds and passes
`verify_program`: every launch has a kernel family, every argument lies in its buffer, tied results are
in place, and no two live arena values overlap. The program built here travels with the module
(`program_of`) to the dump, the report and codegen; a module read back from text gives the same program.
Hits: `<func>.launches`, `<func>.buffers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.program.build import program_of

from .base import Pass, PassResult, register
from .rewrite import new_module


@register
@dataclass(frozen=True)
class LowerToProgram(Pass):
    name = "lower_to_program"
    after = {"plan_memory": "it reads the memory plan"}
    final = True

    def run(self, module):
        out = new_module(module, dict(module.functions), attrs={**module.attrs, "stage": "program"})
        prog = program_of(out)  # built and verified once; carried with the module to the report and codegen
        hits = {}
        for name, f in prog.functions.items():
            hits[f"{name}.launches"] = len(f.launches)
            hits[f"{name}.buffers"] = len(f.buffers)
        return PassResult(out, hits)
