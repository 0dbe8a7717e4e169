"""Fixtures of the serving tests (test_serve.py, test_serve_hostile.py, test_serve_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"
DOC_CONTEXT = 512  # room for test_serve_api's 300-token echo (the example's own default is 256)


@pytest.fixture(scope="session")
def doc_art(tmp_path_factory):
    """examples/tiny-doc compiled once per test process for the cpu target (each compile costs seconds)."""
    from v4compile.cli import main

    out = tmp_path_factory.mktemp("doc") / "tiny-doc"
    assert main(["-q", "compile", str(EXAMPLE), "-o", str(out), "--target", "cpu", "--max-context",
                 str(DOC_CONTEXT)]) == 0
    return out
