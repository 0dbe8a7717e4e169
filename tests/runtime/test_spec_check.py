"""The sampled step's comparison of scripts/gpu_check.py (runtime/spec_check.py) on seeded inputs (V = 512, tiny's
vocabulary; three sampled sequences, one greedy, one padding lane): the host rule's own results have no difference;
a decision flipped where the uniform sits on its float64 boundary (a draw's cumulative weight, a ratio test's
p(d) / q(d)) is excused with its margin within the tolerance; the broken variants a kernel could have are faults:
the ratio test inverted (`spec_sampling.inverted_ratio`), the drawn id one too far, a zero-weight id drawn, kept
lanes that are not a prefix of the positions, a greedy row's ids."""

from __future__ import annotations

import numpy as np

from v4compile.runtime.spec_check import _p64, sampled_differences, tolerance
from v4compile.speculation import sample_accept

V, T = 512, 3


def inputs(seed: int = 0) -> dict:
    g = np.random.default_rng(seed)
    logits = (g.standard_normal((5, T, V)) * 3).astype(np.float32)
    z = g.standard_normal((5, T, V)) * 3
    q = (np.exp(z) / np.exp(z).sum(-1, keepdims=True)).astype(np.float32)
    q[0] = 1.0 / V  # sequence 0: q uniform (its drafts survive)
    ids = g.integers(0, V, (5, T))
    ids[1, 1:] = q[1, 1:].argmax(-1)  # sequence 1: drafts at q's mode (p(d) < q(d): the ratio test decides)
    pos = np.array([[5, 6, 7], [9, 10, 11], [3, 4, 5], [8, 9, 10], [-1, -1, -1]])
    u = g.random((5, T), dtype=np.float32)
    return {"logits": logits, "ids": ids, "pos": pos, "draft_probs": q, "uniforms": u,
            "temperature": np.array([0.8, 1.0, 0.6, 0.0, 0.0], dtype=np.float32)}


def run(x, rule=sample_accept, edit=None):
    nxt, kept = rule(*(x[k] for k in ("logits", "ids", "pos", "draft_probs", "uniforms", "temperature")))
    if edit is not None:
        edit(nxt, kept)
    return sampled_differences(*(x[k] for k in ("logits", "ids", "pos", "draft_probs", "uniforms", "temperature")),
                               nxt, kept)


def faults(diffs) -> list[str]:
    return [d["what"] for d in diffs if not d["excused"]]


def test_the_host_rule_has_no_difference():
    for seed in range(4):
        assert run(inputs(seed)) == []


def test_a_draw_on_its_boundary_is_excused_one_too_far_is_not():
    x = inputs()
    x["uniforms"][0, 1:] = 0.0  # sequence 0 keeps both drafts: its token drawn from lane 2's p
    p, zmax = _p64(x["logits"][0], x["temperature"][0])
    c = np.cumsum(p[2])
    h = int(np.argmax(p[2]))  # the boundary after the likeliest id
    x["uniforms"][0, 0] = np.float32(c[h] / c[-1])
    nxt, _ = sample_accept(*(x[k] for k in ("logits", "ids", "pos", "draft_probs", "uniforms", "temperature")))
    host = int(nxt[0, 2])
    assert host in (h, h + 1)
    other = h + 1 if host == h else h

    def across(n, k):
        n[0, 2] = other
    d = run(x, edit=across)
    assert [(e["what"], e["excused"]) for e in d] == [("id", True)] and d[0]["margin"] <= tolerance(V, zmax) / 100

    x["uniforms"][0, 0] = np.float32(c[h - 1] / c[-1] + p[2, h] / 2)  # mid-way through id h's weight

    def too_far(n, k):
        n[0, 2] += 1
    assert faults(run(x, edit=too_far)) == ["id"]

    def zero_weight(n, k):  # sequence 1 rejects its first draft (q one-hot there): drawn from p without it
        n[1, 0] = x["ids"][1, 1]
    x["draft_probs"][1, 1] = np.eye(V, dtype=np.float32)[x["ids"][1, 1]]
    x["uniforms"][1, 1] = 0.999
    assert faults(run(x, edit=zero_weight)) == ["id"]


def test_a_ratio_test_on_its_boundary_is_excused_an_inverted_one_is_not():
    from spec_sampling import inverted_ratio

    x = inputs()
    p, zmax = _p64(x["logits"][1], x["temperature"][1])
    d = x["ids"][1, 1]
    x["uniforms"][1, 1] = np.float32(p[0, d] / x["draft_probs"][1, 1, d])  # u q(d) = p(d)
    nxt, kept = sample_accept(*(x[k] for k in ("logits", "ids", "pos", "draft_probs", "uniforms", "temperature")))

    def flipped(n, k):
        a = int((k[1] >= 0).sum()) - 1
        k[1] = np.where(np.arange(T) <= (1 if a == 0 else 0), x["pos"][1], -1)
    got = run(x, edit=flipped)
    assert [(e["what"], e["excused"]) for e in got] == [("kept lanes", True)]
    assert got[0]["margin"] <= tolerance(V, zmax) / 100
    bad = faults(run(inputs(), rule=inverted_ratio()))
    assert "kept lanes" in bad


def test_malformed_kept_lanes_and_greedy_rows_are_faults():
    def hole(n, k):
        k[2] = [3, -1, 5]

    def greedy(n, k):
        n[3, 0] += 1

    def padding(n, k):
        k[4, 0] = 0
    for edit, what in ((hole, "kept lanes"), (greedy, "greedy"), (padding, "padding")):
        assert faults(run(inputs(), edit=edit)) == [what]
