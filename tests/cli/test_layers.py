"""The folders are the layers: core < passes < codegen < runtime < top, and imports go only down.

    core     v4compile/ (config, checkpoint, ir, ops, model, program, artifact format, errors, ...)
    passes   passes/    (installed as v4compile.passes)
    codegen  codegen/   (v4compile.codegen: Triton kernels, AOT, ONNX lowerings)
    runtime  runtime/   (v4compile.runtime: needs the artifact format and the program only)
    top      cli/       (v4compile.cli: the command line, the compile driver, the compile report), with
             the package module itself (v4compile/__init__.py: its names include the runtime's `load`,
             imported on first use) and v4compile/__main__.py

Three checks, each shown to fail on a fault of its kind:
* every import statement, also the ones inside functions, names a module of its own layer or a lower one;
* no two modules import each other, even through a chain (a loop held together by imports inside
  functions is still a loop);
* importing every module of a layer in a fresh process loads no module of a higher layer (what an
  `__init__` or a re-export pulls in is caught here), and the runtime never loads the passes or the tracer;
* the loader of an artifact (`artifact.py`, its weights `weights_map.py`) stands on nothing of the compiler's
  weight walk, the tracer, the IR harness or the reference model: not in its imports at any depth, and not
  in a fresh process that imports the runtime and loads an artifact's weights; and that weight walk
  (plan, convert, write) goes around the tracer and the harness.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"v4compile": "v4compile", "passes": "v4compile.passes", "codegen": "v4compile.codegen",
           "runtime": "v4compile.runtime", "cli": "v4compile.cli"}
LAYERS = ("core", "passes", "codegen", "runtime", "top")
TOP = ("v4compile.cli", "v4compile.__main__")
PACKAGE = "v4compile"  # the package module (not its submodules): top
# The runtime runs a compiled artifact: the pass pipeline and the tracer are the compiler's, not its.
RUNTIME_NEVER = ("v4compile.passes", "v4compile.trace", "v4compile.frontend", "v4compile.cli.driver")
# Loading an artifact's weights needs its manifest and shards only: not how they were made.
LOADER = ("v4compile.artifact", "v4compile.weights_map")
LOADER_NEVER = ("v4compile.trace", "v4compile.harness", "v4compile.model", "v4compile.checkpoint",
                "v4compile.weights_convert", "v4compile.weights_plan", "v4compile.weights_write")
# Writing an artifact's weights at compile time: planned, converted, written; the IR is an input, not a tool.
WEIGHT_WALK = ("v4compile.weights_plan", "v4compile.weights_write", "v4compile.rank_weights")
WEIGHT_WALK_NEVER = ("v4compile.trace", "v4compile.harness")


def _within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def layer_of(mod: str) -> str:
    if mod == PACKAGE or any(_within(mod, t) for t in TOP):
        return "top"
    for layer in ("passes", "codegen", "runtime"):
        if _within(mod, f"v4compile.{layer}"):
            return layer
    return "core"


@functools.cache
def sources() -> dict[str, tuple[Path, str]]:
    """module name -> (file, source) of every module of the five folders, under its installed name."""
    out = {}
    for folder, pkg in FOLDERS.items():
        for p in sorted((ROOT / folder).rglob("*.py")):
            parts = [pkg, *p.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = (p, p.read_text())
    return out


@functools.cache
def _tree(text: str) -> ast.Module:
    return ast.parse(text)


def _literal_import(node: ast.AST) -> str | None:
    """The name a call imports, when it is `importlib.import_module("...")`, `import_module("...")` or
    `__import__("...")` with a literal name (a name computed at run time cannot be read here)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    arg = node.args[0]
    if called in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _absolute(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    """A relative import's module (`level` dots before `name`, from module `mod`)."""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(mod: str, path: Path, text: str, known) -> list[tuple[int, str]]:
    """(line, module) for every import statement in the file, at any depth, and every call that imports a
    literal name (`importlib.import_module`, relative to the module's package when it starts with a dot;
    `__import__`), resolved to a known module (the longest known prefix of what it names: `from .x import y`
    is module `x.y` if there is one, else `x`)."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(_tree(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            frm = _absolute(mod, is_pkg, node.level, node.module) if node.level else node.module or ""
            names = [f"{frm}.{a.name}" for a in node.names]
        elif (lit := _literal_import(node)) is not None:
            level = len(lit) - len(lit.lstrip("."))
            names = [_absolute(mod, is_pkg, level, lit[level:] or None) if level else lit]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.append((node.lineno, n))
    return out


def upward_imports(srcs: dict[str, tuple[Path, str]]) -> list[str]:
    bad = []
    for mod, (path, text) in srcs.items():
        mine = LAYERS.index(layer_of(mod))
        for line, dep in imports(mod, path, text, srcs):
            if LAYERS.index(layer_of(dep)) > mine:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {layer_of(mod)} module {mod} imports "
                           f"{layer_of(dep)} module {dep}")
            elif layer_of(mod) == "runtime" and any(_within(dep, n) for n in RUNTIME_NEVER):
                bad.append(f"{path.relative_to(ROOT)}:{line}: the runtime imports the compiler's {dep}")
    return bad


def import_loops(srcs: dict[str, tuple[Path, str]]) -> list[list[str]]:
    """The module import graph's strongly connected components of more than one module."""
    graph = nx.DiGraph()
    graph.add_nodes_from(srcs)
    graph.add_edges_from((m, d) for m, (p, t) in srcs.items() for _, d in imports(m, p, t, srcs))
    return sorted(sorted(comp) for comp in nx.strongly_connected_components(graph) if len(comp) > 1)


def _add_line(srcs, mod: str, line: str):
    path, text = srcs[mod]
    return {**srcs, mod: (path, text + "\n" + line + "\n")}


def test_every_import_goes_down():
    assert upward_imports(sources()) == []


@pytest.mark.parametrize("mod, line, expect", [
    # an op definition reaching into a backend, inside a function (the kind of import that hid the last ones)
    ("v4compile.ops.paged", "def _f():\n    from v4compile.codegen.onnx import csr", "core module"),
    ("v4compile.artifact", "from .passes import PassManager", "imports passes module"),
    ("v4compile.runtime.session", "from v4compile.trace import trace", "the runtime imports the compiler's"),
    ("v4compile.codegen.aot", "import v4compile.runtime.session", "codegen module"),
    # the same through a call with a literal name (how the package's names were loaded before)
    ("v4compile.config", "def _f():\n    import importlib\n    return importlib.import_module('v4compile.runtime')",
     "core module v4compile.config imports runtime module v4compile.runtime"),
    ("v4compile.manifest",
     "def _f():\n    import importlib\n    return importlib.import_module('.runtime', __package__)",
     "core module v4compile.manifest imports runtime module v4compile.runtime"),
    ("v4compile.passes.dce", "def _f():\n    return __import__('v4compile.codegen.aot')", "passes module"),
])
def test_an_upward_import_is_caught(mod, line, expect):
    bad = upward_imports(_add_line(sources(), mod, line))
    assert len(bad) == 1 and expect in bad[0], bad


# Within codegen: the ONNX export driver dispatches into the lowerings and the graph builder under
# codegen/onnx/; they never import it back (their value kinds and shared helpers live beside them).
ONNX_LOWERINGS, ONNX_DRIVER = "v4compile.codegen.onnx", "v4compile.codegen.onnx_export"


def driver_imports(srcs: dict[str, tuple[Path, str]]) -> list[str]:
    """One line per import statement (`from ..onnx_export import A, B` names the driver twice)."""
    return sorted({f"{path.relative_to(ROOT)}:{line}: {mod} imports the export driver"
                   for mod, (path, text) in srcs.items() if _within(mod, ONNX_LOWERINGS)
                   for line, dep in imports(mod, path, text, srcs) if _within(dep, ONNX_DRIVER)})


def test_the_onnx_lowerings_never_import_the_export_driver():
    assert driver_imports(sources()) == []


def test_a_lowering_importing_the_export_driver_is_caught():
    """The fault the split removed: a family lowering taking a value kind back from the exporter, inside a
    function (where the last ones hid)."""
    srcs = _add_line(sources(), "v4compile.codegen.onnx.csr", "def _f():\n    from ..onnx_export import Operands")
    bad = driver_imports(srcs)
    assert len(bad) == 1 and "v4compile.codegen.onnx.csr imports the export driver" in bad[0], bad


def test_no_import_loops():
    assert import_loops(sources()) == []


def test_an_import_loop_is_caught():
    # ir.types is below ir.registry; a lazy import back up closes a loop of two modules
    srcs = _add_line(sources(), "v4compile.ir.types", "def _f():\n    from .registry import get_op")
    assert ["v4compile.ir.registry", "v4compile.ir.types"] in [
        [m for m in loop if m in ("v4compile.ir.registry", "v4compile.ir.types")] for loop in import_loops(srcs)]


PROBE = textwrap.dedent('''
    import importlib, sys
    layers, top, never, overlay, mods = {layers!r}, {top!r}, {never!r}, {overlay!r}, {mods!r}
    if overlay:  # the deliberately broken case: one module of the layer replaced by a copy that imports up
        import v4compile
        v4compile.__path__.insert(0, overlay)
    def within(m, p):
        return m == p or m.startswith(p + ".")
    def layer_of(m):
        if m == "v4compile" or any(within(m, t) for t in top):
            return "top"
        for l in ("passes", "codegen", "runtime"):
            if within(m, "v4compile." + l):
                return l
        return "core"
    for m in mods:
        importlib.import_module(m)
    mine = layers.index(layer_of(mods[0]))
    # the package module is loaded with any of its modules (Python's rule): what it loads counts, not itself
    loaded = sorted(m for m in sys.modules if m.startswith("v4compile."))
    bad = [m for m in loaded if layers.index(layer_of(m)) > mine]
    if layer_of(mods[0]) == "runtime":
        bad += [m for m in loaded if any(within(m, n) for n in never)]
    print("higher:", bad)
    sys.exit(1 if bad else 0)
''')


def _probe(layer: str, overlay: str = "") -> subprocess.CompletedProcess:
    mods = sorted(m for m in sources() if layer_of(m) == layer and m != "v4compile.__main__")
    code = PROBE.format(layers=LAYERS, top=TOP, never=RUNTIME_NEVER, overlay=overlay, mods=mods)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_a_layer_loads_nothing_above_it(layer):
    r = _probe(layer)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_layer_loading_a_higher_one_is_caught(tmp_path):
    # v4compile/config.py as it is, plus one import of the runtime: the fresh process sees it loaded
    (tmp_path / "config.py").write_text((ROOT / "v4compile" / "config.py").read_text()
                                        + "\nimport v4compile.runtime.session\n")
    r = _probe("core", overlay=str(tmp_path))
    assert r.returncode == 1 and "v4compile.runtime.session" in r.stdout, r.stdout + r.stderr


def _run_at_import(mod: str, srcs: dict[str, tuple[Path, str]]) -> list[str]:
    """The modules a package's `__init__` imports when it runs (its module-level statements, not the bodies
    of its functions: `v4compile`'s `__getattr__` imports its names on first use only)."""
    path, text = srcs[mod]
    at_import = ast.Module(body=[n for n in _tree(text).body
                                 if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))], type_ignores=[])
    return [d for _, d in imports(mod, path, ast.unparse(at_import), srcs)]


def reaches(srcs: dict[str, tuple[Path, str]], roots: tuple[str, ...], never: tuple[str, ...]) -> list[str]:
    """The modules of `never` that the imports of `roots` reach, at any depth (imports inside functions
    too; importing a module runs its packages' `__init__` first: what that runs at import)."""
    seen, todo = set(), [(m, False) for m in roots]
    while todo:
        mod, as_parent = todo.pop()
        if (mod, as_parent) in seen or mod not in srcs:
            continue
        seen.add((mod, as_parent))
        deps = _run_at_import(mod, srcs) if as_parent else [d for _, d in imports(mod, *srcs[mod], srcs)]
        todo += [(d, False) for d in deps] + [(mod.rpartition(".")[0], True)]
    return sorted({m for m, _ in seen if any(_within(m, n) for n in never)})


def test_the_artifact_loader_imports_nothing_of_how_weights_are_made():
    assert reaches(sources(), LOADER, LOADER_NEVER) == []


def test_a_loader_reaching_the_harness_is_caught():
    """The fault: the shard reader converting through the IR harness inside a function (the old
    `weights_io` did: its loader sat in the module that called `harness._fetch` and `trace.expand_sources`)."""
    srcs = _add_line(sources(), "v4compile.weights_map", "def _f():\n    from .harness import IRRunner")
    assert {"v4compile.harness", "v4compile.model", "v4compile.model.reference"} <= \
        set(reaches(srcs, LOADER, LOADER_NEVER))


@pytest.mark.parametrize("fault", [None, "the plan expands sources through the tracer",
                                   "a rank's part converted through the harness"])
def test_the_compile_time_weight_walk_goes_around_the_tracer_and_the_harness(fault):
    """Planning, converting and writing an artifact's weights (`WEIGHT_WALK`) reach neither the tracer
    nor the IR harness. The faults put back the two detours the old `weights_io` took."""
    srcs = sources()
    if fault == "the plan expands sources through the tracer":
        srcs = _add_line(srcs, "v4compile.weights_plan", "def _f():\n    from .trace import TraceOptions")
    elif fault:
        srcs = _add_line(srcs, "v4compile.rank_weights", "def _f():\n    from .harness import IRRunner")
    assert (reaches(srcs, WEIGHT_WALK, WEIGHT_WALK_NEVER) == []) == (fault is None)


LOAD_PROBE = textwrap.dedent('''
    import sys
    overlay, art, never = sys.argv[1], sys.argv[2], {never!r}
    if overlay:  # the deliberately broken case: the shard reader replaced by a copy that imports more
        import v4compile
        v4compile.__path__.insert(0, overlay)
    import v4compile.runtime
    from v4compile.artifact import load_artifact
    w = load_artifact(art, defer_weights=True).weights()
    n = sum(1 for _ in w.stream()) + sum(1 for _ in w.chunks())
    w.close()
    bad = sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in never))
    print("tensors:", n, "loaded:", bad)
    sys.exit(1 if bad or not n else 0)
''')


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    r = subprocess.run([sys.executable, "-m", "v4compile", "compile", "--preset", "tiny", "--target", "cpu",
                        "--decode-buckets", "1", "--prefill-buckets", "16", "--no-golden", "-o", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return out


def _load_probe(art: Path, overlay: str = "") -> subprocess.CompletedProcess:
    code = LOAD_PROBE.format(never=LOADER_NEVER)
    return subprocess.run([sys.executable, "-c", code, overlay, str(art)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_loading_an_artifacts_weights_loads_nothing_of_how_they_are_made(tiny_artifact):
    """A fresh process imports the runtime, loads a compiled artifact and reads every weight (mapped views
    and chunks, hashed): the tracer, the IR harness, the reference model and the weight writer stay
    unloaded."""
    r = _load_probe(tiny_artifact)
    assert r.returncode == 0, r.stdout + r.stderr


def test_loading_weights_that_pull_in_the_harness_is_caught(tiny_artifact, tmp_path):
    """The fault: `weights_map.py` as it is, plus one import of the IR harness (which loads the model)."""
    (tmp_path / "weights_map.py").write_text((ROOT / "v4compile" / "weights_map.py").read_text()
                                             + "\nimport v4compile.harness\n")
    r = _load_probe(tiny_artifact, overlay=str(tmp_path))
    assert r.returncode == 1 and "v4compile.harness" in r.stdout and "v4compile.model" in r.stdout, \
        r.stdout + r.stderr
