"""sample family under the interpreter vs an independent torch reference of the documented algorithm
(codegen/kernels/sample.py): greedy (ties to the lowest id), seeded temperature sampling, top-p.
Token ids must match exactly; the draws must also be deterministic and depend on (seed, step, row)."""

from __future__ import annotations

import kernel_check as kc  # (also: TRITON_INTERPRET=1)
import pytest
import torch

from v4compile.codegen.kernels import sample
from v4compile.codegen.kernels.sample import launch_sample

M32 = 0xFFFFFFFF


def mix(x: torch.Tensor) -> torch.Tensor:
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def ref_sample(logits, seed, step, temperature, top_p):
    B, V = logits.shape
    if temperature == 0:
        return logits.argmax(-1)  # torch returns the first maximal index
    out = []
    for b in range(B):
        l = logits[b]
        z = (l - l.max()) * torch.tensor(1.0 / temperature, dtype=torch.float32)
        e = torch.exp(z)
        keep = torch.ones(V, dtype=torch.bool)
        if top_p < 1:
            srt = e.sort(descending=True).values
            cum = srt.cumsum(0)
            k = int((cum >= top_p * e.sum()).nonzero()[0])
            keep = e >= srt[k]
        lane = torch.arange(V, dtype=torch.int64)
        key = mix(mix(mix(torch.tensor(seed ^ 0x9E3779B9)) ^ step) ^ b)
        h = mix(key ^ lane)
        u = ((h >> 8).float() + 0.5) / 16777216.0
        s = torch.where(keep, z - torch.log(-torch.log(u)), torch.tensor(float("-inf")))
        out.append(int(s.argmax()))
    return torch.tensor(out)


def run(B, V, temperature, top_p, seed=1234, step=7, g_seed=0):
    g = torch.Generator().manual_seed(g_seed)
    logits = 3 * torch.randn(B, V, generator=g)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie for the greedy case
    tokens = torch.full((B,), -7, dtype=torch.int64)
    launch_sample(logits, torch.tensor([seed, step]), tokens, temperature, top_p)
    return tokens, ref_sample(logits, seed, step, temperature, top_p)


def test_greedy():
    tok, ref = run(3, 1000, 0.0, 1.0)
    assert torch.equal(tok, ref) and tok[0] == 5


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.95)])
def test_vocab_over_several_chunks(temperature, top_p):
    """V larger than the kernel's 4096-wide chunk: maxima, masses and the draw span chunks."""
    tok, ref = run(2, 5000, temperature, top_p, g_seed=3)
    assert torch.equal(tok, ref)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_sampling_matches_reference(temperature, top_p):
    tok, ref = run(4, 777, temperature, top_p)
    assert torch.equal(tok, ref)


def test_seed_and_step_change_draws():
    a, _ = run(8, 300, 2.0, 1.0, seed=1, step=0)
    b, _ = run(8, 300, 2.0, 1.0, seed=1, step=0)
    c, _ = run(8, 300, 2.0, 1.0, seed=1, step=1)
    d, _ = run(8, 300, 2.0, 1.0, seed=2, step=0)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_wrong_top_p_is_caught(monkeypatch, tmp_path):
    """A kernel whose nucleus keeps every token (the bisected threshold dropped) fails the check of
    test_sampling_matches_reference at its top-p 0.5 case."""
    kc.install_broken_kernel(monkeypatch, tmp_path, sample, "sample_kernel",
                             "tau = lo.to(tl.float32, bitcast=True)", "tau = 0.0")
    with pytest.raises(AssertionError):
        test_sampling_matches_reference(1.3, 0.5)
