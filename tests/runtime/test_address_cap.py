"""Reads sized by the file, not by their limit (issue 42, item 3): `files.read_sized` reads what fstat found
(already checked against the limit), so an address-space cap (`ulimit -v`, containers, batch schedulers)
smaller than a read's limit (4 GiB for an artifact's file) does not stop `v4compile run` on the cpu device.
Each test runs the fixed code and a planted variant that reads `limit + 1` as before."""

from __future__ import annotations

import io
import os
import random
import resource
import subprocess
import sys
import textwrap

import pytest

from v4compile import files
from v4compile.cli import main
from v4compile.errors import ArtifactError

CAP = 2 << 30  # the done-when: tiny on the cpu device runs under 2 GiB (it peaks at 0.9 GiB on 2 threads)
OLD_READ = "lambda f, size, limit: f.read(limit + 1)"  # the pattern this replaced: allocates the whole limit
# Planted into a fresh process before the command runs; `files.read_bytes` (every artifact file but the
# manifest) looks `read_sized` up at each call
_RUN = textwrap.dedent("""\
    import sys
    import v4compile.files
    if sys.argv[1] == "old-read":
        v4compile.files.read_sized = {old}
    from v4compile.cli import main
    sys.exit(main(sys.argv[2:]))
""").format(old=OLD_READ)


def _capped(cap: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return limit


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("cap") / "tiny"
    assert main(["compile", "--preset", "tiny", "-o", str(out), "--target", "cpu"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("read", ["fixed", "old-read"], ids=["fixed", "broken-reads-its-limit"])
def test_run_on_cpu_under_a_2_gib_address_space_cap(art, read, capsys):
    """Catches a bounded read that allocates its limit (the ONNX graph's, 4 GiB): under the cap that run
    died with MemoryError and a traceback (the planted variant: `returncode == 0` fails)."""
    prompt = ",".join(str(random.Random(42).randrange(64)) for _ in range(4))
    args = ["run", str(art), "--ids", prompt, "--max-new-tokens", "3", "--device", "cpu", "--threads", "2"]
    capsys.readouterr()
    assert main(args) == 0
    uncapped = capsys.readouterr().out.strip()
    # OpenBLAS reserves address space per thread, one per core by default (16 of them and ONNX Runtime's 8
    # peak at 1.77 GiB): pinned, so that the cap measures the reads on a machine of any size
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", _RUN, read, *args], capture_output=True, text=True, timeout=300,
                       preexec_fn=_capped(CAP), env=env)
    if read == "fixed":
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == uncapped and "Traceback" not in r.stderr
    else:
        assert r.returncode != 0 and "MemoryError" in r.stderr, r.stderr[-2000:]


_READ = textwrap.dedent("""\
    import resource, sys
    import v4compile.files as files
    from v4compile.errors import ArtifactError
    if sys.argv[1] == "old-read":
        files.read_sized = {old}
    cap = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    data = files.read_bytes(sys.argv[2], ArtifactError, "ONNX graph", 1 << 32)
    print(len(data))
""").format(old=OLD_READ)


@pytest.mark.parametrize("read", ["fixed", "old-read"], ids=["fixed", "broken-reads-its-limit"])
def test_a_small_file_with_a_4_gib_limit_reads_under_a_1_gib_cap(tmp_path, read):
    """The helper alone, in a small process (no torch): a 4 GiB limit under a 1 GiB cap. Catches a read
    sized by its limit (the planted variant: MemoryError, `returncode == 0` fails)."""
    data = random.Random(7).randbytes(random.Random(8).randrange(1, 1 << 16))
    (tmp_path / "g.onnx").write_bytes(data)
    r = subprocess.run([sys.executable, "-c", _READ, read, str(tmp_path / "g.onnx"), str(1 << 30)],
                       capture_output=True, text=True, timeout=120)
    if read == "fixed":
        assert r.returncode == 0 and r.stdout.strip() == str(len(data)), r.stderr[-2000:]
    else:
        assert r.returncode != 0 and "MemoryError" in r.stderr, r.stderr[-2000:]


def _check_growth_caught(tmp_path, monkeypatch) -> None:
    rng = random.Random(3)
    size, limit = rng.randrange(1, 20), rng.randrange(30, 60)
    body = rng.randbytes(limit + rng.randrange(10, 200))
    got = files.read_sized(io.BytesIO(body), size, limit)  # `size` bytes at its fstat, appended to since
    assert len(got) == limit + 1 and got == body[:limit + 1]
    # and through `read_bytes`: one clear error naming the limit
    path = tmp_path / "grows.json"
    path.write_bytes(body)
    real = os.fstat
    with monkeypatch.context() as m:
        m.setattr(files.os, "fstat", lambda fd: os.stat_result((*real(fd)[:6], size, *real(fd)[7:10])))
        with pytest.raises(ArtifactError, match="too large") as e:
            files.read_bytes(path, ArtifactError, "file", limit)
    assert e.value.expected == f"<= {limit} bytes"


@pytest.mark.parametrize("broken", [False, True], ids=["fixed", "broken-stops-at-the-fstat-size"])
def test_a_file_that_grew_past_its_limit_since_its_fstat_is_still_too_large(tmp_path, monkeypatch, broken):
    """Reading by the fstat size must not hide growth past the limit. Catches a read that stops at
    `size + 1` bytes (the planted variant: `len(got) == limit + 1` fails)."""
    if not broken:
        _check_growth_caught(tmp_path, monkeypatch)
        return
    monkeypatch.setattr(files, "read_sized", lambda f, size, limit: f.read(size + 1))
    with pytest.raises(AssertionError, match=r"assert \(\d+ == \(\d+ \+ 1\)\)"):
        _check_growth_caught(tmp_path, monkeypatch)
