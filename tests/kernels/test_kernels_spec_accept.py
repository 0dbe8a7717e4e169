"""spec_accept family under the interpreter vs the op references; exact (ids).

`spec_accept`: drafts all right, the first wrong, the second wrong, a padding lane (pos -1), tied maxima (the
lowest id), strided logits over more than one vocabulary chunk. `spec_sample`: a greedy sequence (temperature
0: the same lanes as `spec_accept`), sampled ones with every draft kept (the token drawn from the last lane's
p), the first and the second rejected (drawn from the residual), a padding lane; strided logits over two
chunks. `draft_next`: sequences with every lane, two lanes, one lane and none valid (padding), a tied maximum,
strided logits and streams; exact. Exact although the kernel's exp and chunked sums round otherwise than the reference's left-to-right
sums: the seeded uniforms fall nowhere near a boundary of the CDF or of a ratio test."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import spec_accept


def check_spec_accept():
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 3, 1100
    lb = torch.randn(B, T, V + 7, generator=g)
    logits = lb[..., 5: V + 5]
    logits[0, 1, 17] = logits[0, 1, 900] = logits[0, 1].max() + 1  # a tie: the lowest id wins
    best = logits.argmax(-1)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[:, 1:] = best[:, :-1]  # every draft right ...
    ids[1, 1] = (best[1, 0] + 1) % V  # ... but sequence 1's first
    ids[2, 2] = (best[2, 1] + 1) % V  # and sequence 2's second
    pos = torch.tensor([[5, 6, 7], [9, 10, 11], [3, 4, 5], [8, 9, -1]], dtype=torch.int64)  # seq 3: one draft
    nxt, _ = kc.poisoned((B, T), torch.int64)
    kept, _ = kc.poisoned((B, T), torch.int64)
    kernels.launch("spec_accept", {"logits": logits, "ids": ids, "pos": pos}, {}, {"next_ids": nxt, "kept_pos": kept})
    ref_next, ref_kept = kc.reference("spec_accept", {"logits": logits, "ids": ids, "pos": pos}, {})
    assert ref_kept.tolist() == [[5, 6, 7], [9, -1, -1], [3, 4, -1], [8, 9, -1]] and ref_next[0, 1] == 17
    assert torch.equal(nxt, ref_next) and torch.equal(kept, ref_kept)


def test_spec_accept():
    check_spec_accept()


# Kernel faults: a draft compared with the first lane's argmax, ties to the highest id.
@pytest.mark.parametrize("old,new", [("prev = bi", "prev = prev"),
                                     ("tl.min(tl.where(v == cm, v0 + r, V), axis=0)",
                                      "tl.max(tl.where(v == cm, v0 + r, -1), axis=0)")],
                         ids=["lane", "tie"])
def test_wrong_acceptance_is_caught(monkeypatch, tmp_path, old, new):
    fn = "greedy_lanes" if old.startswith("prev") else "lane_argmax"  # the argmax: the helper draft_next shares
    kc.install_broken_kernel(monkeypatch, tmp_path, spec_accept, fn, old, new)
    with pytest.raises(AssertionError):
        check_spec_accept()


def check_spec_sample():
    g = torch.Generator().manual_seed(1)
    B, T, V = 5, 3, 1100
    lb = torch.randn(B, T, V + 3, generator=g) * 3
    logits = lb[..., 2: V + 2]
    temperature = torch.tensor([0.0, 0.8, 1.0, 0.6, 1.3])
    q = torch.softmax(torch.randn(B, T, V, generator=g) * 3, -1)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, 1:] = logits[0].argmax(-1)[:-1]  # the greedy sequence's drafts right
    u = torch.rand(B, T, generator=g)
    u[1, 1:] = 0.0  # sequence 1: every draft survives (u q < p)
    for b, j in ((2, 1), (3, 2)):  # sequence 2's first draft, 3's second: rejected (q = p sharpened, d its mode:
        q[b, j] = torch.softmax(logits[b, j - 1] * 2 / temperature[b], -1)  # q(d) > p(d) / u; the residual far from p)
        ids[b, j] = q[b, j].argmax()
        u[b, j] = 0.999
    u[3, 1] = 0.0
    u[4, 1] = 0.0
    pos = torch.tensor([[5, 6, 7], [9, 10, 11], [3, 4, 5], [8, 9, 10], [2, 3, -1]], dtype=torch.int64)
    args = {"logits": logits, "ids": ids, "pos": pos, "draft_probs": q, "uniforms": u, "temperature": temperature}
    nxt, _ = kc.poisoned((B, T), torch.int64)
    kept, _ = kc.poisoned((B, T), torch.int64)
    kernels.launch("spec_sample", args, {}, {"next_ids": nxt, "kept_pos": kept})
    ref_next, ref_kept = kc.reference("spec_sample", args, {})
    assert ref_kept.tolist() == [[5, 6, 7], [9, 10, 11], [3, -1, -1], [8, 9, -1], [2, 3, -1]]
    assert ref_next[2, 0] != ids[2, 1]  # the residual excludes the rejected draft
    assert torch.equal(nxt, ref_next) and torch.equal(kept, ref_kept)


def test_spec_sample():
    check_spec_sample()


# Kernel faults: accepting with min(1, q/p), the residual's q ignored, the drawn id one too far.
@pytest.mark.parametrize("old,new", [("(u * qd < pd)", "(u * pd < qd)"),
                                     ("(rej & (npos > 0))", "(rej & (npos < 0))"),
                                     ("tok = tl.minimum(n, last)", "tok = tl.minimum(n + 1, last)")],
                         ids=["ratio", "residual", "draw"])
def test_wrong_sampled_acceptance_is_caught(monkeypatch, tmp_path, old, new):
    kc.install_broken_kernel(monkeypatch, tmp_path, spec_accept, "spec_sample_kernel", old, new)
    with pytest.raises(AssertionError):
        check_spec_sample()


def check_draft_next():
    g = torch.Generator().manual_seed(2)
    B, T, N, D, V = 4, 3, 2, 40, 1100
    lb = torch.randn(B, V + 5, generator=g)
    logits = lb[:, 3: V + 3]
    logits[2, 17] = logits[2, 900] = logits[2].max() + 1  # a tie: the lowest id wins
    streams = torch.randn(B, T, N, D + 3, generator=g)[..., 1: D + 1]
    pos = torch.tensor([[5, 6, 7], [9, 10, -1], [3, -1, -1], [-1, -1, -1]], dtype=torch.int64)
    ids, _ = kc.poisoned((B, T), torch.int64)
    nxt, _ = kc.poisoned((B, T), torch.int64)
    hidden, _ = kc.poisoned((B, T, N, D), torch.float32)
    args = {"logits": logits, "streams": streams, "pos": pos}
    kernels.launch("draft_next", args, {}, {"ids": ids, "pos_next": nxt, "hidden": hidden})
    ref_ids, ref_pos, ref_h = kc.reference("draft_next", args, {})
    assert ref_pos.tolist() == [[8, -1, -1], [11, -1, -1], [4, -1, -1], [-1, -1, -1]] and ref_ids[2, 0] == 17
    assert torch.equal(ref_h[1, 0], streams[1, 1]) and ref_h[:, 1:].abs().sum() == 0 and ref_h[3].abs().sum() == 0
    assert torch.equal(ids, ref_ids) and torch.equal(nxt, ref_pos) and torch.equal(hidden, ref_h)


def test_draft_next():
    check_draft_next()


# Kernel faults: the first lane's streams taken, the position not advanced, ties to the highest id (in the
# argmax helper the greedy lanes share).
@pytest.mark.parametrize("old,new", [("lane = tl.maximum(n - 1, 0)", "lane = 0"),
                                     ("tl.where(live, top + 1, -1)", "tl.where(live, top, -1)"),
                                     ("tl.min(tl.where(v == cm, v0 + r, V), axis=0)",
                                      "tl.max(tl.where(v == cm, v0 + r, -1), axis=0)")],
                         ids=["lane", "pos", "tie"])
def test_wrong_draft_inputs_are_caught(monkeypatch, tmp_path, old, new):
    fn = "lane_argmax" if old.startswith("tl.min") else "draft_next_kernel"
    kc.install_broken_kernel(monkeypatch, tmp_path, spec_accept, fn, old, new)
    with pytest.raises(AssertionError):
        check_draft_next()
