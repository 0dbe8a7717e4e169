"""The program executor: run a function of a program on CPU bytes, launch by launch, with each op's
torch reference. Every value is read from and written to its exact place (buffer, byte offset,
strides) in raw byte buffers, so a wrong offset, stride, alias or lifetime shows up as a wrong number.
It is the oracle the runtimes are checked against: same buffers, same launches, same arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..errors import IRError
from ..ir.registry import get_op
from ..ir.types import BYTES, DTYPES
from .core import Arg, FunctionProgram, Launch

POISON = 0xA5  # fresh arena / output bytes: neither zero nor a plausible value


def _typed(buf: torch.Tensor, a: Arg) -> torch.Tensor:
    """The argument as a strided tensor over the byte buffer (no copy)."""
    size = BYTES[a.type.dtype]
    usable = buf[: buf.numel() // size * size]
    dt = DTYPES[a.type.dtype]
    return usable.view(dt).as_strided(a.type.shape, a.strides, a.offset // size)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Buffers:
    """Named byte buffers, created on first use: the state a runtime keeps between calls."""

    def __init__(self, poison: int = POISON):
        self.data: dict[str, torch.Tensor] = {}
        self.poison = poison

    def get(self, name: str, nbytes: int) -> torch.Tensor:
        b = self.data.get(name)
        if b is None or b.numel() != nbytes:
            b = torch.full((nbytes,), self.poison, dtype=torch.uint8)
            self.data[name] = b
        return b

    def set(self, name: str, t: torch.Tensor) -> None:
        self.data[name] = _bytes_of(t).clone()


def run_launch(l: Launch, bufs: dict[str, torch.Tensor],
               kernel: Callable[[Launch, dict, dict], None] | None = None) -> None:
    """One launch: operands read in place, the reference run, results written in place. With `kernel`,
    that callable computes the results instead (e.g. a Triton kernel writing into the result views)."""
    opdef = get_op(l.op)
    args = {n: (_typed(bufs[a.buffer], a) if a is not None else None) for n, a in l.operands}
    outs = {n: _typed(bufs[a.buffer], a) for n, a in l.results}
    if kernel is not None:
        kernel(l, args, outs)
        return
    got = opdef.run([args[n] for n in opdef.operand_names], l.attrs)
    if len(got) != len(l.results):
        raise IRError(f"{l.op} returned {len(got)} results for {len(l.results)}")
    # Copy every result out before writing any: a tied result's reference may return its operand's view.
    got = [g.clone() if g.data_ptr() == outs[n].data_ptr() else g for g, (n, _) in zip(got, l.results)]
    for (n, _), g in zip(l.results, got):
        outs[n].copy_(g)


def execute(f: FunctionProgram, buffers: Buffers, inputs: Mapping[str, torch.Tensor],
            weights: Mapping[str, torch.Tensor], kernel: Callable | None = None) -> dict[str, torch.Tensor]:
    """Run `f`. `inputs` fills step-input buffers (ids, pos, ...) and, on first use, pool / state buffers;
    pool and state then persist in `buffers` across calls. Returns the outputs (copies)."""
    bufs: dict[str, torch.Tensor] = {}
    for b in f.buffers:
        if b.kind == "weight":
            if b.name not in buffers.data:
                if b.name not in weights:
                    raise IRError(f"no tensor for weight @{b.name}")
                buffers.set(b.name, weights[b.name])
            bufs[b.name] = buffers.data[b.name]
        elif b.kind in ("arena", "output"):
            bufs[b.name] = buffers.get(b.name, b.nbytes)
            bufs[b.name].fill_(buffers.poison)  # nothing may be read before this call writes it
        elif b.kind == "input" or (b.kind in ("pool", "state") and b.name not in buffers.data):
            if b.name not in inputs:
                raise IRError(f"missing input %{b.name}", where=f"program @{f.name}")
            buffers.set(b.name, inputs[b.name])
            bufs[b.name] = buffers.data[b.name]
        else:
            bufs[b.name] = buffers.get(b.name, b.nbytes)
        if bufs[b.name].numel() != b.nbytes:
            raise IRError(f"buffer %{b.name} has {bufs[b.name].numel()} bytes", where=f"program @{f.name}",
                          expected=b.nbytes)
    for l in f.launches:
        run_launch(l, bufs, kernel)
    return {n: _typed(bufs[a.buffer], a).clone() for n, a in f.outputs}
