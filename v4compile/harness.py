"""Running IR functions like a runtime would, on CPU, and checking them against the reference model.

* `IRRunner`: prefill / decode through the module's functions, carrying every state input (caches,
  pools) from one call's outputs to the next call's inputs by name;
* `check_numerics`: the same seeded scenario through `ReferenceModel` and the IR, max logit error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import InputError
from .ir.core import Module
from .ir.interpret import interpret
from .ir.types import DTYPES
from .model.batching import prefill_chunks
from .pool import Allocator, PoolGeometry

log = logging.getLogger(__name__)

STEP_INPUTS = ("ids", "pos")


class PagedAllocator:
    """The step inputs of a pool-lowered module for batch lanes `b` that stay the same sequences: one slot
    per lane and pool blocks on demand, from the session's allocator (`pool.Allocator`) handing out the
    highest first (slot `n_slots - 1 - b`; blocks interleave across sequences)."""

    def __init__(self, geo: PoolGeometry):
        self.geo = geo
        self.alloc = Allocator(geo.n_slots, geo.n_blocks, descending=True)
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}

    def step_inputs(self, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        B = pos.shape[0]
        if B > self.geo.n_slots:
            raise InputError("more sequences than pool slots", expected=f"<= {self.geo.n_slots}", found=B)
        table = torch.full((B, self.geo.blocks_per_seq), -1, dtype=torch.int32)
        for b in range(B):
            last = int(pos[b].max())
            need = (last + self.geo.block_tokens) // self.geo.block_tokens if last >= 0 else 0
            blocks = self.tables.setdefault(b, [])
            if need > self.geo.blocks_per_seq:
                raise InputError("sequence longer than the compiled max context", where=f"sequence {b}",
                                 expected=f"<= {self.geo.blocks_per_seq * self.geo.block_tokens} tokens", found=last + 1)
            if not self.alloc.grow(blocks, need):
                raise InputError("the KV pool is full", where=f"sequence {b}")
            if blocks:
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if b not in self.slots:
                self.slots[b] = self.alloc.slot()
        slot = torch.tensor([self.slots[b] for b in range(B)], dtype=torch.int32)
        return {"block_table": table, "slot": slot}


class IRRunner:
    """Prefill and decode through a module's functions, with state carried between calls."""

    def __init__(self, module: Module, weights: Mapping[str, torch.Tensor],
                 prepare: Callable[["IRRunner", str, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
                 interpreter: Callable = interpret):
        self.m = module
        self.interpreter = interpreter
        self.weights = weights
        self.state: dict[str, torch.Tensor] = {}
        self.lengths: list[int] | None = None
        self.prepare = prepare  # extra per-step inputs
        # A pool-lowered module carries its geometry; the runner then does the runtime's paging.
        self.allocator = PagedAllocator(PoolGeometry.from_attrs(module.attrs)) if "pool.block_tokens" in module.attrs \
            else None

    def _batch(self, fname: str) -> int:
        return self.m.functions[fname].attrs["batch"]

    def call(self, fname: str, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        outs = self.interpreter(self.m.functions[fname], self.weights, self.inputs_for(fname, ids, pos))
        return self.take(outs)

    def take(self, outs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A call's outputs: the state kept for the next call, the logits returned."""
        for name, t in outs.items():
            if name != "logits":
                self.state[name] = t
        return outs["logits"]

    def inputs_for(self, fname: str, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """A call's inputs: the step's (with the pool's tables), the carried state."""
        fn = self.m.functions[fname]
        inputs = {"ids": ids, "pos": pos}
        if self.allocator is not None and any(v.name == "block_table" for v in fn.inputs):
            inputs.update(self.allocator.step_inputs(pos))
        if self.prepare is not None:
            inputs.update(self.prepare(self, fname, ids, pos))
        for v in fn.inputs:
            if v.name in inputs:
                continue
            if v.name not in self.state:
                self.state[v.name] = torch.zeros(v.type.shape, dtype=DTYPES[v.type.dtype])
            inputs[v.name] = self.state[v.name]
        return inputs

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        fn = self.m.functions["prefill"]
        B, T = fn.attrs["batch"], fn.attrs["tokens"]
        if len(prompts) != B:
            raise InputError("prefill batch does not match the compiled batch", expected=B, found=len(prompts))
        if self.lengths is None:
            self.lengths = [0] * B
        last = torch.zeros(B, self.m.functions["prefill"].output("logits").type.shape[-1])
        for ids, pos, n in prefill_chunks(prompts, self.lengths, T):
            logits = self.call("prefill", ids, pos)
            for b in range(B):
                if n[b]:
                    last[b] = logits[b].float()
        for b, p in enumerate(prompts):
            self.lengths[b] += len(p)
        return last

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        B = self._batch("decode")
        if self.lengths is None or len(tokens) != B:
            raise InputError("decode needs a prefilled batch of the compiled decode size", expected=B,
                             found=len(tokens))
        ids = torch.tensor(tokens, dtype=torch.long).view(B, 1)
        pos = torch.tensor(self.lengths, dtype=torch.long).view(B, 1)
        logits = self.call("decode", ids, pos)
        self.lengths = [n + 1 for n in self.lengths]
        return logits.float()


class DPRunner:
    """Prefill and decode through a data-parallel module (`partition{dp}`), every rank in this process: the
    batch's sequences are dealt to the replicas in order (replica d: sequences [d * B, (d + 1) * B), B the
    functions' batch), each replica with its own state and pool (an `IRRunner` each), and every call runs
    all ranks in lockstep (`interpret_ranks`; rank r serves replica r // tp). A replica with fewer prefill
    chunks than another runs padding steps (pos -1), as the runtime does."""

    def __init__(self, module: Module, weights: Sequence[Mapping[str, torch.Tensor]], layout, prepare=None):
        from .ir.interpret import interpret_ranks

        self.m, self.layout, self.weights = module, layout, list(weights)
        self.replicas = [IRRunner(module, {}, prepare=prepare) for _ in range(layout.dp)]
        self._ranks = interpret_ranks

    def _call(self, fname: str, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        fn = self.m.functions[fname]
        ins = [rep.inputs_for(fname, ids, pos) for rep, (ids, pos) in zip(self.replicas, steps)]
        outs = self._ranks(fn, self.weights, [ins[self.layout.replica(r)] for r in range(self.layout.world)])
        logits = []
        for d, rep in enumerate(self.replicas):
            first = d * self.layout.tp
            for r in range(first + 1, first + self.layout.tp):  # a replica's tp ranks end with the same values
                for name, t in outs[r].items():
                    if not torch.equal(t, outs[first][name]):
                        raise InputError(f"@{fname}: output '{name}' differs between ranks {first} and {r} of "
                                         f"replica {d}", expected="the same values on a replica's ranks")
            logits.append(rep.take(outs[first]))
        return logits

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        fn = self.m.functions["prefill"]
        B, T, dp = fn.attrs["batch"], fn.attrs["tokens"], self.layout.dp
        if len(prompts) != B * dp:
            raise InputError("prefill batch does not match the compiled batch on every replica",
                             expected=f"{dp} x {B}", found=len(prompts))
        parts = [list(prompts[d * B:(d + 1) * B]) for d in range(dp)]
        for rep in self.replicas:
            if rep.lengths is None:
                rep.lengths = [0] * B
        chunks = [list(prefill_chunks(p, rep.lengths, T)) for p, rep in zip(parts, self.replicas)]
        V = fn.output("logits").type.shape[-1]
        last = torch.zeros(B * dp, V)
        pad = (torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1, dtype=torch.long), [0] * B)
        for k in range(max(map(len, chunks))):
            step = [c[k] if k < len(c) else pad for c in chunks]
            for d, logits in enumerate(self._call("prefill", [(ids, pos) for ids, pos, _ in step])):
                for b in range(B):
                    if step[d][2][b]:
                        last[d * B + b] = logits[b].float()
        for p, rep in zip(parts, self.replicas):
            for b, q in enumerate(p):
                rep.lengths[b] += len(q)
        return last

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        B = self.m.functions["decode"].attrs["batch"]
        if any(rep.lengths is None for rep in self.replicas) or len(tokens) != B * self.layout.dp:
            raise InputError("decode needs a prefilled batch of the compiled decode size on every replica",
                             expected=f"{self.layout.dp} x {B}", found=len(tokens))
        steps = [(torch.tensor(tokens[d * B:(d + 1) * B], dtype=torch.long).view(B, 1),
                  torch.tensor(rep.lengths, dtype=torch.long).view(B, 1)) for d, rep in enumerate(self.replicas)]
        logits = self._call("decode", steps)
        for rep in self.replicas:
            rep.lengths = [n + 1 for n in rep.lengths]
        return torch.cat(logits).float()


@dataclass(frozen=True)
class Scenario:
    """A seeded workload: B prompts of different lengths, then teacher-forced decode tokens."""

    prompts: tuple[tuple[int, ...], ...]
    decode: tuple[tuple[int, ...], ...]  # steps x B

    @classmethod
    def make(cls, vocab: int, batch: int, prompt_len: int, steps: int, seed: int = 0) -> "Scenario":
        g = torch.Generator().manual_seed(seed)
        lens = [max(1, prompt_len - (b * prompt_len) // (2 * batch)) for b in range(batch)]
        prompts = tuple(tuple(torch.randint(0, vocab, (n,), generator=g).tolist()) for n in lens)
        dec = tuple(tuple(torch.randint(0, vocab, (batch,), generator=g).tolist()) for _ in range(steps))
        return cls(prompts, dec)


def reference_logits(model, sc: Scenario, chunk: int, capacity: int | None = None, replicas: int = 1
                     ) -> list[torch.Tensor]:
    """[prefill last-token logits, decode step 1, ...] from the reference model. `replicas` > 1: the
    sequences dealt to that many replicas as `DPRunner` deals them, each replica's batch run on its own (as
    a data-parallel module runs all but its experts: the same batches, so the same roundings)."""
    if replicas > 1:
        B = len(sc.prompts) // replicas
        parts = [reference_logits(model, Scenario(sc.prompts[d * B:(d + 1) * B],
                                                  tuple(t[d * B:(d + 1) * B] for t in sc.decode)), chunk, capacity)
                 for d in range(replicas)]
        return [torch.cat(step) for step in zip(*parts)]
    cache, last = model.prefill([list(p) for p in sc.prompts], chunk=chunk,
                                capacity=capacity or max(map(len, sc.prompts)) + len(sc.decode))
    out = [last]
    for toks in sc.decode:
        out.append(model.decode(list(toks), cache))
    return out


def ir_logits(runner: IRRunner, sc: Scenario) -> list[torch.Tensor]:
    out = [runner.prefill([list(p) for p in sc.prompts])]
    for toks in sc.decode:
        out.append(runner.decode(list(toks)))
    return out


def max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
