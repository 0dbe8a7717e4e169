"""local_experts family under the interpreter vs the op reference: seeded routing of every rank's owner
table (experts split over 4 ranks), strided routing weights, fp32 and bf16; exact (a select and a gather).
Each fault (another rank's slot keeps its weight; the local index not gathered) is caught. Then the mask
feeding the MoE kernels on one rank's stack: another rank's slot costs no weight read and adds nothing."""

from __future__ import annotations

import contextlib

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import local_experts, moe
from v4compile.ops.collective import owner_table

E, PARTS, K = 16, 4, 6


def check_local_experts(dtype):
    g = torch.Generator().manual_seed(0)
    wide = torch.rand(3, 5, K + 2, generator=g).to(dtype)
    w = wide[..., 1:K + 1]  # strided rows
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(15)]).reshape(3, 5, K)
    for part in range(PARTS):
        owner = owner_table(E, PARTS, part)
        wo, _ = kc.poisoned((3, 5, K), dtype)
        io = torch.full((3, 5, K), -7, dtype=torch.int64)
        kernels.launch("local_experts", {"weights": w, "indices": idx, "owner": owner}, {},
                       {"weights_out": wo, "indices_out": io})
        rw, ri = kc.reference("local_experts", {"weights": w, "indices": idx, "owner": owner}, {})
        assert torch.equal(wo, rw) and torch.equal(io, ri), part
        assert 0 < int((rw != 0).sum()) < rw.numel()  # the case has both kinds of slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_experts(dtype):
    check_local_experts(dtype)


@pytest.mark.parametrize("old,new", [("tl.where(mine, w, tl.zeros_like(w))", "w"),
                                     ("local.to(io_ptr", "e.to(io_ptr"),
                                     # the former mask: another rank's slot as local expert 0 (with weight 0)
                                     ("local.to(io_ptr", "tl.maximum(local, 0).to(io_ptr")],
                         ids=["weight", "index", "local-0"])
def test_a_wrong_mask_is_caught(monkeypatch, tmp_path, old, new):
    kc.install_broken_kernel(monkeypatch, tmp_path, local_experts, "local_experts_kernel", old, new)
    with pytest.raises(AssertionError):
        check_local_experts(torch.float32)


# ---- expert parallelism end to end: local_experts then the MoE kernels on one rank's stack ---------------
#
# Every rank routes every token over all E experts; this rank holds E / EP of them. A slot of another rank's
# expert must cost nothing: no weight element of this rank's stack is loaded for it, and nothing is added for
# it. Checked against the references (local_experts, then moe_experts on the rank's stack; the same fp32
# tolerance as the moe tests, kernel_check.assert_matches), with NaN in every local expert no local slot picks
# (a kernel that adds another rank's slot as a local expert's, even with weight 0, turns the token NaN) and
# instrumented interpreter loads (each local expert's weights read once per BM of its own pairs, never
# otherwise). Scratch starts as NaN (run_calls), so a combine that adds another rank's slot reads a row no
# program wrote.

GE, EP, EK, ED, EI = 8, 2, 3, 64, 64  # experts, ranks, slots per token, model and expert widths (one tile each)
PER = GE // EP  # experts a rank holds
ROUTES = {"all-local": (0, [0, 1, 2]), "none-local": (0, [4, 5, 6, 7]), "mixed": (1, [0, 1, 2, 3, 5, 6, 7])}
EXPERT_W = ("w1", "w2", "w3")


def ep_case(case: str, tokens: int = 6):
    """(operands of local_experts, the rank's moe_experts operands without weights / indices, unused local
    experts) for rank `part` of EP whose tokens route only to the experts in ROUTES[case]."""
    part, pool = ROUTES[case]
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:EK]] for _ in range(tokens)])
    mask = {"weights": torch.rand(1, tokens, EK, generator=g) + 0.1, "indices": idx.reshape(1, tokens, EK),
            "owner": owner_table(GE, EP, part)}
    stack = {n: torch.randn(PER, *shape, generator=g) * 0.1
             for n, shape in (("w1", (EI, ED)), ("w3", (EI, ED)), ("w2", (ED, EI)))}
    local = mask["owner"][idx.reshape(-1)]
    unused = sorted(set(range(PER)) - set(local[local >= 0].tolist()))
    for n in EXPERT_W:
        stack[n][unused] = float("nan")
    x = torch.randn(1, tokens, ED, generator=g)
    return mask, {"x": x, **stack, "w1_scale": None, "w2_scale": None, "w3_scale": None}, local, unused


def run_ep_moe(monkeypatch, case: str, grouped: bool = False):
    mask, moe_args, local, unused = ep_case(case)
    tokens = mask["indices"].shape[1]
    wo = torch.empty(1, tokens, EK)
    io = torch.empty(1, tokens, EK, dtype=torch.int64)
    kernels.launch("local_experts", mask, {}, {"weights_out": wo, "indices_out": io})
    rw, ri = kc.reference("local_experts", mask, {})
    assert torch.equal(io, ri) and torch.equal(wo, rw), case
    attrs = {"limit": 1.5, "block": 128, "ep": EP}
    args = {**moe_args, "weights": wo, "indices": io}
    y, _ = kc.poisoned(moe_args["x"].shape, torch.float32)
    if grouped:
        monkeypatch.setattr(moe, "SCAN_MAX_PAIRS", 0)
    with kc.counted_loads(monkeypatch, {n: moe_args[n] for n in EXPERT_W}) as counts:
        calls = kernels.launch("moe_experts", args, attrs, {"y": y})
    assert (calls[0].kernel_name == "moe_group_kernel") == grouped
    ref = kc.reference("moe_experts", {**moe_args, "weights": rw, "indices": ri}, attrs)[0]
    kc.assert_matches(y, ref, f"expert-parallel moe {case}")
    tiles = (torch.bincount(local[local >= 0], minlength=PER) + moe.BM - 1) // moe.BM
    for n in EXPERT_W:
        reads = counts[n].reshape(PER, -1)
        for e in range(reads.shape[0]):
            got = set(reads[e].tolist())
            assert got == {int(tiles[e])}, f"{case}: {n} of local expert {e} read {got} times, want {int(tiles[e])}"
    return y, ref, local, unused


@pytest.mark.parametrize("case,grouped", [("all-local", False), ("none-local", False), ("mixed", False),
                                          ("mixed", True)])
def test_other_ranks_slots_cost_nothing(monkeypatch, case, grouped):
    y, ref, local, unused = run_ep_moe(monkeypatch, case, grouped)
    assert unused, "the case has a poisoned (unpicked) local expert"
    if case == "none-local":
        assert unused == list(range(PER)) and torch.equal(y, torch.zeros_like(y))  # nothing here: exactly zero
    else:
        assert (local >= 0).any() and ((local < 0).any() == (case == "mixed")) and ref.abs().max() > 0


@pytest.mark.parametrize("name,old,new,why", [
    # the routed kernels run another rank's slot (id -1) on local expert 0; its yr row is never added
    ("_expert_of", "return tl.load(idx_ptr + (p // KSEL) * IDX_RS + p % KSEL, mask=ok, other=BIG).to(tl.int32)",
     "return tl.maximum(tl.load(idx_ptr + (p // KSEL) * IDX_RS + p % KSEL, mask=ok, other=BIG).to(tl.int32), 0)",
     "local expert 0 read"),
    # a combine that adds every slot: another rank's slot adds a row no program wrote
    ("_combine", "mask=live[None, :] & n_ok[:, None]", "mask=t_ok[None, :] & n_ok[:, None]", "NaN in the result")],
    ids=["reads", "adds"])
def test_a_non_local_slot_that_costs_is_caught(monkeypatch, tmp_path, name, old, new, why):
    kc.install_broken_kernel(monkeypatch, tmp_path, moe, name, old, new)
    with pytest.raises(AssertionError, match=why):
        run_ep_moe(monkeypatch, "mixed")


@pytest.mark.parametrize("broken", [False, True], ids=["model", "broken-ignores-ep"])
def test_the_cost_model_counts_only_this_ranks_slots(monkeypatch, broken):
    """V4-Pro decode at EP 8 (384 experts, 48 a rank, k 6, 2 tokens): the MoE launch models the rank's
    expected active experts, 1 / 8 of all active experts by symmetry (tests/routing_sample: within 5
    standard errors), and k tokens / 8 pairs; a model that ignores `ep` (every slot landing on this rank's
    48 experts: ~11 of them, not ~1.5) fails the same check."""
    from routing_sample import sampled_routing

    from v4compile.ops import moe as ops_moe

    if broken:
        orig = ops_moe.expected_active_experts
        monkeypatch.setattr(moe, "expected_active_experts", lambda E, k, t, ep=1: orig(E, k, t))
    (a_mean, a_se), _ = sampled_routing(384, 6, 2, samples=400)
    with pytest.raises(AssertionError) if broken else contextlib.nullcontext():
        active, rows = moe._routed_work(48, 6, 2, 8)
        assert abs(active - a_mean / 8) <= 5 * a_se / 8 + 1e-9, (active, a_mean / 8)
        assert rows == round(2 * 6 / 8 + active * (moe.BM - 1))
