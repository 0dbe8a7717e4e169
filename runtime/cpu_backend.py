"""Device `cpu`: the artifact's ONNX models run by ONNX Runtime.

* Weights are mapped from `weights/*.safetensors` (no copy; hashed as they are first read when the load
  deferred their check) and handed to every session as shared external initializers (the ONNX files declare them as graph inputs; here they become
  initializers, so ONNX Runtime treats them as constants and no session copies them from a file).
* Pool planes and per-slot state live in host arrays owned by this backend, bound once as inputs of each
  session's IO binding (never copied, never rebound); so are a session's small step inputs (ids, positions,
  block table, slots: arrays of its own that a step's are copied into, or that the caller fills,
  `step_inputs`); a step's outputs are only the rows it wrote (`X.rows`, `X.vals`), stored here in place,
  in write order.
* Threads: `threads` intra-op threads per session (default `threads.default_threads(ORT_THREADS)`: the free
  cores, at most 8: ONNX Runtime's own default, every core, oversubscribes a shared machine); the other
  session options are the artifact's (`codegen.onnx_session`); sessions are created lazily, one per
  function, on first use.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import onnx

from v4compile.artifact import Artifact
from v4compile.errors import ArtifactError, InputError
from v4compile.threads import ORT_THREADS, default_threads

from v4compile.codegen.onnx_session import SessionOptions
from v4compile.codegen.onnx_weights import check_derived, materialise

from .artifact_checks import onnx_model
from .backend import FunctionInfo

log = logging.getLogger(__name__)

# ONNX Runtime's telemetry writes a device id and a database under HOME and a `.ses` file under TMPDIR as
# soon as it is imported; a run writes nothing outside its outputs and the documented cache. Read at import.
os.environ["ORT_DISABLE_TELEMETRY"] = "1"

_NP = {"fp32": np.float32, "i64": np.int64, "i32": np.int32}
_ORT_NP = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
# inputs a step gives (`backend.py`; `hidden`: the MTP draft functions' input streams); any other non-weight
# input is pool or state, owned here
STEP_INPUTS = ("ids", "pos", "block_table", "slot", "hidden")
OWN_INPUTS = ("ids", "pos", "block_table", "slot")  # bound once to the backend's own arrays (`_StepInputs`)
FEW_ROWS = 16  # writes of at most this many rows are stored row by row (`_store`, `_Writes`)


def _aligned(a: np.ndarray) -> np.ndarray:
    """A view is used as is when its elements are aligned (the shards pack tensors without gaps)."""
    return a if a.ctypes.data % max(a.itemsize, 1) == 0 else a.copy()


def graphs_of(fname: str, f: dict) -> list[tuple[str, dict]]:
    """A cpu function's ONNX graphs, each (session key, spec with the function's bucket): the function's
    one graph, or a partitioned function's segments (`codegen/onnx_segments.py`) in order."""
    if "segments" not in f:
        return [(fname, f)]
    return [(f"{fname}.s{k}", {**seg, "kind": f["kind"], "batch": f["batch"], "tokens": f["tokens"]})
            for k, seg in enumerate(f["segments"])]


def derived_weights(art: Artifact, target: dict) -> dict[str, dict]:
    """Every graph's derived weight inputs (`codegen.onnx_weights`), checked against the stored weights;
    one definition per name."""
    tensors = art.manifest["weights"]["tensors"]
    out: dict[str, dict] = {}
    for f in (g for n, fn in target["functions"].items() for _, g in graphs_of(n, fn)):
        der = f.get("derived", {})
        if not isinstance(der, dict):
            raise ArtifactError("the cpu target's derived weights are not an object", where=f["file"])
        for n, d in der.items():
            check_derived(n, d, tensors, f["file"])
            if out.setdefault(n, d) != d:
                raise ArtifactError(f"the cpu target defines derived weight '{n[:80]}' twice, differently",
                                    where=f["file"])
    return out


class _StepInputs:
    """A session's step inputs. The small ones of a static shape (`OWN_INPUTS`) are bound once, to arrays made
    here (`arrays`): a step's are copied into them, or are them (a caller that filled them, `step_inputs`), and
    nothing is bound again (a bind costs ~1.7 us an input, a copy of a few ints ~0.7 us). Any other is bound
    at each step, as given."""

    def __init__(self, io, ins: list[tuple[str, object]]):
        self.io, self.names = io, [n for n, _ in ins]
        self.arrays = {n: np.zeros(i.shape, dtype=_ORT_NP[i.type]) for n, i in ins if n in OWN_INPUTS
                       and i.type in _ORT_NP and all(isinstance(d, int) and d > 0 for d in i.shape)}
        for n, a in self.arrays.items():
            io.bind_cpu_input(n, a)
        self.bound: dict[str, np.ndarray] = dict(self.arrays)  # what each input is bound to now

    def place(self, inputs: dict[str, np.ndarray]) -> None:
        for n in self.names:
            x = inputs[n]
            a = self.arrays.get(n)
            if a is not None and (x is a or (x.shape == a.shape and x.dtype == a.dtype)):
                if x is not a:
                    a[...] = x
                if self.bound.get(n) is a:
                    continue
                x = a
            self.io.bind_cpu_input(n, x)  # ONNX Runtime's own error for a wrong shape or type
            self.bound[n] = x


class _Writes:
    """A session's writes (buffer name, its array, rows output, values output), its outputs' arrays made once
    (`_session`): the row indices of the writes of at most `FEW_ROWS` rows share one array (`rows`, each in
    output order), each row's values a view made once (`lanes`), so that a step's stores are one `tolist` and
    a row copy each, without the per-write work of `OrtBackend._store` (tiny-doc's decode step: 14 writes,
    23 rows; its one-call speculative step: 30 rows). A write of more rows (prefill), or a store that skips
    rows, takes `_store`."""

    def __init__(self, writes: list[tuple], rows: np.ndarray):
        self.all, self.rows = writes, rows
        few = [w for w in writes if w[2].base is rows and w[3].shape[:1] == w[2].shape]
        self.many = [w for w in writes if not any(w is f for f in few)]
        # in the arena's order: the writes were bound to it in output order
        few.sort(key=lambda w: w[2].ctypes.data)
        self.lanes = [(buf, vals[i]) for _, buf, rows_, vals in few for i in range(rows_.shape[0])]
        if len(self.lanes) != rows.size:  # a rows output in the arena whose values are not row by row
            self.lanes, self.many = None, writes

    def store(self, skip: dict[str, set[int]] | None = None) -> None:
        if skip or self.lanes is None:
            return OrtBackend._store(self.all, skip)
        for row, (buf, v) in zip(self.rows.tolist(), self.lanes):
            if row >= 0:
                buf[row] = v
        if self.many:
            OrtBackend._store(self.many)


class OrtBackend:
    device = "cpu"

    def __init__(self, art: Artifact, threads: int | None = None, profile: str | None = None,
                 options: SessionOptions | None = None, ranks=None):
        import onnxruntime as ort

        self.ort = ort
        self.art = art
        # a partitioned artifact: this process's rank (`distributed.Ranks`), its weights and collectives
        self.ranks = ranks
        self.threads = threads or default_threads(ORT_THREADS)
        self.profile = profile
        self.target = art.target("cpu")
        # the artifact's recorded session options (`options`: another choice, for measurements)
        self.options = options or SessionOptions.from_manifest(self.target.get("session"), "manifest.json")
        self._funcs = {n: FunctionInfo(n, f["kind"], f["batch"], f["tokens"]) for n, f in self.target["functions"].items()}
        self._graphs = {n: graphs_of(n, f) for n, f in self.target["functions"].items()}
        self._index = {n: i for i, n in enumerate(sorted(self._funcs))}
        if any(len(g) > 1 or "collective" in g[0][1] for g in self._graphs.values()) and ranks is None:
            raise InputError("a partitioned artifact runs on every rank of its layout", where=str(art.path),
                             expected="v4compile.load under torchrun")
        t0 = time.perf_counter()
        self.weights: dict[str, np.ndarray] = {}
        # the arrays below view its mappings: kept open as long as the backend (a rank maps its own only)
        self._mapped = art.weights(ranks.rank if ranks is not None else 0)
        stored = dict(self._mapped.stream())
        direct = {n for gs in self._graphs.values() for _, g in gs for n in g["weights"]}
        for n in sorted(direct):
            t = stored[n]
            if t.dtype.is_floating_point and str(t.dtype) != "torch.float32":
                raise InputError("the cpu device takes this weight as stored, and needs it in fp32", where=n,
                                 found=str(t.dtype))
            self.weights[n] = _aligned(t.numpy())
        # the derived inputs (experts as views of their stack, quantised weights dequantised): built once
        for n, d in derived_weights(art, self.target).items():
            self.weights[n] = _aligned(materialise(d, stored.__getitem__))
        del stored
        self._w_values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.weights.items()}
        self.weights_s = time.perf_counter() - t0
        log.debug("cpu backend: %d weights mapped in %.2f s", len(self.weights), self.weights_s)
        self.state: dict[str, np.ndarray] = {}
        pool = art.manifest["pool"]
        self.geometry = pool
        self._sessions: dict[str, tuple] = {}
        self._built: dict[str, object] = {}  # graphs made here from the artifact's own (`built`), until their session
        self._added: dict[str, list[str]] = {}  # a `variant`'s check-mode outputs

    def functions(self) -> dict[str, FunctionInfo]:
        return dict(self._funcs)

    # ---- sessions --------------------------------------------------------------------------------
    def _session(self, fname: str, k: int = 0):
        key, spec = self._graphs[fname][k]
        if key in self._sessions:
            return self._sessions[key]
        ort = self.ort
        model = self._built.pop(key) if key in self._built else onnx_model(self.art, key, spec)
        g = model.graph
        used = {x for n in g.node for x in n.input}
        declared = set(spec["weights"]) | set(spec.get("derived", {}))
        wnames = declared & used
        keep, moved = [], []
        for vi in g.input:
            if vi.name in wnames:
                moved.append(vi)
            elif vi.name not in declared:
                keep.append(vi)
        del g.input[:]
        g.input.extend(keep)
        for vi in moved:  # declared as an external initializer; the data comes from add_external_initializers
            t = onnx.TensorProto()
            t.name = vi.name
            t.data_type = vi.type.tensor_type.elem_type
            t.dims.extend(d.dim_value for d in vi.type.tensor_type.shape.dim)
            t.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", "v4compile-weights"), ("offset", "0"), ("length", str(self.weights[vi.name].nbytes))):
                e = t.external_data.add()
                e.key, e.value = k, v
            g.initializer.append(t)
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        self.options.apply(ort, so)
        if self.profile:
            so.enable_profiling = True
            so.profile_file_prefix = os.path.join(self.profile, key)
        names = sorted(wnames)
        so.add_external_initializers(names, [self._w_values[n] for n in names])
        t0 = time.perf_counter()
        try:
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001  (ONNX Runtime's own refusal of a graph that passed our checks)
            raise ArtifactError(f"ONNX Runtime refuses the graph: {str(e)[:300]}", where=spec["file"]) from None
        log.debug("cpu backend: session %s ready in %.2f s", key, time.perf_counter() - t0)
        del model
        ins = {i.name: i for i in sess.get_inputs()}
        # values another segment of the function computes, or a collective returns, are not state
        passed = {n for _, g in self._graphs[fname] for n in g["outputs"]} | {
            g["collective"]["result"] for _, g in self._graphs[fname] if g.get("collective")}
        for n, i in ins.items():
            if n not in STEP_INPUTS and n not in passed and n not in self.state:
                dt = _ORT_NP[i.type]
                self.state[n] = np.zeros(i.shape, dtype=dt)
        outs = [o.name for o in sess.get_outputs()]
        io = sess.io_binding()
        for n in ins:
            if n in self.state:
                io.bind_cpu_input(n, self.state[n])
        # Outputs of a static shape (every graph the compiler emits) are written into arrays made here once:
        # a step creates no output arrays (no copy_outputs_to_cpu). With the row-by-row writes of
        # `_run_graph`, tiny decode b1 -6.5 % (same-process A/B, 15 alternating rounds, paired median).
        # Any other output is copied out after each run. The row indices of the writes of at most `FEW_ROWS`
        # rows (int64, static: a step's) share one array, read with one `tolist` a step (`_Writes`).
        few = [o for o in sess.get_outputs() if o.name.endswith(".rows") and o.type == "tensor(int64)"
               and len(o.shape) == 1 and isinstance(o.shape[0], int) and 0 < o.shape[0] <= FEW_ROWS]
        arena = np.empty(sum(o.shape[0] for o in few), dtype=np.int64)
        at = {o.name: arena[i: i + o.shape[0]] for o, i in zip(few, np.cumsum([0] + [o.shape[0] for o in few]))}
        bufs = []
        for o in sess.get_outputs():
            if all(isinstance(d, int) and d > 0 for d in o.shape) and o.type in _ORT_NP:
                b = at[o.name] if o.name in at else np.empty(o.shape, dtype=_ORT_NP[o.type])
                io.bind_output(o.name, "cpu", 0, b.dtype, list(b.shape), b.ctypes.data)
                bufs.append(b)
            else:
                io.bind_output(o.name, "cpu")
                bufs.append(None)
        step_ins = _StepInputs(io, [(n, i) for n, i in ins.items() if n not in self.state])
        # each written plane / state tensor: (its buffer, index of its rows output, index of its values)
        writes = [(n[: -len(".rows")], self.state[n[: -len(".rows")]], i, outs.index(n[: -len(".rows")] + ".vals"))
                  for i, n in enumerate(outs) if n.endswith(".rows")]
        kept = [(i, n) for i, n in enumerate(outs) if not n.endswith((".rows", ".vals"))]
        if any(b is None for b in bufs):
            bufs = None
        else:  # the outputs' arrays are the session's for good: the writes' plan and the outputs' views made once
            writes = _Writes([(name, buf, bufs[r], bufs[v]) for name, buf, r, v in writes], arena)
        self._sessions[key] = (sess, step_ins, outs, io, writes, kept, bufs)
        return self._sessions[key]

    def built(self, fname: str, build) -> str:
        """Graph `fname`, made at its first request by `build() -> (ONNX model, spec: file, weights, derived,
        outputs)` from this artifact's own checked graphs (speculation's one-call step, `codegen/onnx_spec.py`):
        run with `run_outputs(fname, ...)` like a function of the artifact, but not one of `functions()`."""
        if fname not in self._graphs:
            model, spec = build()
            self._built[fname] = model
            self._graphs[fname] = [(fname, spec)]
        return fname

    def variant(self, fname: str, suffix: str, edit) -> tuple[str, list[str]]:
        """Function `fname` with check-mode outputs added to its graphs: `edit(model) -> [output names added]` on
        each graph (one, or a partitioned function's segments, each its rank's own), a graph it adds none to
        left shared. Returns its name, `fname.suffix`, and the outputs added (the same on every later call).
        Run with `run_outputs(name)` like `fname` (the same step,
        collectives and state); under data parallelism the added outputs come back as this rank computed them,
        beside the gathered logits. Built once, at its first request (the self-check's router picks,
        `self_check.ChoiceReader`)."""
        name = f"{fname}.{suffix}"
        if name not in self._graphs:
            graphs, added = [], []
            for key, spec in self._graphs[fname]:
                model = onnx_model(self.art, key, spec)
                got = edit(model)
                if got:
                    key = f"{key}.{suffix}"
                    self._built[key] = model
                    added += got
                graphs.append((key, spec))
            self._graphs[name] = graphs
            if fname in self._index:  # the step every rank checks against rank 0's is `fname`'s
                self._index[name] = self._index[fname]
            self._added[name] = added
        return name, list(self._added[name])

    def prepare(self, fnames) -> None:
        """Create the sessions of these functions now (each takes ONNX Runtime's graph optimisation)."""
        for f in fnames:
            for k in range(len(self._graphs[f])):
                self._session(f, k)

    def run(self, fname: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.run_outputs(fname, inputs)["logits"]

    def run_outputs(self, fname: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`run`, returning every output the step does not keep here (logits; a speculative artifact's
        `streams`)."""
        if self.ranks is None:
            return self._run_graph(fname, 0, inputs)
        # every rank runs rank 0's step; the segments with the collectives between them
        env = dict(self.ranks.step(self._index[fname], fname, inputs))
        for k, (_, spec) in enumerate(self._graphs[fname]):
            env.update(self._run_graph(fname, k, env))
            c = spec.get("collective")
            if c is not None:
                x = env[c["operand"]]
                env[c["result"]] = self.ranks.all_reduce(x, c["group"]) if c["op"] == "all_reduce" else \
                    self.ranks.collective_np(c["op"], x, c["group"], c.get("tp", 1))
        # data parallel: every replica's logits (`distributed.Ranks.replicas`), a variant's outputs this rank's own
        if self.art.manifest["parallel"].get("dp", 1) == 1:
            return env
        return {**self.ranks.replicas(env), **{n: env[n] for n in self._added.get(fname, ())}}

    def share_ids(self, ids: list[int]) -> list[int]:
        """Sampled ids as every rank takes them: rank 0's (`distributed.Ranks.share_ids`)."""
        return ids if self.ranks is None else self.ranks.share_ids(ids)

    def _run_graph(self, fname: str, k: int, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One graph; the rows it wrote stored into the state; its other outputs returned."""
        out, writes = self._run_held(fname, k, inputs)
        self._store(writes)
        return out

    def run_held(self, fname: str, inputs: dict[str, np.ndarray], views: bool = False):
        """`run_outputs` of a one-graph function without storing its writes yet: (outputs, `store(skip)`), which
        stores them but the rows `skip` names ({state name: rows}), before the next run. Speculation's verify
        leaves out the rows of its rejected positions this way instead of saving and restoring them. `views`:
        the outputs are the session's own buffers, valid until this function's next run (a caller that reads
        a few ids at once copies nothing)."""
        if self.ranks is not None or len(self._graphs[fname]) != 1:
            raise ValueError(f"{fname}: held writes need a one-graph function of an unpartitioned artifact")
        out, writes = self._run_held(fname, 0, inputs, views)
        return out, lambda skip=None: self._store(writes, skip)

    def _run_held(self, fname: str, k: int, inputs: dict[str, np.ndarray], views: bool = False):
        sess, step_ins, outs, io, writes, kept, bufs = self._session(fname, k)
        # The binding is the session's, made once: the state arrays are bound once (their buffers are
        # updated in place by `_store`, never replaced) and the outputs once; a step places its step inputs only.
        step_ins.place(inputs)
        sess.run_with_iobinding(io)
        if bufs is None:
            res = io.copy_outputs_to_cpu()
            return {n: res[i] for i, n in kept}, [(name, buf, res[r], res[v]) for name, buf, r, v in writes]
        # the caller keeps what it is given: never a view of a buffer the next run overwrites
        return ({n: bufs[i] for i, n in kept} if views else {n: bufs[i].copy() for i, n in kept}), writes

    def step_inputs(self, fname: str) -> dict[str, np.ndarray]:
        """The arrays that one-graph function `fname`'s session has bound for its small step inputs (`ids`, `pos`,
        `block_table`, `slot`; `_StepInputs`), the same for the session's life: a caller that fills them in place
        before each run and passes them as its inputs has nothing copied or bound (speculation's one-call step)."""
        if len(self._graphs[fname]) != 1:
            raise ValueError(f"{fname}: the step inputs of a one-graph function only")
        return dict(self._session(fname)[1].arrays)

    @staticmethod
    def _store(writes, skip: dict[str, set[int]] | None = None) -> None:
        if isinstance(writes, _Writes):
            return writes.store(skip)
        for name, buf, rows, vals in writes:
            drop = skip.get(name) if skip else None
            # a decode step's few rows, one by one: ~1-2 us a row against ~20 us for a mask and two fancy
            # indexes on caches a step has just gone through (tiny decode b1: the step's 14 writes, 9 rows the
            # largest, 47 -> 24 us measured between runs)
            if drop:
                OrtBackend._store_but(buf, rows, vals, drop)
                continue
            if rows.size <= FEW_ROWS:
                for i, row in enumerate(rows.tolist()):
                    if row >= 0:
                        buf[row] = vals[i]
                continue
            ok = rows >= 0
            if ok.all():
                buf[rows] = vals
            elif ok.any():
                buf[rows[ok]] = vals[ok]

    @staticmethod
    def _store_but(buf: np.ndarray, rows: np.ndarray, vals: np.ndarray, drop: set[int]) -> None:
        """Store rows but those of `drop`, which count rows of `buf` seen as `[-1, last axis]` (`undo.py`'s row
        spaces): a compressor state write is a whole slot's ring (`[S, c * d]` a row), of which the dropped
        ring entries keep what they held."""
        flat = buf.reshape(-1, buf.shape[-1])
        per = flat.shape[0] // buf.shape[0]
        if per == 1 and rows.size > 16:  # as `_store`'s: many rows in one write (a batch's verify lanes); the
            # mask from Python's set (np.isin costs more on a few dozen rows: 192 rows, 24 dropped, ~50 against
            # ~120 us row by row and ~165 us with isin, measured on this example)
            ok = np.fromiter((r >= 0 and r not in drop for r in rows.tolist()), dtype=bool, count=rows.size)
            buf[rows[ok]] = vals[ok]
            return
        for i, row in enumerate(rows.tolist()):
            if row < 0:
                continue
            if per == 1:
                if row not in drop:
                    buf[row] = vals[i]
                continue
            kept = [(r, flat[r].copy()) for r in drop if row * per <= r < (row + 1) * per]
            buf[row] = vals[i]
            for r, v in kept:
                flat[r] = v

    def end_profiling(self) -> list[str]:
        return [s.end_profiling() for s, *_ in self._sessions.values()]

    def close(self) -> None:
        self._sessions.clear()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
