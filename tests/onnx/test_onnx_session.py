"""The cpu device's ONNX Runtime sessions (issue 22): `--threads` reaches the intra-op setting, the default
does not oversubscribe, the artifact records its session options and the runtime applies exactly those; a
tampered record (session options, derived weights) is one clear ArtifactError."""

from __future__ import annotations

import pytest

import v4compile
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.codegen.onnx_session import SessionOptions
from v4compile.cli.driver import compile_artifact
from v4compile.errors import ArtifactError
from v4compile.trace import TraceOptions

from artifact_tamper import copy, manifest, write_manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    # a 64-token prefill routes tiny's experts grouped (`moe.dense_is_cheaper`): derived expert views to tamper
    return compile_artifact(fe, tmp_path_factory.mktemp("art") / "tiny", Buckets(decode=(1,), prefill=(64,)))


def _a_derived(t: dict) -> dict:
    return next(d for f in t["functions"].values() for d in f.get("derived", {}).values() if d["index"] is not None)


def _options(sess, fname="decode_b1"):
    """The options ONNX Runtime's session for `fname` was created with."""
    be = sess.backend
    be.prepare([fname])
    return be._sessions[fname][0].get_session_options()


def test_threads_reach_onnx_runtime(art, monkeypatch):
    assert _options(v4compile.load(art, device="cpu", threads=3)).intra_op_num_threads == 3
    import v4compile.threads as T

    monkeypatch.setattr(T.os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # every core busy elsewhere
    assert _options(v4compile.load(art, device="cpu")).intra_op_num_threads == 1
    monkeypatch.setattr(T.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert _options(v4compile.load(art, device="cpu")).intra_op_num_threads == T.ORT_THREADS


def test_cli_threads_reach_the_backend(art, monkeypatch, capsys):
    from v4compile.cli import main
    from v4compile.runtime import cpu_backend

    seen = []
    init = cpu_backend.OrtBackend.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        seen.append(self.threads)
    monkeypatch.setattr(cpu_backend.OrtBackend, "__init__", spy)
    assert main(["run", str(art), "--device", "cpu", "--ids", "1,2,3", "--max-new-tokens", "2", "--threads", "2"]) == 0
    assert seen == [2]


def test_the_recorded_session_options_are_applied(art, tmp_path):
    import onnxruntime as ort

    rec = manifest(art)["targets"][0]["session"]
    assert rec == SessionOptions().to_manifest() and rec["graph_optimization_level"] == "all"
    so = _options(v4compile.load(art, device="cpu", threads=1))
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert so.inter_op_num_threads == 1 and so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    other = copy(art, tmp_path / "basic")
    m = manifest(other)
    m["targets"][0]["session"]["graph_optimization_level"] = "basic"
    write_manifest(other, m)
    so = _options(v4compile.load(other, device="cpu", threads=1))
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC


@pytest.mark.parametrize("edit, words", [
    (lambda t: t["session"].update(graph_optimization_level="max"), "optimisation level"),
    (lambda t: t["session"].update(inter_op_threads=True), "inter-op threads"),
    (lambda t: t["session"].pop("allow_spinning"), "session options"),
    (lambda t: _a_derived(t).update(index=99), "indexes outside"),
    (lambda t: _a_derived(t).update(of="embed.weight"), "derived weight"),
])
def test_a_tampered_record_is_one_clear_error(art, tmp_path, edit, words):
    bad = copy(art, tmp_path / "bad")
    m = manifest(bad)
    edit(m["targets"][0])
    write_manifest(bad, m)
    with pytest.raises(ArtifactError, match=words):
        v4compile.load(bad, device="cpu", threads=1).prefill([[1, 2, 3]])


def test_outputs_land_in_bound_arrays_and_the_caller_keeps_its_logits(art, monkeypatch):
    """A step's outputs are written into arrays bound once (no copy_outputs_to_cpu per step), and the
    logits a step returns are the caller's: the next step does not overwrite them. A backend that handed
    out its bound buffer itself (the broken variant below) fails the second check."""
    import numpy as np
    import onnxruntime as ort

    from v4compile.runtime import cpu_backend

    def steps(sess):
        seqs, lg = sess.prefill([[5, 6, 7]])
        a = sess.decode(seqs, [int(lg[0].argmax())])
        kept = a.copy()
        b = sess.decode(seqs, [int(a[0].argmax())])
        return a, kept, b

    copied, copy = [], ort.IOBinding.copy_outputs_to_cpu
    monkeypatch.setattr(ort.IOBinding, "copy_outputs_to_cpu", lambda self: copied.append(1) or copy(self))
    a, kept, b = steps(v4compile.load(art, device="cpu", threads=1))
    assert copied == []
    assert not np.array_equal(kept, b)  # two different steps: had they shared a buffer, `a` would be `b`
    np.testing.assert_array_equal(a, kept)

    run = cpu_backend.OrtBackend._run_graph

    def shares(self, fname, k, inputs):  # the fault: the bound buffers themselves, not copies
        run(self, fname, k, inputs)
        *_, kept, bufs = self._sessions[self._graphs[fname][k][0]]
        return {n: bufs[i] for i, n in kept}
    monkeypatch.setattr(cpu_backend.OrtBackend, "_run_graph", shares)
    a, kept, b = steps(v4compile.load(art, device="cpu", threads=1))
    assert not np.array_equal(a, kept)


def test_step_inputs_bound_once_and_rows_stored_as_before(art, monkeypatch):
    """A step's small inputs are copied into arrays its session bound once (`cpu_backend._StepInputs`: no
    bind in a step), and the writes of a few rows are stored from one row array (`_Writes`): a prefill and 5
    decode steps give, bit for bit, the logits of a backend that binds each step's arrays and stores write by
    write (the way before). Broken variants, each caught by the same comparison: inputs placed without the
    copy (every step runs on the arrays as first bound), a store that drops the last few rows."""
    import numpy as np
    import onnxruntime as ort

    from v4compile.runtime import cpu_backend

    def steps(sess):
        sess.backend.prepare(["prefill_c64", "decode_b1"])
        bound, bind = [], ort.IOBinding.bind_cpu_input
        with monkeypatch.context() as mp:
            mp.setattr(ort.IOBinding, "bind_cpu_input", lambda self, n, a: bound.append(n) or bind(self, n, a))
            seqs, lg = sess.prefill([[5, 6, 7, 9]])
            out = [lg[0]]
            for _ in range(5):
                out.append(sess.decode(seqs, [int(out[-1].argmax())])[0].copy())
        return np.stack(out), bound

    def old_place(self, inputs):
        for n in self.names:
            self.io.bind_cpu_input(n, inputs[n])
    with monkeypatch.context() as mp:
        mp.setattr(cpu_backend._StepInputs, "place", old_place)
        mp.setattr(cpu_backend._Writes, "store", lambda self, skip=None: cpu_backend.OrtBackend._store(self.all, skip))
        want, _ = steps(v4compile.load(art, device="cpu", threads=1))
    got, bound = steps(v4compile.load(art, device="cpu", threads=1))
    assert bound == []
    np.testing.assert_array_equal(got, want)
    assert len({int(x.argmax()) for x in got}) > 1  # the steps differ: stale inputs would show

    def no_copy(self, inputs):  # the fault: a step's inputs never reach the bound arrays
        pass

    def drops(self, skip=None):  # the fault: the last few rows (a state's) not stored
        for row, (buf, v) in list(zip(self.rows.tolist(), self.lanes))[:-3]:
            if row >= 0:
                buf[row] = v
        cpu_backend.OrtBackend._store(self.many)
    for cls, name, fault in ((cpu_backend._StepInputs, "place", no_copy), (cpu_backend._Writes, "store", drops)):
        with monkeypatch.context() as mp:
            mp.setattr(cls, name, fault)
            broken, _ = steps(v4compile.load(art, device="cpu", threads=1))
        assert not np.array_equal(broken, want), name
