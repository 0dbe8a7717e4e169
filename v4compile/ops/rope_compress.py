"""A decode step's query prologue (`qkv_norm_rope`, with its window-ring write) and the same layer's compressor
(`compress_paged`, or `compress_pair`) as one op: one launch (`passes/pair_rope_compress.py`,
`codegen/kernels/rope_compress.py`). Its own module, above `fused` and `paged`, which it joins (neither imports
it)."""

from __future__ import annotations

from ..ir.registry import Cost, defop
from .fused import qkv_norm_rope
from .paged import compress_pair, compress_paged

# A decode step's `qkv_norm_rope` (with its window-ring write) and the same layer's compressor (`compress_paged`
# on an HCA layer, `compress_pair` on a CSA layer) as one op (`passes/pair_rope_compress.py`). Its operands,
# results and attributes are the two ops', by name: `qkv_norm_rope`'s as they are, the compressor's prefixed
# `c_`, but for the positions and slots (one chunk: shared) and the main pool planes, which both update in
# place (`p0`..`p2` -> `q0`..`q2`): the window ring's rows and the compressed rows of one pool, two disjoint
# row ranges (`pool.py`: compressed rows below n_blocks * envelope_rows, the slots' rings above).
ROPE_SHARED = ("pos", "slot")
ROPE_COMPRESS: dict[str, "RopeCompress"] = {}  # fused op name -> its names' map (the pass's and the kernels')


class RopeCompress:
    """The names of a fused query-prologue / compressor op and how they map onto its two members'."""

    def __init__(self, name: str, second):
        self.name, self.second = name, second
        pair = second.name == "compress_pair"
        self.c_planes = tuple(f"p{i}_0" if pair else f"p{i}" for i in range(3))  # the compressor's main planes
        self.c_plane_results = tuple(f"q{i}_0" if pair else f"q{i}" for i in range(3))
        self.operand_map = {n: (n if n in ROPE_SHARED else f"p{self.c_planes.index(n)}" if n in self.c_planes
                                else f"c_{n}") for n in second.operand_names}
        self.result_map = {n: (f"q{self.c_plane_results.index(n)}" if n in self.c_plane_results else f"c_{n}")
                           for n in second.results}
        opt = {o.name: o.optional for o in second.operands}
        c_ops = [f"c_{n}{'?' * opt[n]}" for n in second.operand_names
                 if n not in ROPE_SHARED and n not in self.c_planes]
        c_res = [f"c_{n}{'?' * (n in second.optional_result_names)}" for n in second.results
                 if n not in self.c_plane_results]
        self.sig = (f"{name}(q, kv, norm, pos, qi?, slot, {', '.join(c_ops)}, p0, p1?, p2?) -> "
                    f"q_out, kv_out, qi_out?, {', '.join(c_res)}, q0, q1?, q2?")
        self.operand_names = ("q", "kv", "norm", "pos", "qi", "slot", *(o.rstrip("?") for o in c_ops), "p0", "p1", "p2")

    def attrs(self) -> dict:
        spec = lambda a: a.type if a.required else (a.type, a.default)  # noqa: E731
        return {**{k: spec(a) for k, a in qkv_norm_rope.attrs.items() if k != "variant"},
                **{f"c_{k}": spec(a) for k, a in self.second.attrs.items()}}

    def tied(self) -> dict[str, str]:
        return {"q0": "p0", "q1": "p1", "q2": "p2",
                **{self.result_map[r]: self.operand_map[o] for r, o in self.second.tied.items()
                   if r not in self.c_plane_results}}

    def split(self, operands, attrs: dict) -> tuple[list, dict, list, dict]:
        """(qkv_norm_rope's operands, its attributes, the compressor's operands, its attributes) of the fused
        op's; the compressor's main planes are the fused op's (the planes before either write)."""
        by = dict(zip(self.operand_names, operands))
        return ([by[n] for n in qkv_norm_rope.operand_names], {k: v for k, v in attrs.items() if not k.startswith("c_")},
                [by[self.operand_map[n]] for n in self.second.operand_names],
                {k[2:]: v for k, v in attrs.items() if k.startswith("c_")})

    def chain(self, qkv_operands: list, first: list, c_operands: list) -> tuple[list, list]:
        """(query-prologue results, compressor operands reading the planes `first` (qkv's results) ends with)."""
        n = 3 if qkv_operands[4] is not None else 2
        planes = list(first[n:]) + [None] * (3 - len(first[n:]))
        c = list(c_operands)
        for name, p in zip(self.c_planes, planes):
            c[self.second.operand_names.index(name)] = p
        return list(first[:n]), c

    def results(self, acts: list, c_operands: list, c_results) -> tuple:
        """The fused op's results: the query prologue's, the compressor's own, then the main planes."""
        by = dict(zip(self.second.result_names(c_operands, len(c_results)), c_results))
        return (*acts, *(v for n, v in by.items() if n not in self.c_plane_results),
                *(by[n] for n in self.c_plane_results if n in by))


def _rope_compress(name: str, second):
    rc = RopeCompress(name, second)

    def ref(*operands, **attrs):
        qo, qa, co, ca = rc.split(operands, attrs)
        acts, co = rc.chain(qo, list(qkv_norm_rope.ref(*qo, **qa)), co)
        return rc.results(acts, co, second.ref(*co, **ca))

    ref.__doc__ = (f"`qkv_norm_rope` (with the window-ring write) and `{second.name}` of one decode step in one "
                   "launch: the two references in order (the window rows, then the compressed rows of the pool).")
    op = defop(rc.sig, attrs=rc.attrs(), tied=rc.tied(), follows={"qi_out": "qi"}, kernel="rope_compress",
               offset_attrs=("layer_row", *(f"c_{a}" for a in second.offset_attrs)),
               variants={"write": (), "indexer_write": ("qi",)})(ref)
    ROPE_COMPRESS[name] = rc

    def types(operands, attrs):
        qo, qa, co, ca = rc.split(operands, attrs)
        first = qkv_norm_rope.result_types(qo, qa)
        co = rc.chain(qo, first, co)[1]
        return qo, qa, first, co, ca, second.result_types(co, ca)

    @op.infer
    def _(*operands, **attrs):
        qo, _, first, co, _, cr = types(operands, attrs)
        return rc.results(rc.chain(qo, first, co)[0], co, cr)

    @op.cost
    def _(operands, results, attrs):
        """The two ops' costs: what their two launches moved."""
        qo, qa, first, co, ca, cr = types(operands, attrs)
        a, b = qkv_norm_rope.cost_of(qo, first, qa), second.cost_of(co, cr, ca)
        return Cost(a.flops + b.flops, a.bytes_read + b.bytes_read, a.bytes_written + b.bytes_written)

    return op


qkv_rope_compress = _rope_compress("qkv_rope_compress", compress_paged)
qkv_rope_compress_pair = _rope_compress("qkv_rope_compress_pair", compress_pair)
