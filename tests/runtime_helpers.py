"""Shared set-up of the C runtime tests: a small lowered tiny program, its weights, the fake drivers."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from conftest import dense_weights
from v4compile.config import preset
from v4compile.harness import PagedAllocator
from v4compile.model.batching import prefill_chunks
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.pool import PoolGeometry
from v4compile.program.build import build_program
from v4compile.program.execute import POISON, Buffers, execute
from v4compile.program.verify import verify_program
from v4compile.runtime.build import SOURCE_DIR, compile_shared
from v4compile.targets import cache_root
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource, load_ir_weights

FAKE_DIR = Path(__file__).parent / "fake_driver"


@functools.lru_cache(maxsize=None)
def tiny(decode_batch: int = 3, batch: int = 3, chunk: int = 16, capacity: int = 64, preset_name: str = "tiny",
         numerics: str = "hf"):
    """(module, program, weights) of a small lowered program of `preset_name` ("tiny" or "tiny-pro")."""
    m = trace(preset(preset_name), TraceOptions(numerics=numerics, batch=batch, chunk=chunk, decode_batch=decode_batch,
                                                capacity=capacity))
    m = PassManager(DEFAULT_PIPELINE, PipelineOptions()).run(m).module
    return m, verify_program(build_program(m)), load_ir_weights(m, DenseSource(dense_weights(preset_name)))


def _build(name: str, flags: tuple[str, ...], sources: list[Path]) -> Path:
    import hashlib

    h = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(sources) + sorted(SOURCE_DIR.glob("*.[ch]")))
                       + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "tests" / h / name
    if not out.is_file():
        import os
        import tempfile

        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")  # xdist workers may build it at once
        os.close(fd)
        try:
            compile_shared(sources, Path(tmp), flags, libs=("-ldl",), include=SOURCE_DIR)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def runtime_variant(defines: tuple[str, ...] = (), edit: tuple[str, str, str] | None = None) -> Path:
    """The C runtime built from its sources with `-D` defines and one source edit (file, old, new): a
    re-sized or deliberately broken runtime, built once per content in the cache."""
    import hashlib
    import os
    import shutil
    import tempfile

    from v4compile.runtime.build import CFLAGS, SOURCES

    texts = {p.name: p.read_text() for p in sorted(SOURCE_DIR.glob("*.[ch]"))}
    if edit is not None:
        file, old, new = edit
        assert texts[file].count(old) == 1, old
        texts[file] = texts[file].replace(old, new)
    flags = CFLAGS + tuple(f"-D{d}" for d in defines)
    h = hashlib.sha256(repr((sorted(texts.items()), flags)).encode()).hexdigest()[:16]
    out = cache_root() / "tests" / h / "libv4rt_variant.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = Path(tempfile.mkdtemp(dir=out.parent))  # xdist workers may build it at once
        try:
            for name, text in texts.items():
                (src / name).write_text(text)
            compile_shared([src / s for s in SOURCES], src / out.name, flags, include=src)
            os.replace(src / out.name, out)
        finally:
            shutil.rmtree(src, ignore_errors=True)
    return out


def fake_driver(kind: str) -> Path:
    """The fake libcuda / libamdhip64 (kind "cuda" / "hip"), built once per source hash."""
    return _build(f"libfake_{kind}.so", ("-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                                         f"-DFAKE_{kind.upper()}"), [FAKE_DIR / "fake_driver.c"])


def fake_nccl() -> Path:
    """The fake libnccl.so.2 (tests/fake_driver/fake_nccl.c), on top of the fake CUDA driver."""
    return _build("libfake_nccl.so", ("-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared"),
                  [FAKE_DIR / "fake_nccl.c"])


class Fake:
    """The fake driver's record, read through ctypes (same library instance the runtime dlopens)."""

    def __init__(self, kind: str):
        self.path = str(fake_driver(kind))
        self.lib = ctypes.CDLL(self.path)
        self.lib.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_long]
        self.lib.fake_trace.argtypes = [ctypes.c_long]
        self.lib.fake_trace.restype = ctypes.c_char_p
        self.lib.fake_attr.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.POINTER(ctypes.c_long)]
        self.lib.fake_launch.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32),
                                         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int)]
        self.lib.fake_launch_module.argtypes = [ctypes.c_long, ctypes.c_char_p]
        self.lib.fake_reset()

    EXEC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))

    def compute(self, rt) -> None:
        """Make the fake GPU compute: each launch of `rt` (a CRuntime on this fake with placeholder calls,
        `fake_table`) runs its op's reference on the fake's memory when the GPU would run it (fake_on_launch),
        through the host device's own callback (`CRuntime._host_kernel`), its call found by order: the calls of
        the function `rt.launch` issues, from 0, again for each replay of its graph. Closing `rt` removes the hook."""
        import types

        at = [0, 0]  # (function, next call)
        rt.views = {k: torch.frombuffer((ctypes.c_uint8 * max(n, 1)).from_address(a), dtype=torch.uint8)[:n]
                    for k, a, n in zip(rt.sched.buffer_names, rt.addr, rt.sched.buffer_bytes)}
        launch = rt.launch

        def issued(self_, fname, graph=False):
            at[:] = [rt.sched.function_index(fname), 0]
            launch(fname, graph)

        def run(n, params):
            f, c = at
            at[1] += 1
            return rt._host_kernel(None, f, c, n, params)

        close = rt.close

        def closed(self_):  # the hook goes with the runtime: a later runtime on this library launches without it
            self.lib.fake_on_launch(None)
            close()

        rt.launch = types.MethodType(issued, rt)
        rt.close = types.MethodType(closed, rt)
        rt.fake_exec = self.EXEC(run)  # kept alive as long as the runtime that launches through it
        self.lib.fake_on_launch(rt.fake_exec)

    @classmethod
    def computing_hip(cls, sess, kernel_calls=None, kind: str = "hip") -> "Fake":
        """`sess` (a host-device session) moved onto a computing fake HIP (or `kind`: CUDA) driver (`compute`):
        its runtime rebuilt there on the session's program and weights (`kernel_calls` as `CRuntime`'s), the
        session then calling itself `kind`. Returns the fake (its record)."""
        from v4compile.runtime.c_backend import CRuntime
        from v4compile.runtime.program_backend import artifact_weights

        be = sess.backend
        be.rt.close()
        fake = cls(kind)
        weights = artifact_weights(sess.art, be.program)
        try:
            be.rt = CRuntime(be.program, weights, kind, driver_lib=fake.path, table=fake_table(),
                             kernel_calls=kernel_calls)
        finally:
            weights.close()
        fake.compute(be.rt)
        be.device = sess.device = kind
        return fake

    @staticmethod
    def route_by_reference(rt) -> None:
        """Test-only, on a computing fake (`compute`) whose schedule holds the fused MoE launches' kernel calls
        (so it has their scratch, `moe_router.route_ids_at`): each such launch runs its op's reference at its first
        call (the rest do nothing) and then writes the reference router's expert ids where the kernels' router
        phase leaves them (`self_check.route_reads`), as a GPU's fused launch does. The references write no
        scratch of their own."""
        import dataclasses

        from v4compile.program.execute import run_launch
        from v4compile.runtime import self_check as sc

        reads: dict[str, dict[int, tuple]] = {}

        def run_kernel(launch, call, cidx, places):
            fs = next(f for f in rt.sched.functions if cidx < len(f.calls) and f.calls[cidx] is call)
            if fs.launch_of.index(fs.launch_of[cidx]) != cidx:
                return  # not the launch's first call
            if fs.name not in reads:
                reads[fs.name] = {fs.launch_of[r[0]]: r for r in sc.route_reads(fs)}
            route = reads[fs.name].get(fs.launch_of[cidx])

            def moved(args):  # the schedule's buffer names (a step input or output is per function)
                return tuple((n, a if a is None else dataclasses.replace(
                    a, buffer=rt.sched.buffer_names[rt.sched.buffer_index(fs.name, a.buffer)])) for n, a in args)
            launch = dataclasses.replace(launch, operands=moved(launch.operands), results=moved(launch.results))
            got = sc._router_part(rt, launch) if route is not None else None  # before the launch writes over x
            run_launch(launch, rt.views)
            if got is not None:
                _, _, buf, off, rows, k = route
                ids = torch.from_numpy(got[1]).reshape(rows, k).to(torch.int64).contiguous()
                rt.views[rt.sched.buffer_names[buf]][off:off + rows * k * 8].copy_(ids.view(torch.uint8).reshape(-1))

        rt._run_kernel = run_kernel

    def fail(self, what: str, n: int) -> None:
        """Make the n-th (1-based) call of one kind fail (see fake_driver.c)."""
        assert self.lib.fake_fail(what.encode(), n) == 0, f"the fake driver cannot fail '{what}'"

    def counts(self) -> dict[str, int]:
        names = ("allocs", "frees", "live", "loads", "unloads", "captures", "graph_launches", "logged", "streams",
                 "graphs", "execs", "attrs", "traced")
        c = (ctypes.c_long * len(names))()
        self.lib.fake_counts(c)
        return dict(zip(names, c))

    def copies(self) -> dict[str, int]:
        """The copies so far by source kind, and the synchronisations (see fake_copies in fake_driver.c)."""
        names = ("pinned", "pinned_bytes", "pageable", "pageable_bytes", "d2h", "stream_syncs", "event_syncs",
                 "waited", "pinned_live", "events_live", "queued", "d2d")
        c = (ctypes.c_long * len(names))()
        self.lib.fake_copies(c)
        return dict(zip(names, c))

    def ipc(self) -> dict[str, int]:
        """The IPC calls so far (see fake_ipc in fake_driver.c) and hipExtMallocWithFlags' last flags."""
        names = ("exported", "opened", "closed", "open", "malloc_flags")
        c = (ctypes.c_long * len(names))()
        self.lib.fake_ipc(c)
        return dict(zip(names, c))

    def trace(self) -> list[str]:
        """The name of every driver call so far, in order."""
        return [self.lib.fake_trace(i).decode() for i in range(self.counts()["traced"])]

    def attrs(self) -> list[tuple[str, int, int, int, bool]]:
        """Each function-attribute call: kernel, attribute, value, launches logged before it, during capture."""
        out, name, v = [], ctypes.create_string_buffer(200), (ctypes.c_long * 4)()
        for i in range(self.counts()["attrs"]):
            assert self.lib.fake_attr(i, name, v) == 0
            out.append((name.value.decode(), v[0], v[1], v[2], bool(v[3])))
        return out

    def modules(self) -> list[str]:
        """The tag of the code object each logged launch's kernel came from (see fake_driver.c)."""
        tag = ctypes.create_string_buffer(80)
        out = []
        for i in range(self.counts()["logged"]):
            assert self.lib.fake_launch_module(i, tag) == 0
            out.append(tag.value.decode())
        return out

    def pdl(self) -> list[bool]:
        """Per logged launch (eager and replayed): launched with programmatic stream serialization."""
        return [self.lib.fake_launch_pdl(i) == 1 for i in range(self.counts()["logged"])]

    def log(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], bool]]:
        out = []
        name = ctypes.create_string_buffer(200)
        geom = (ctypes.c_uint32 * 7)()
        args = (ctypes.c_uint64 * 64)()
        rep = ctypes.c_int()
        for i in range(self.counts()["logged"]):
            n = self.lib.fake_launch(i, name, geom, args, ctypes.byref(rep))
            out.append((name.value.decode(), tuple(geom), tuple(args[:n]), bool(rep.value)))
        return out


def declared_params(launch, kernel=None) -> int:
    """The parameter count a kernel really has, from the program or the kernel itself (never from the
    schedule under test): a placeholder takes the launch's operands then results; a Triton kernel its
    non-constexpr parameters."""
    if kernel is None:
        return len(launch.operands) + len(launch.results)
    return sum(1 for a in kernel.fn.arg_names if a not in kernel.constexprs)


def fake_code_object(sched, drop: str | None = None) -> bytes:
    """The fake driver's code object for a schedule: every symbol with the parameter count its kernel
    declares (`declared_params`), so a call packing another count is caught by the fake driver."""
    syms = {}
    for f in sched.functions:
        for i, c in enumerate(f.calls):
            n = declared_params(f.program.launches[f.launch_of[i]], c.kernel)
            assert syms.setdefault(c.symbol, n) == n, c.symbol
    return ("FAKE\n" + "".join(f"{s} {n}\n" for s, n in sorted(syms.items()) if s != drop)).encode() + b"\0"


def fake_table(drop: str | None = None, tamper: bool = False):
    def make(sched) -> bytes:
        sched.code_objects = [fake_code_object(sched, drop)]
        t = bytearray(sched.to_bytes())
        if tamper:
            t[len(t) // 2] ^= 0x10
        return bytes(t)
    return make


# ---- the host-runtime step harness (one copy; the host, ABI, launch-check and hook tests use it) ----

def step_inputs(m, prompts, decode_steps, seed=3):
    """Step inputs as a runtime builds them: ragged chunked prefill, then decode of random tokens."""
    alloc = PagedAllocator(PoolGeometry.from_attrs(m.attrs))
    T = m.functions["prefill"].attrs["tokens"]
    lengths = [0] * len(prompts)
    for ids, pos, _ in prefill_chunks(prompts, lengths, T):
        yield "prefill", {"ids": ids, "pos": pos, **alloc.step_inputs(pos)}
    lengths = [len(p) for p in prompts]
    g = torch.Generator().manual_seed(seed)
    for _ in range(decode_steps):
        pos = torch.tensor(lengths).view(-1, 1)
        ids = torch.randint(0, 512, (len(prompts), 1), generator=g)
        yield "decode", {"ids": ids, "pos": pos, **alloc.step_inputs(pos)}
        lengths = [n + 1 for n in lengths]


def poison_buffers(rt, fname):
    for b in rt.program.functions[fname].buffers:
        if b.kind in ("arena", "output"):
            rt.write(rt.sched.buffer_index(fname, b.name), torch.full((b.nbytes,), POISON, dtype=torch.uint8))


def compare_buffers(rt, bufs, fname):
    bad = []
    for b in rt.program.functions[fname].buffers:
        if not torch.equal(rt.buffer(fname, b.name)[: b.nbytes], bufs.data[b.name]):  # the arena is the largest function's
            bad.append(b.name)
    return bad


PROMPTS = [list(range(5, 25)), list(range(40, 53)), [7, 8, 9, 10, 11, 12, 13]]


def executed_step(prog, w, fname, inputs):
    """The program executor's buffers after one step from zero pool and state: what the host device must match."""
    bufs = Buffers()
    state = {b.name: torch.zeros(b.type.shape) for b in prog.functions[fname].buffers if b.kind in ("pool", "state")}
    execute(prog.functions[fname], bufs, {**inputs, **state}, w)
    return bufs
