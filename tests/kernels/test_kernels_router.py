"""router family under the interpreter vs the op reference: learned (top-k of s + bias, bias steering
selection only) and hash (tid2eid[ids], padding id -1) routing, fp32 and bf16, a non-power-of-two
expert count and token count. The k slots are compared as a set (the reference's topk is unsorted):
indices exactly, weights with kernel_check.assert_matches."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels

pytestmark = pytest.mark.isa  # exact on torch's CPU kernels: CI runs it again under a second instruction set


def _by_index(w, i):
    order = i.argsort(-1)
    return w.gather(-1, order), i.gather(-1, order)


def run(dtype, hashed, E=12, D=96, k=3, B=2, T=9, seed=0, wrong_scale=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    w = (torch.randn(E, D, generator=g) * 0.2).to(dtype)
    args = {"x": x, "w": w, "bias": None, "tid2eid": None, "ids": None}
    if hashed:
        V = 40
        args["tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])
        ids = torch.randint(0, V, (B, T), generator=g)
        ids[1, -1] = -1
        args["ids"] = ids
    else:
        args["bias"] = torch.randn(E, generator=g) * 0.5
    attrs = {"k": k, "route_scale": 2.5}
    wo, _ = kc.poisoned((B, T, k), dtype)
    io, _ = kc.poisoned((B, T, k), torch.int64)
    kernels.launch("router", args, {**attrs, "route_scale": wrong_scale or 2.5}, {"weights": wo, "indices": io})
    rw, ri = kc.reference("router", args, attrs)
    kw, ki = _by_index(wo, io)
    rw, ri = _by_index(rw, ri)
    assert torch.equal(ki, ri), "selected experts differ"
    kc.assert_matches(kw, rw, f"router weights hashed={hashed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hashed", [False, True])
def test_router(dtype, hashed):
    run(dtype, hashed)


def test_wrong_scale_is_caught():
    with pytest.raises(AssertionError):
        run(torch.float32, False, wrong_scale=2.0)


def _tiny_scores(dtype, E=12, D=96, k=3, B=2, T=5):
    """Logits near -80: every score s = sqrt(softplus(z)) ~ 4e-18, so `sum(s) + 1e-20` is not `sum(s)`.
    A score's relative error is half its logit's absolute error, which at |z| = 80 is ~4e-6 per ulp: a
    GEMM summing in another order (the interpreter's numpy against torch's kernel for this instruction
    set) would move the weights by more than the comparison's 1e-5. So x and W are multiples of 2^-6 and
    2^-10 with small numerators: every product and partial sum is an integer multiple of 2^-16 below 2^24
    of them, exact in fp32 in any order, and the logits are the same bits on every CPU."""
    g = torch.Generator().manual_seed(4)
    x = (64 + torch.randint(-8, 9, (B, T, D), generator=g)).to(dtype) / 64
    w = (-853 + torch.randint(-10, 11, (E, D), generator=g)).to(dtype) / 1024
    return {"x": x, "w": w, "bias": torch.randn(E, generator=g) * 0.5, "tid2eid": None, "ids": None}, k


@pytest.mark.parametrize("eps", [0.0, 1e-20])
def test_routing_denominator_eps(eps):
    """Spec 15 item 14: `denom_eps` 0 (official) or 1e-20 (HF). On scores ~4e-18 the two differ by ~1e-3
    relative in fp32; the kernel follows the attribute, and with 0 the weights sum to route_scale."""
    args, k = _tiny_scores(torch.float32)
    attrs = {"k": k, "route_scale": 2.5, "denom_eps": eps}
    rw, ri = kc.reference("router", args, attrs)
    hw, _ = kc.reference("router", args, {**attrs, "denom_eps": 1e-20 - eps})
    assert float(((rw - hw).abs() / rw.abs()).max()) > 1e-4  # the case tells the two apart
    if eps == 0.0:
        assert torch.allclose(rw.sum(-1), torch.full(rw.shape[:-1], 2.5), rtol=1e-6, atol=0)
    for launch_eps, ok in ((eps, True), (1e-20 - eps, False)):
        wo, _ = kc.poisoned(rw.shape, torch.float32)
        io, _ = kc.poisoned(rw.shape, torch.int64)
        kernels.launch("router", args, {**attrs, "denom_eps": launch_eps}, {"weights": wo, "indices": io})
        kw, ki = _by_index(wo, io)
        sw, si = _by_index(rw, ri)
        assert torch.equal(ki, si)
        try:
            kc.assert_matches(kw, sw, f"router denom_eps={launch_eps}")
            matched = True
        except AssertionError:
            matched = False
        assert matched == ok, (launch_eps, eps)


@pytest.mark.parametrize("hashed", [False, True])
def test_fp32_router_on_bf16_activations(hashed):
    """Spec 10 / 15 item 7 (official): logits from x and W upcast to fp32, every routing step in fp32, fp32
    weights. The reference is that computation written out; the bf16 router (HF) differs from it, and the
    kernel with `fp32` matches it."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    B, T, D, E, k = 2, 7, 96, 12, 3
    x = torch.randn(B, T, D, generator=g).bfloat16()
    w = (torch.randn(E, D, generator=g) * 0.2).bfloat16()
    args = {"x": x, "w": w, "bias": None, "tid2eid": None, "ids": None}
    if hashed:
        args.update(tid2eid=torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(20)]),
                    ids=torch.randint(0, 20, (B, T), generator=g))
    else:
        args["bias"] = torch.randn(E, generator=g) * 0.5
    attrs = {"k": k, "route_scale": 2.5, "denom_eps": 0.0, "fp32": True}
    rw, ri = kc.reference("router", args, attrs)
    s = F.softplus(x.float() @ w.float().T).sqrt()
    want = s.gather(-1, ri) / s.gather(-1, ri).sum(-1, keepdim=True) * 2.5
    assert rw.dtype == torch.float32 and torch.equal(rw, want)
    bw, bi = kc.reference("router", args, {**attrs, "fp32": False})
    assert bw.dtype == torch.bfloat16 and not torch.equal(_by_index(bw.float(), bi)[0], _by_index(rw, ri)[0])
    wo, _ = kc.poisoned((B, T, k), torch.float32)
    io, _ = kc.poisoned((B, T, k), torch.int64)
    kernels.launch("router", args, attrs, {"weights": wo, "indices": io})
    kw, ki = _by_index(wo, io)
    sw, si = _by_index(rw, ri)
    assert torch.equal(ki, si)
    kc.assert_matches(kw, sw, f"fp32 router hashed={hashed}")


def _routed_at_run_time(dtype, hashed, E=12, D=96, k=3, B=2, T=9, seed=0):
    """The router run as its AOT binary runs: every routing operand bound, an absent one a null pointer (here
    an empty tensor: address 0, not Triton's compile-time None), so `route_rows` picks the routing from the
    token ids' address at run time. Under the memory guard: a load through the null pointer is caught."""
    from v4compile.codegen.kernels.interpreter import memory_guard

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    w = (torch.randn(E, D, generator=g) * 0.2).to(dtype)
    args = {"x": x, "w": w, "bias": None, "tid2eid": None, "ids": None}
    if hashed:
        args["tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(40)])
        args["ids"] = torch.randint(0, 40, (B, T), generator=g)
    else:
        args["bias"] = (torch.randn(E, generator=g) * 0.5).to(dtype)
    attrs = {"k": k, "route_scale": 2.5}
    wo, _ = kc.poisoned((B, T, k), dtype)
    io, _ = kc.poisoned((B, T, k), torch.int64)
    outs = {"weights": wo, "indices": io}
    calls = kernels.specialise_tensors("router", args, attrs, outs)
    bound = {n: (torch.empty(0, dtype=torch.int64 if n != "bias" else dtype) if v is None else v)
             for n, v in args.items()}
    assert all(bound[n].data_ptr() == 0 for n, v in args.items() if v is None)
    live = [t for t in (*bound.values(), wo, io) if t.numel()]
    with memory_guard([(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in live]):
        kernels.run_calls(calls, bound, outs)
    rw, ri = kc.reference("router", args, attrs)
    kw, ki = _by_index(wo, io)
    rw, ri = _by_index(rw, ri)
    assert torch.equal(ki, ri), "selected experts differ"
    kc.assert_matches(kw, rw, f"router weights hashed={hashed}")
    return calls


def test_one_binary_for_both_routings():
    """Hash-routed and learned layers of one shape are one specialisation (one name, the same constexprs and
    pointer types: one AOT binary), and the kernel routes each right when the choice is made at run time."""
    a, b = (_routed_at_run_time(torch.float32, h)[0] for h in (False, True))
    assert a.name == b.name and a.constexprs == b.constexprs and a.signature() == b.signature()


@pytest.mark.parametrize("hashed", [False, True])
def test_run_time_routing_choice_is_checked(monkeypatch, tmp_path, hashed):
    """The run-time choice inverted: the hash layer routes by its (null) bias, the learned one reads its (null)
    tid2eid; the memory guard or the comparison fails."""
    from v4compile.codegen.kernels import router

    kc.install_broken_kernel(monkeypatch, tmp_path, router, "route_rows", "elif ids_ptr.to(tl.int1):",
                             "elif not ids_ptr.to(tl.int1):")
    from triton.runtime.errors import InterpreterError

    with pytest.raises((AssertionError, InterpreterError)) as e:  # (the guard's IllegalAddress, wrapped by Triton)
        _routed_at_run_time(torch.float32, hashed)
    assert e.type is AssertionError or "IllegalAddress" in str(e.value)
