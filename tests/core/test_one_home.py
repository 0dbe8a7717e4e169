"""One home for each fact the source tree used to keep in several places (issue 38): the cores this process
may use are counted in `v4compile/threads.py` only, and the GPU targets are listed in `v4compile/targets.py`
only (every other module reads `TARGETS` / `GPU_TARGETS`). Each check is shown to fail on a planted copy."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from v4compile.targets import GPU_TARGETS

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("v4compile", "passes", "codegen", "runtime", "cli")  # the source tree (tests/cli/test_layers.py's folders)
CORES_HOME = "v4compile/threads.py"
TARGETS_HOME = "v4compile/targets.py"
CORE_CALLS = {"cpu_count", "sched_getaffinity"}


@functools.cache
def sources() -> dict[str, str]:
    """repository-relative path -> source, of every module of the source tree."""
    return {str(p.relative_to(ROOT)): p.read_text() for f in FOLDERS for p in sorted((ROOT / f).rglob("*.py"))}


@functools.cache
def _tree(text: str) -> ast.Module:
    return ast.parse(text)


def core_counts(srcs: dict[str, str]) -> list[str]:
    """Where a module asks the OS how many cores there are (`os.cpu_count`, `os.sched_getaffinity`, or the
    names imported), outside threads.py."""
    out = []
    for path, text in srcs.items():
        if path == CORES_HOME:
            continue
        for node in ast.walk(_tree(text)):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
            else:
                names = [node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)]
            out += [f"{path}:{node.lineno}: {n}" for n in names if n in CORE_CALLS]
    return out


def target_lists(srcs: dict[str, str]) -> list[str]:
    """Where a module keeps its own list of GPU targets outside targets.py: a tuple / list / set literal of two
    or more target names, a dict literal keyed by one (a per-target fact), or a text listing them (`gfx950,
    sm_90a`, as a message or help text would)."""
    names = set(GPU_TARGETS)
    listed = {",".join(GPU_TARGETS), ",".join(reversed(GPU_TARGETS))}
    out = []
    for path, text in srcs.items():
        if path == TARGETS_HOME:
            continue
        for node in ast.walk(_tree(text)):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hit = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                hit = hit if len(hit) >= 2 else []
            elif isinstance(node, ast.Dict):
                hit = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                hit = [node.value[:60]] if any(t in node.value.replace(" ", "") for t in listed) else []
            else:
                continue
            if hit:
                out.append(f"{path}:{node.lineno}: {type(node).__name__} {hit}")
    return out


def _plant(path: str, line: str) -> dict[str, str]:
    return {**sources(), path: sources()[path] + "\n" + line + "\n"}


def test_cores_are_counted_in_threads_py_only():
    assert core_counts(sources()) == []


@pytest.mark.parametrize("path, line", [
    ("codegen/aot.py", "def _jobs(jobs):\n    return jobs or os.cpu_count() or 1"),  # what aot.py had
    ("v4compile/weights_disk.py", "def _cores():\n    return len(os.sched_getaffinity(0))"),  # the old weights_io copy
    ("runtime/session.py", "from os import cpu_count"),
])
def test_a_second_core_count_is_caught(path, line):
    bad = core_counts(_plant(path, line))
    assert len(bad) == 1 and bad[0].startswith(path), bad


def test_gpu_targets_are_listed_in_targets_py_only():
    assert target_lists(sources()) == []


@pytest.mark.parametrize("path, line", [
    ("cli/compile.py", "_DEFAULT = ('gfx950', 'sm_90a')"),  # compile.py's own list
    ("codegen/aot.py", "_TARGET_WEIGHT = {'sm_90a': 1.5}"),  # a per-target fact outside targets.py
    ("codegen/parallel_model.py", "LINKS = {'gfx950': 288e9, 'sm_90a': 141e9}"),
    ("cli/pipeline.py", "_HELP = 'one of gfx950, sm_90a, gpu or cpu'"),  # a list in a message
])
def test_a_second_target_list_is_caught(path, line):
    bad = target_lists(_plant(path, line))
    assert len(bad) == 1 and bad[0].startswith(path), bad
