"""A damaged or hostile artifact, bad `run` arguments and misuse of the Python API (issue 24, classes 2, 3, 4,
6, 7; the path confinement of class 1 is tests/runtime/test_artifact_security.py, the caches of class 5
tests/runtime/test_caches.py). Each case: the API raises the documented `InputError` (`ArtifactError` for the
artifact), the CLI exits 2 with one `error:` line and no traceback. Edited manifests have their hashes
recomputed, so only the schema and the cross-checks stand in the way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import v4compile
from artifact_tamper import compile_cpu, restore_torch_threads, copy, manifest, sha, write_manifest  # noqa: F401 (an autouse fixture)
from bad_input_util import assert_one_error, run_main
from v4compile.cli import main
from v4compile.errors import ArtifactError, InputError


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return compile_cpu(tmp_path_factory.mktemp("bad") / "tiny", "1,2")


@pytest.fixture(scope="module")
def session(art):
    s = v4compile.load(art, device="cpu", threads=1)
    yield s
    s.close()


def _refused(path, *needles: str) -> str:
    """Refused by the API (ArtifactError) and the CLI (one error line); returns the CLI's line."""
    with pytest.raises(ArtifactError) as e:
        s = v4compile.load(path, device="cpu", threads=1)
        try:
            s.generate([[1, 2, 3]], 2)  # what is checked lazily (a graph on first use) is checked here
        finally:
            s.close()
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    rc, out, err = run_main("run", str(path), "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu",
                            "--threads", "1")
    assert out == ""
    return assert_one_error(rc, err, *needles)


# ---- class 2: the manifest's fields --------------------------------------------------------------

def _set(m, path, value):
    d = m
    for k in path[:-1]:
        d = d[k]
    if value is KeyError:
        del d[path[-1]]
    else:
        d[path[-1]] = value


FIELDS = [
    (("max_context",), 10 ** 12, "max_context"),
    (("max_context",), 1.5, "max_context"),
    (("pool", "n_blocks"), 10 ** 12, "pool.n_blocks"),
    (("pool", "blocks_per_seq"), 10 ** 12, "pool.blocks_per_seq"),
    (("pool", "block_tokens"), 0, "pool.block_tokens"),
    (("pool", "n_slots"), 0, "pool.n_slots"),
    (("pool", "n_blocks"), 7, "pool.n_blocks"),
    (("targets",), {"name": "cpu"}, "targets"),
    (("targets", 0, "functions", "decode_b1", "batch"), KeyError, "decode_b1.batch"),
    (("targets", 0, "functions", "decode_b1", "batch"), True, "decode_b1.batch"),
    (("vocab_size",), 511, "vocab_size"),
    (("config", "vocab_size"), 1024, "config"),
    (("buckets", "decode_batch"), [2, 1], "buckets.decode_batch"),
    (("weights", "tensors", "embed.weight", "shape"), [1, 2, 3, 4, 5, 6, 7, 8, 9], "embed.weight"),
    (("weights", "tensors", "embed.weight", "dtype"), "complex", "embed.weight"),
    (("kernels",), "none", "kernels"),
    (("format_version",), 1, "format version"),  # the whole-file hashes of shards: refused, not misread
    (("format_version",), 2, "format version"),  # whole-tensor sha256s: refused, not misread as tree digests
    (("weights", "hash"), "sha256", "weights.hash"),  # a hash scheme this reader does not compute
    (("weights", "hash"), KeyError, "weights.hash"),
]


@pytest.mark.parametrize("path,value,needle", FIELDS, ids=[".".join(map(str, f[0])) + f"={f[1]!r}"[:24]
                                                           for f in FIELDS])
def test_a_manifest_field_out_of_its_schema_is_one_error(art, tmp_path, path, value, needle):
    a = copy(art, tmp_path / "a")
    m = manifest(a)
    _set(m, path, value)
    if path[0] == "config":  # the attacker recomputes the config's hash too
        import hashlib
        m["config_hash"] = hashlib.sha256(json.dumps(m["config"], sort_keys=True).encode()).hexdigest()
    write_manifest(a, m)
    _refused(a, needle)


@pytest.mark.parametrize("text,needle", [
    ('{"format_version": 1, "max_context": NaN}', "not valid JSON"),
    ('{"format_version": 1, "format_version": 1}', "twice"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"a": ' + "[" * 17 + "]" * 17 + "}", "nested too deeply"),
    ("\xff", "not UTF-8"),
    ("[1, 2]", "JSON object"),
], ids=["nan", "duplicate-key", "deep-100000", "deep-18", "not-utf8", "not-object"])
def test_a_manifest_that_is_not_strict_json_is_one_error(art, tmp_path, text, needle):
    a = copy(art, tmp_path / "a")
    (a / "manifest.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff")
    _refused(a, needle)


def test_zero_free_slots_make_generate_raise_not_loop(session):
    held, _ = session.prefill([[1, 2]] * len(session.free_slots))
    try:
        assert not session.free_slots
        t0 = time.perf_counter()
        with pytest.raises(InputError, match="free sequence slot"):
            session.generate([[1, 2, 3]], 2)
        assert time.perf_counter() - t0 < 30
    finally:
        for s in held:
            session.release(s)


# ---- class 3: pieces checked against each other ---------------------------------------------------

def _swap_file(a, rel: str, data: bytes) -> None:
    (a / rel).write_bytes(data)
    m = manifest(a)
    m["files"][rel] = sha(a / rel)
    write_manifest(a, m)


@pytest.mark.parametrize("what", ["other bucket", "garbage", "empty", "external data", "other weight shape"])
def test_an_onnx_graph_that_disagrees_is_one_error(art, tmp_path, what):
    import onnx

    a = copy(art, tmp_path / "a")
    rel = "onnx/decode_b1.onnx"
    if what == "other bucket":
        data = (a / "onnx/decode_b2.onnx").read_bytes()
        needle = "not that of decode_b1"
    elif what == "garbage":
        data = np.random.default_rng(0).bytes(5000)
        needle = "cannot be parsed"
    elif what == "empty":
        data, needle = b"", "interface"
    else:
        model = onnx.load_from_string((a / rel).read_bytes())
        if what == "external data":
            t = onnx.TensorProto(name="x_ext", data_type=1, dims=[4], data_location=onnx.TensorProto.EXTERNAL)
            for k, v in (("location", "../../../etc/passwd"), ("offset", "0"), ("length", "16")):
                e = t.external_data.add()
                e.key, e.value = k, v
            model.graph.initializer.append(t)
            needle = "external file"
        else:
            vi = next(i for i in model.graph.input if i.name == "embed.weight")
            vi.type.tensor_type.shape.dim[0].dim_value += 1
            needle = "embed.weight"
        data = model.SerializeToString()
    _swap_file(a, rel, data)
    _refused(a, needle)


def test_weights_that_disagree_with_the_manifest_are_one_error(art, tmp_path):
    """A shard rewritten with one tensor of another shape (the manifest's hashes recomputed)."""
    from v4compile.safetensors_io import SafetensorsFile, write_file

    a = copy(art, tmp_path / "a")
    rel = manifest(a)["weights"]["shards"][0]
    with SafetensorsFile(a / rel) as f:
        ts = {k: f.read(k) for k in f.tensors}
    ts["embed.weight"] = ts["embed.weight"][:-1].contiguous()
    write_file(a / rel, ts)
    m = manifest(a)
    m["files"][rel] = sha(a / rel)
    write_manifest(a, m)
    _refused(a, "embed.weight", "does not hold the tensor the manifest names")


def test_a_program_of_other_functions_is_one_error(art, tmp_path):
    """The host device's program (the cpu target's `program.txt` here) must hold the manifest's functions."""
    a = copy(art, tmp_path / "a")
    text = (a / "program.txt").read_text()
    assert "func @decode_b2 " in text
    _swap_file(a, "program.txt", text.replace("func @decode_b2 ", "func @decode_b3 ").encode())
    with pytest.raises(ArtifactError, match="program's functions"):
        v4compile.load(a, device="host")
    rc, _, err = run_main("run", str(a), "--ids", "1", "--max-new-tokens", "1", "--device", "host")
    assert_one_error(rc, err, "program's functions")


def _allocations(monkeypatch) -> list[str]:
    """Records every allocation of a device's buffers, as it starts: an ONNX Runtime session (cpu: its
    initializers and arena; the state arrays come after it) or a C runtime (host: every program buffer)."""
    import onnxruntime as ort

    from v4compile.runtime import c_backend

    seen: list[str] = []
    real_session, real_init = ort.InferenceSession, c_backend.CRuntime.__init__

    def session(*a, **k):
        seen.append("ONNX Runtime session")
        return real_session(*a, **k)

    def init(self, *a, **k):
        seen.append("C runtime")
        real_init(self, *a, **k)
    monkeypatch.setattr(ort, "InferenceSession", session)
    monkeypatch.setattr(c_backend.CRuntime, "__init__", init)
    return seen


def _check_refused_before_allocating(art, monkeypatch, device: str) -> None:
    from v4compile.runtime import artifact_checks

    seen = _allocations(monkeypatch)
    monkeypatch.setattr(artifact_checks, "host_memory", lambda: 4096)  # the machine made to look small
    with pytest.raises(ArtifactError, match="too large to allocate|do not fit"):
        s = v4compile.load(art, device=device, threads=1)
        s.generate([[1, 2]], 1)
    assert seen == [], f"allocated before the refusal: {seen}"


def _allocate_first(monkeypatch, device: str) -> None:
    """The planted fault: a loader that allocates first and checks afterwards (same error, wrong order). cpu:
    each graph's session is made before the graph is checked; host: a C runtime of the program is opened
    before its buffers are summed."""
    from v4compile.runtime import c_backend, cpu_backend, program_backend

    if device == "cpu":
        real = cpu_backend.onnx_model

        def onnx_model(art, key, spec):
            import onnxruntime as ort

            ort.InferenceSession(art.read_bytes(spec["file"]), providers=["CPUExecutionProvider"])
            return real(art, key, spec)
        monkeypatch.setattr(cpu_backend, "onnx_model", onnx_model)
    else:
        real = program_backend.program_interface

        def program_interface(art, program, gpu, host=False):
            try:
                c_backend.CRuntime(program, {}, "host").close()
            except InputError:  # no weights given: refused after its buffers were allocated
                pass
            return real(art, program, gpu, host=host)
        monkeypatch.setattr(program_backend, "program_interface", program_interface)


@pytest.mark.parametrize("device", ["cpu", "host"])
def test_state_beyond_this_machines_memory_is_refused_before_allocating(art, monkeypatch, device):
    """The graph's (cpu) or program's (host) buffers are summed before any is allocated; here the machine is
    made to look small, and every allocation of device buffers is recorded: none may come before the
    refusal."""
    _check_refused_before_allocating(art, monkeypatch, device)


@pytest.mark.parametrize("device", ["cpu", "host"])
def test_a_loader_that_allocates_before_checking_fails_the_order_test(art, monkeypatch, device):
    """The broken variant (`_allocate_first`): the same error is raised, after an allocation, and the
    order assertion of `_check_refused_before_allocating` fails."""
    _allocate_first(monkeypatch, device)
    with pytest.raises(AssertionError, match="allocated before the refusal"):
        _check_refused_before_allocating(art, monkeypatch, device)


def _sidecar_case(side, k):
    from v4compile.runtime.artifact_checks import check_sidecar
    return check_sidecar(side, k, "sm_90a")


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("grid"), "grid"),
    (lambda s: s.update(grid=[1, 1]), "grid"),
    (lambda s: s.update(grid=[-1, 1, 1]), "grid"),
    (lambda s: s.update(block=[4096, 1, 1]), "block"),
    (lambda s: s.update(block=[96, 1, 1]), "block"),
    (lambda s: s.update(num_warps=10 ** 6), "num_warps"),
    (lambda s: s.update(shared_bytes=10 ** 12), "shared_bytes"),
    (lambda s: s.update(shared_bytes=-1), "shared_bytes"),
    (lambda s: s["params"][-1].update(size_per_program=10 ** 15), "size_per_program"),
    (lambda s: s.update(symbol=None), "symbol"),
    (lambda s: s.update(warp_size=64), "warp_size"),
    (lambda s: s.update(binary_sha256="0" * 64), "binary_sha256"),
    (lambda s: s.update(params="x"), "params"),
])
def test_a_sidecar_out_of_the_targets_limits_is_one_error(edit, needle):
    good = {"name": "k", "target": "sm_90a", "symbol": "k_kernel", "binary_sha256": "a" * 64, "warp_size": 32,
            "grid": [4, 1, 1], "num_warps": 4, "block": [128, 1, 1], "shared_bytes": 1024,
            "params": [{"name": "x_ptr", "kind": "operand", "type": "*fp32"},
                       {"name": "global_scratch", "kind": "triton_scratch", "size_per_program": 0},
                       {"name": "profile_scratch", "kind": "triton_scratch", "size_per_program": 0}]}
    k = {"name": "k", "sha256": "a" * 64, "sidecar": "kernels/sm_90a/k.json"}
    assert _sidecar_case(json.loads(json.dumps(good)), k)
    bad = json.loads(json.dumps(good))
    edit(bad)
    with pytest.raises(ArtifactError, match=needle):
        _sidecar_case(bad, k)


# ---- class 4: run arguments and API types --------------------------------------------------------

@pytest.mark.parametrize("flag,value", [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"), ("--top-p", "0"),
    ("--top-p", "nan"), ("--seed", "-1"), ("--seed", str(2 ** 64)), ("--threads", "0"), ("--threads", "-2"),
    ("--threads", str(10 ** 9)), ("--max-new-tokens", "0"), ("--max-new-tokens", "1.5"),
])
def test_a_bad_run_argument_is_one_error(art, flag, value):
    rc, out, err = run_main("run", str(art), "--ids", "1,2,3", "--max-new-tokens", "2", flag, value)
    assert_one_error(rc, err, flag)
    assert out == ""


@pytest.mark.parametrize("kw", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1.0}, {"temperature": "0"},
    {"top_p": float("nan")}, {"seed": -1}, {"seed": 2 ** 64}, {"seed": 1.5}, {"seed": "1"},
    {"max_new_tokens": 1.5}, {"max_new_tokens": -1}, {"stop_ids": [1.5]},
])
def test_a_bad_generate_argument_is_an_input_error(session, kw):
    args = {"max_new_tokens": 2, **kw}
    n = args.pop("max_new_tokens")
    free = len(session.free_slots)
    with pytest.raises(InputError):
        session.generate([[1, 2, 3]], n, **args)
    assert len(session.free_slots) == free


@pytest.mark.parametrize("prompts", [None, [1, 2, 3], ["abc"], "abc", [[1.5, 2.7]], [[1, None]], [None],
                                     [[True, 2]], [np.array([1.5])], [[1, 2 ** 70]], [[-1]]])
def test_bad_ids_are_an_input_error_never_truncated(session, prompts):
    free = len(session.free_slots)
    with pytest.raises(InputError):
        session.generate(prompts, 1)
    with pytest.raises(InputError):
        session.prefill(prompts)
    assert len(session.free_slots) == free


def test_numpy_integer_ids_are_accepted(session):
    out = session.generate([np.array([1, 2, 3], dtype=np.int64)], 1)
    assert out == session.generate([[1, 2, 3]], 1)


def test_a_released_sequence_cannot_be_used(session):
    (s,), _ = session.prefill([[1, 2, 3]])
    session.release(s)
    with pytest.raises(InputError, match="released"):
        session.decode([s], [4])
    with pytest.raises(InputError, match="released"):
        session.extend(s, [4])
    session.release(s)  # releasing twice is harmless
    with pytest.raises(InputError):
        session.decode(s, [4])  # not a list of sequences


@pytest.mark.parametrize("path", [None, 3, "", b"x"])
def test_a_bad_artifact_path_is_an_input_error(path):
    with pytest.raises(InputError):
        v4compile.load(path, device="cpu")


@pytest.mark.parametrize("device", [None, "gpu", 3])
def test_a_bad_device_is_an_input_error(art, device):
    with pytest.raises(InputError, match="device"):
        v4compile.load(art, device=device)


@pytest.mark.parametrize("threads", [0, -1, 10 ** 9, 1.5, "2"])
def test_bad_threads_at_load_are_an_input_error(art, threads):
    with pytest.raises(InputError, match="threads"):
        v4compile.load(art, device="cpu", threads=threads)


# ---- classes 6 and 7: outputs, leftovers, the compile side ------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "tiny"
    assert main(["-q", "init-random", "--preset", "tiny", "-o", str(out)]) == 0
    return out


def _tree(d):
    return {p.relative_to(d).as_posix(): sha(p) for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["itself", "parent"])
def test_compile_refuses_to_replace_its_input_checkpoint(ckpt, tmp_path, where):
    c = copy(ckpt, tmp_path / "sub" / "ck")
    before = _tree(c)
    out = c if where == "itself" else c.parent
    rc, _, err = run_main("compile", str(c), "-o", str(out), "--force")
    assert_one_error(rc, err, "input checkpoint")
    assert _tree(c) == before


def test_force_over_a_symlinked_output_dir_is_refused_up_front(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep").write_text("x")
    (tmp_path / "link").symlink_to(real)
    rc, _, err = run_main("compile", "--preset", "tiny", "-o", str(tmp_path / "link"), "--force", "--target", "cpu")
    assert_one_error(rc, err, "symlink")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no .old / .tmp left
    assert (real / "keep").read_text() == "x"


@pytest.mark.parametrize("flags,needle", [
    (("--jobs", "0"), "--jobs"), (("--jobs", "100000"), "--jobs"),
    (("--decode-buckets", "1000000000"), "decode batch buckets"),
    (("--prefill-buckets", "16," * 100), "--prefill-buckets"),
    (("--gpu-decode-buckets", "0"), "decode batch buckets"),
])
def test_absurd_compile_flags_are_refused_before_work(tmp_path, flags, needle):
    t0 = time.perf_counter()
    rc, _, err = run_main("compile", "--preset", "tiny", "-o", str(tmp_path / "out"), *flags)
    assert_one_error(rc, err, needle)
    assert time.perf_counter() - t0 < 20 and not (tmp_path / "out").exists()


def test_a_symlink_loop_in_place_of_a_shard_is_one_error(ckpt, tmp_path):
    c = copy(ckpt, tmp_path / "ck")
    shard = next(c.glob("*.safetensors"))
    shard.unlink()
    os.symlink(shard.name, shard)
    for cmd in (("inspect", str(c)), ("compile", str(c)), ("generate", str(c), "--ids", "1")):
        rc, _, err = run_main(*cmd)
        assert_one_error(rc, err, "cannot be resolved")


def test_inspect_names_a_missing_tensor(ckpt, tmp_path):
    from v4compile.safetensors_io import SafetensorsFile, write_file

    c = copy(ckpt, tmp_path / "ck")
    name = "layers.2.attn.wkv.weight"
    index = json.loads((c / "model.safetensors.index.json").read_text())
    shard = c / index["weight_map"].pop(name)
    with SafetensorsFile(shard) as f:
        ts = {k: f.read(k) for k in f.tensors if k != name}
    write_file(shard, ts)
    (c / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, out, err = run_main("inspect", str(c))
    assert_one_error(rc, err, "missing", name)
    assert out == ""


def test_a_cpu_run_writes_nothing_under_home_or_tmpdir(art, tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "V4COMPILE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "v4compile", "run", str(art), "--ids", "1,2", "--max-new-tokens", "1",
                        "--device", "cpu", "--threads", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [p for p in home.rglob("*")] == [] and [p for p in tmp.rglob("*")] == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_imports_prints_no_traceback(sig):
    """Signals at several moments of start-up (imports, op registry, the command itself). Not before the
    interpreter itself has started (its `site` imports): no code of the project's runs there, and on a loaded
    machine that takes longer than any fixed delay, so the delays count from a line the child prints once the
    interpreter is up, just before it runs `python -m v4compile`."""
    start = ("import runpy, sys; print('up', flush=True); "
             "sys.argv = ['v4compile', 'inspect', '--preset', 'tiny']; "
             "runpy.run_module('v4compile', run_name='__main__', alter_sys=True)")
    for delay in (0.25, 0.5, 1.0):
        p = subprocess.Popen([sys.executable, "-c", start],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "up\n"
        time.sleep(delay)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err)
        assert p.returncode in (0, 128 + sig, -sig), (delay, p.returncode, err)


def test_an_import_error_a_signal_caused_is_an_interruption(monkeypatch, capsys):
    """A signal inside a C extension's import can surface as that import's own error (numpy's "cannot load
    module more than once per process", seen in CI): after a signal it exits as interrupted, one line; the
    same error without a signal is a real failure and propagates."""
    from v4compile import cli

    def failing(argv):
        raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(cli, "_main", failing)
    monkeypatch.setattr(cli, "RECEIVED", [])
    with pytest.raises(ImportError):
        cli.main([])
    cli.RECEIVED.append(signal.SIGINT)
    assert cli.main([]) == 130 and capsys.readouterr().err == "interrupted\n"
    cli.RECEIVED.append(signal.SIGTERM)
    assert cli.main([]) == 128 + signal.SIGTERM and "SIGTERM" in capsys.readouterr().err
