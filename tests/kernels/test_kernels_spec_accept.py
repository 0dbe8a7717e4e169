"""spec_accept family under the interpreter vs the op reference: drafts all right, the first wrong, the second
wrong, a padding lane (pos -1), tied maxima (the lowest id), strided logits over
more than one vocabulary chunk; exact (ids)."""

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
    kc.install_broken_kernel(monkeypatch, tmp_path, spec_accept, "spec_accept_kernel", old, new)
    with pytest.raises(AssertionError):
        check_spec_accept()
