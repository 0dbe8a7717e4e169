"""Shared fixtures: tiny configs, seeded random weights, reference models and the HF oracle."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Kernel tests run Triton kernels on CPU tensors: the interpreter must be on before any kernel module is
# imported (the @triton.jit decorator reads it), whichever test module pytest collects first.
os.environ.setdefault("TRITON_INTERPRET", "1")

from v4compile.config import preset  # noqa: E402
from v4compile.init_random import random_source  # noqa: E402
from v4compile.model import ReferenceModel  # noqa: E402
from v4compile.model.reference import build_weights  # noqa: E402
from v4compile.weights import spec_table  # noqa: E402

# One torch thread per test process: the suite runs as `-n 2` workers (CI: 2 cores, one worker each), and a second
# thread per worker oversubscribes the cores; torch's threads then wait on each other, and the tiny models' small
# ops cost ~10-20x the wall time and ~25x the CPU time (a numerics check of tiny on a busy 2-core machine: 3.6 s
# on one thread, 38-72 s on two). Tests that need another count set it and restore it.
torch.set_num_threads(1)

import v4compile.ops  # noqa: E402

v4compile.ops.load_all()  # tests parse IR of every op set

import v4compile.cli.compile  # noqa: E402

# `compile -o` writes the golden by default (a reference run of seconds); the suite compiles dozens of artifacts
# that do not test it, so its in-process compiles leave it out unless they pass --golden (tests/runtime/
# test_self_check.py). Subprocess compiles keep the command's own default.
v4compile.cli.compile.GOLDEN_BY_DEFAULT = False


@functools.lru_cache(maxsize=None)
def dense_weights(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical name -> fp32 tensor for a preset (seeded)."""
    cfg = preset(name)
    src = random_source(cfg, seed)
    return {n: src(s) for n, s in spec_table(cfg).items()}


def make_model(name: str, numerics: str = "hf", dtype: torch.dtype = torch.float32, seed: int = 0,
               weights: dict[str, torch.Tensor] | None = None, cfg=None) -> ReferenceModel:
    cfg = cfg or preset(name)
    dense = weights if weights is not None else dense_weights(name, seed)
    return ReferenceModel(cfg, build_weights(cfg, lambda n: dense[n], dtype), numerics=numerics, dtype=dtype)


def prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def tiny():
    return make_model("tiny")


@pytest.fixture(scope="session")
def tiny_pro():
    return make_model("tiny-pro")


@pytest.fixture
def one_torch_thread():
    """The reference model's small ops run fastest (and steadiest on a shared CI machine) on one thread (the
    suite's default, above); the fixture also puts back the count the test's code leaves (`apply_threads`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- checkpoints on disk (the official layout, `init-random`): one builder for every test module -------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """tiny, fp32, seed 0. Module-scoped: a test that damages a checkpoint copies it first."""
    from v4compile.init_random import init_random

    return init_random(tmp_path_factory.mktemp("ck") / "tiny", preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def tiny_quant_ckpt(tmp_path_factory):
    """tiny as released: FP8 / FP4 weights with E8M0 scales, seed 0."""
    from v4compile.init_random import init_random

    return init_random(tmp_path_factory.mktemp("ckq") / "tiny-q", preset("tiny"), seed=0, quantized=True)


# The serving tests' artifact (test_serve.py, test_serve_hostile.py, test_serve_api.py). Here rather than in a
# tests/cli/conftest.py: a second module named `conftest` would shadow this one for `from conftest import ...`.
DOC_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny-doc")
DOC_CONTEXT = 512  # room for test_serve_api's 300-token echo (the example's own default is 256)


@pytest.fixture(scope="session")
def doc_art(tmp_path_factory):
    """examples/tiny-doc compiled once per test process for the cpu target (each compile costs seconds)."""
    from v4compile.cli import main

    out = tmp_path_factory.mktemp("doc") / "tiny-doc"
    assert main(["-q", "compile", DOC_EXAMPLE, "-o", str(out), "--target", "cpu", "--max-context",
                 str(DOC_CONTEXT)]) == 0
    return out
