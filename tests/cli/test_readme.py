"""Every code block of README.md runs as written (what a new user copies).

Blocks are fenced with a language: `bash` and `python` blocks run; `text` blocks are not code. The
only substitutions are for what this test cannot or need not repeat: creating the virtual environment
and installing (the test runs inside the installed environment), the test suite itself (collected,
not run: it is what runs this test), the checkpoint path of the Python example (a seeded random
tiny checkpoint written here), the example model's path (the blocks run in a temporary directory), the
partitioned artifact of the torchrun server's block (one bucket each) and the
serving examples' port (a free one; the `openai` client block runs against a server this test starts);
torchrun runs as the interpreter's `torch.distributed.run` on a free port.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE = README.parent / "examples" / "tiny-doc"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SUBSTITUTIONS = [  # (what the README says, what runs here)
    ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && ", ""),
    ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && ", ""),
    ("python -m pytest -q", f"(cd {str(README.parent)!r} && {sys.executable} -m pytest -q --collect-only "
                            "-p no:cacheprovider)"),
    ("v4compile ", f"{sys.executable} -m v4compile "),
    ("examples/tiny-doc", str(EXAMPLE)),
    # the torchrun server's artifact with one bucket each (fewer functions to export; it serves the same)
    ("--tp 2 --ep 2 -o tiny-tp2", "--tp 2 --ep 2 --decode-buckets 8 --prefill-buckets 16 -o tiny-tp2"),
]
PORT = "8000"  # the serving examples' port: a free one here


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(README.read_text())


def test_every_block_has_a_language():
    found = blocks()
    assert found and all(lang in ("bash", "python", "text") for lang, _ in found), [lang for lang, _ in found]


def _bash(code: str) -> str:
    for old, new in SUBSTITUTIONS[:2]:  # the install steps
        code = code.replace(old, new)
    assert "pip install" not in code and "venv" not in code  # every install step was substituted
    # torchrun: the interpreter's, on a free port (the module it runs keeps its name)
    code = code.replace("torchrun ", f"{sys.executable} -m torch.distributed.run --master-port {free_port()} ")
    code = code.replace("-m v4compile ", "-m V4COMPILE_MODULE ")
    for old, new in SUBSTITUTIONS[2:]:  # (the interpreter's own path may contain `.venv`)
        code = code.replace(old, new)
    code = code.replace("-m V4COMPILE_MODULE ", "-m v4compile ")
    port = free_port()
    return code.replace(f"localhost:{PORT}", f"localhost:{port}").replace(f"--port {PORT}", f"--port {port}")


@pytest.mark.slow
@pytest.mark.parametrize("i", [i for i, (lang, _) in enumerate(blocks()) if lang == "bash"])
def test_bash_blocks_run(i, tmp_path):
    code = _bash(blocks()[i][1])
    r = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("i", [i for i, (lang, _) in enumerate(blocks()) if lang == "python"])
def test_python_blocks_run(i, tmp_path):
    code = blocks()[i][1]
    if f"localhost:{PORT}" in code:  # a client of the README's server: start one (killed at the end)
        _with_server(code, tmp_path)
        return
    if '"out/tiny"' in code:  # a block that loads the artifact the README's compile command writes
        subprocess.run([sys.executable, "-m", "v4compile", "compile", "--preset", "tiny", "--no-golden", "-o",
                        str(tmp_path / "out" / "tiny")], check=True, capture_output=True, timeout=900)
    else:
        ckpt = tmp_path / "ckpt"
        subprocess.run([sys.executable, "-m", "v4compile", "init-random", "--preset", "tiny", "-o", str(ckpt)],
                       check=True, capture_output=True, timeout=300)
        assert '"path/to/ckpt"' in code
        code = code.replace('"path/to/ckpt"', repr(str(ckpt)))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _with_server(code: str, tmp_path: Path) -> None:
    import time

    art, port, log = tmp_path / "out" / "doc", free_port(), tmp_path / "serve.log"
    subprocess.run([sys.executable, "-m", "v4compile", "compile", str(EXAMPLE), "-o", str(art), "--target",
                    "cpu"], check=True, capture_output=True, timeout=900)
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "v4compile", "serve", str(art), "--port", port, "--device", "cpu"],
                             stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while "serving" not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        r = subprocess.run([sys.executable, "-c", code.replace(f"localhost:{PORT}", f"localhost:{port}")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    finally:
        p.kill()
        p.wait(timeout=30)
