"""spec_accept family: the speculative acceptance between a verify and the MTP block (the ops' references state
the rules). `spec_accept` (greedy): one program per sequence, each lane's argmax over the vocabulary streamed in
chunks of BV (ties to the lowest id, as torch.argmax), then the lanes in order: draft t survives while every
earlier one did and it equals lane t - 1's argmax (and its position is real). `spec_sample` (sampled or greedy
per sequence, `speculation.sample_accept`): temperature 0 the same greedy lanes; otherwise each draft's ratio
test against its lane's float32 softmax (a max pass, a sum pass), then the token after the last survivor drawn
by the inverse CDF of the residual (or of p) with the step's uniform. Not bit for bit the reference: the exp is
the GPU's and the sums go chunk by chunk (tree sums and scans inside a chunk) where the reference sums left to
right, so p agrees to float32 rounding and a drawn id can differ only where a uniform falls within that
rounding of a boundary; on the host device the op runs its reference (the host's own function). `draft_next` (a
recursive MTP draft's step inputs from the draft before it): one program per sequence, the argmax as the greedy
lanes', then lane 0's id, position and streams (the last valid lane's), the other lanes padding; exact."""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, unaligned
from .pdl import pdl_enter


@triton.jit
def spec_accept_kernel(l_ptr, ids_ptr, pos_ptr, next_ptr, kept_ptr, T: tl.constexpr, V: tl.constexpr,
                       L_BS: tl.constexpr, L_TS: tl.constexpr, L_VS: tl.constexpr, I_BS: tl.constexpr,
                       I_TS: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr, N_BS: tl.constexpr,
                       N_TS: tl.constexpr, K_BS: tl.constexpr, K_TS: tl.constexpr, BV: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_enter(PDL)
    greedy_lanes(l_ptr, ids_ptr, pos_ptr, next_ptr, kept_ptr, tl.program_id(0).to(tl.int64), T, V, L_BS, L_TS,
                 L_VS, I_BS, I_TS, P_BS, P_TS, N_BS, N_TS, K_BS, K_TS, BV)


@triton.jit
def lane_argmax(lane, V: tl.constexpr, L_VS: tl.constexpr, BV: tl.constexpr):
    """The argmax of one lane of logits (`lane`: its first element, `L_VS` apart), streamed in chunks of BV, ties
    to the lowest id (torch.argmax's): the greedy rule `greedy_lanes` and `draft_next_kernel` share."""
    r = tl.arange(0, BV)
    best = float("-inf")
    bi = 0
    for v0 in range(0, V, BV):
        v = tl.load(lane + (v0 + r) * L_VS, mask=v0 + r < V, other=float("-inf")).to(tl.float32)
        cm = tl.max(v, axis=0)
        ci = tl.min(tl.where(v == cm, v0 + r, V), axis=0)
        take = cm > best
        bi = tl.where(take, ci, bi)
        best = tl.where(take, cm, best)
    return bi


@triton.jit
def greedy_lanes(l_ptr, ids_ptr, pos_ptr, next_ptr, kept_ptr, b, T: tl.constexpr, V: tl.constexpr,
                 L_BS: tl.constexpr, L_TS: tl.constexpr, L_VS: tl.constexpr, I_BS: tl.constexpr, I_TS: tl.constexpr,
                 P_BS: tl.constexpr, P_TS: tl.constexpr, N_BS: tl.constexpr, N_TS: tl.constexpr, K_BS: tl.constexpr,
                 K_TS: tl.constexpr, BV: tl.constexpr):
    keep = 1
    prev = 0
    for t in tl.static_range(T):
        bi = lane_argmax(l_ptr + b * L_BS + t * L_TS, V, L_VS, BV)
        p = tl.load(pos_ptr + b * P_BS + t * P_TS)
        if t > 0:
            d = tl.load(ids_ptr + b * I_BS + t * I_TS)
            keep = keep * ((d == prev) & (p >= 0)).to(tl.int32)
        tl.store(next_ptr + b * N_BS + t * N_TS, bi.to(next_ptr.dtype.element_ty))
        tl.store(kept_ptr + b * K_BS + t * K_TS, tl.where(keep > 0, p, -1))
        prev = bi


@triton.jit
def softmax_stats(row, L_VS: tl.constexpr, t, V: tl.constexpr, BV: tl.constexpr):
    """The max of z = row / t and the sum of exp(z - max) over the V logits of one lane."""
    r = tl.arange(0, BV)
    m = float("-inf")
    for v0 in range(0, V, BV):
        z = tl.load(row + (v0 + r) * L_VS, mask=v0 + r < V, other=float("-inf")).to(tl.float32) / t
        m = tl.maximum(m, tl.max(z, axis=0))
    s = 0.0
    for v0 in range(0, V, BV):
        z = tl.load(row + (v0 + r) * L_VS, mask=v0 + r < V, other=float("-inf")).to(tl.float32) / t
        s += tl.sum(tl.exp(z - m), axis=0)
    return m, s


@triton.jit
def draw_weights(row, qrow, v0, L_VS: tl.constexpr, Q_VS: tl.constexpr, t, m, s, res, V: tl.constexpr,
                 BV: tl.constexpr):
    """One chunk of the weights the token is drawn from: max(p - q, 0) where `res` is 1 (q the rejected
    draft's), else p (q read as 0: the mask is then empty); 0 past V."""
    r = tl.arange(0, BV)
    z = tl.load(row + (v0 + r) * L_VS, mask=v0 + r < V, other=float("-inf")).to(tl.float32) / t
    q = tl.load(qrow + (v0 + r) * Q_VS, mask=v0 + r < V * res, other=0.0)
    return tl.maximum(tl.exp(z - m) / s - q, 0.0)


@triton.jit
def spec_sample_kernel(l_ptr, ids_ptr, pos_ptr, q_ptr, u_ptr, t_ptr, next_ptr, kept_ptr, T: tl.constexpr,
                       V: tl.constexpr, L_BS: tl.constexpr, L_TS: tl.constexpr, L_VS: tl.constexpr,
                       I_BS: tl.constexpr, I_TS: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr,
                       Q_BS: tl.constexpr, Q_TS: tl.constexpr, Q_VS: tl.constexpr, U_BS: tl.constexpr,
                       U_TS: tl.constexpr, TE_S: tl.constexpr, N_BS: tl.constexpr, N_TS: tl.constexpr,
                       K_BS: tl.constexpr, K_TS: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BV)
    t = tl.load(t_ptr + b * TE_S)
    if t == 0:
        greedy_lanes(l_ptr, ids_ptr, pos_ptr, next_ptr, kept_ptr, b, T, V, L_BS, L_TS, L_VS, I_BS, I_TS, P_BS, P_TS,
                     N_BS, N_TS, K_BS, K_TS, BV)
    else:
        a = 0  # the last surviving lane
        live = 1
        for j in tl.static_range(1, T):  # draft j against lane j - 1's p: u x q(d) < p(d)
            d = tl.load(ids_ptr + b * I_BS + j * I_TS)
            d = tl.where((d >= 0) & (d < V), d, 0)
            row = l_ptr + b * L_BS + (j - 1) * L_TS
            m, s = softmax_stats(row, L_VS, t, V, BV)
            pd = tl.exp(tl.load(row + d * L_VS).to(tl.float32) / t - m) / s
            qd = tl.load(q_ptr + b * Q_BS + j * Q_TS + d * Q_VS)
            u = tl.load(u_ptr + b * U_BS + j * U_TS)
            ok = (live > 0) & (tl.load(pos_ptr + b * P_BS + j * P_TS) >= 0) & (u * qd < pd)
            a = tl.where(ok, j, a)
            live = ok.to(tl.int32)
        nj = a + 1
        rej = tl.load(pos_ptr + b * P_BS + nj * P_TS, mask=nj < T, other=-1) >= 0  # draft a + 1 rejected
        row = l_ptr + b * L_BS + a * L_TS
        qrow = q_ptr + b * Q_BS + nj * Q_TS
        m, s = softmax_stats(row, L_VS, t, V, BV)
        npos = 0
        for v0 in range(0, V, BV):
            w = draw_weights(row, qrow, v0, L_VS, Q_VS, t, m, s, rej.to(tl.int32), V, BV)
            npos += tl.sum((w > 0).to(tl.int32), axis=0)
        res = (rej & (npos > 0)).to(tl.int32)  # the residual, unless it is all 0 (then p)
        total = 0.0
        last = -1
        for v0 in range(0, V, BV):
            w = draw_weights(row, qrow, v0, L_VS, Q_VS, t, m, s, res, V, BV)
            total = tl.max(tl.cumsum(w, axis=0) + total, axis=0)
            last = tl.maximum(last, tl.max(tl.where(w > 0, v0 + r, -1), axis=0))
        x = tl.load(u_ptr + b * U_BS) * total
        c0 = 0.0
        n = 0
        for v0 in range(0, V, BV):
            c = tl.cumsum(draw_weights(row, qrow, v0, L_VS, Q_VS, t, m, s, res, V, BV), axis=0) + c0
            n += tl.sum(((c <= x) & (v0 + r < V)).to(tl.int32), axis=0)
            c0 = tl.max(c, axis=0)
        tok = tl.minimum(n, last)
        for j in tl.static_range(T):
            nv = tl.where(j == a, tok, 0).to(tl.int64)
            if j + 1 < T:
                nv = tl.where(j < a, tl.load(ids_ptr + b * I_BS + (j + 1) * I_TS), nv)
            tl.store(next_ptr + b * N_BS + j * N_TS, nv.to(next_ptr.dtype.element_ty))
            tl.store(kept_ptr + b * K_BS + j * K_TS, tl.where(j <= a, tl.load(pos_ptr + b * P_BS + j * P_TS), -1))


@triton.jit
def draft_next_kernel(l_ptr, s_ptr, pos_ptr, ids_ptr, np_ptr, h_ptr, T: tl.constexpr, V: tl.constexpr,
                      N: tl.constexpr, D: tl.constexpr, L_BS: tl.constexpr, L_VS: tl.constexpr, S_BS: tl.constexpr,
                      S_TS: tl.constexpr, S_NS: tl.constexpr, S_DS: tl.constexpr, P_BS: tl.constexpr,
                      P_TS: tl.constexpr, I_BS: tl.constexpr, I_TS: tl.constexpr, Q_BS: tl.constexpr,
                      Q_TS: tl.constexpr, H_BS: tl.constexpr, H_TS: tl.constexpr, H_NS: tl.constexpr,
                      H_DS: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BT)
    p = tl.load(pos_ptr + b * P_BS + t * P_TS, mask=t < T, other=-1)
    n = tl.sum((p >= 0).to(tl.int32), axis=0)
    top = tl.max(p, axis=0)
    lane = tl.maximum(n - 1, 0)
    bi = lane_argmax(l_ptr + b * L_BS, V, L_VS, BV)  # the greedy lanes' argmax: one rule for both ops
    live = n > 0
    for j in tl.static_range(T):
        if j == 0:
            tl.store(ids_ptr + b * I_BS, tl.where(live, bi, 0).to(ids_ptr.dtype.element_ty))
            tl.store(np_ptr + b * Q_BS, tl.where(live, top + 1, -1))
        else:
            tl.store(ids_ptr + b * I_BS + j * I_TS, tl.zeros((), ids_ptr.dtype.element_ty))
            tl.store(np_ptr + b * Q_BS + j * Q_TS, tl.full((), -1, np_ptr.dtype.element_ty))
    d = tl.arange(0, BD)
    for k in tl.static_range(N):
        for d0 in range(0, D, BD):
            m = d0 + d < D
            x = tl.load(s_ptr + b * S_BS + lane * S_TS + k * S_NS + (d0 + d) * S_DS, mask=m, other=0.0)
            x = tl.where(live, x, tl.zeros_like(x))
            for j in tl.static_range(T):
                tl.store(h_ptr + b * H_BS + j * H_TS + k * H_NS + (d0 + d) * H_DS, x if j == 0 else tl.zeros_like(x), mask=m)


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name == "spec_sample":
        return _sample_calls(operands, results)
    if op_name == "draft_next":
        return _draft_next_calls(operands, results)
    if op_name != "spec_accept":
        raise KeyError(f"spec_accept family has no op '{op_name}'")
    lg, ids, pos = operands["logits"], operands["ids"], operands["pos"]
    nxt, kept = results["next_ids"], results["kept_pos"]
    if lg.type.rank != 3:
        raise ValueError(f"spec_accept: logits must be [B, T, V], got {lg.shape}")
    B, T, V = lg.shape
    BV = min(1024, triton.next_power_of_2(V))
    ce = dict(T=T, V=V, L_BS=lg.strides[0], L_TS=lg.strides[1], L_VS=lg.strides[2], I_BS=ids.strides[0],
              I_TS=ids.strides[1], P_BS=pos.strides[0], P_TS=pos.strides[1], N_BS=nxt.strides[0],
              N_TS=nxt.strides[1], K_BS=kept.strides[0], K_TS=kept.strides[1], BV=BV)
    pointers = [ptr("l_ptr", "operand", "logits", lg), ptr("ids_ptr", "operand", "ids", ids),
                ptr("pos_ptr", "operand", "pos", pos), ptr("next_ptr", "result", "next_ids", nxt),
                ptr("kept_ptr", "result", "kept_pos", kept)]
    return [KernelCall(call_name("spec_accept", ce, f"b{B}_t{T}_v{V}_{lg.dtype}"), spec_accept_kernel, ce, pointers,
                       (B, 1, 1), num_warps=4,
                       unaligned=unaligned({"l_ptr": lg, "ids_ptr": ids, "pos_ptr": pos, "next_ptr": nxt,
                                            "kept_ptr": kept}),
                       bytes_moved=lg.type.nbytes + ids.type.nbytes + 2 * pos.type.nbytes + nxt.type.nbytes)]


def _sample_calls(operands: dict[str, TensorArg | None], results: dict[str, TensorArg]) -> list[KernelCall]:
    lg, ids, pos, q, u, te = (operands[n] for n in ("logits", "ids", "pos", "draft_probs", "uniforms", "temperature"))
    nxt, kept = results["next_ids"], results["kept_pos"]
    if lg.type.rank != 3 or q.shape != lg.shape:
        raise ValueError(f"spec_sample: logits and draft_probs must be [B, T, V], got {lg.shape}, {q.shape}")
    B, T, V = lg.shape
    BV = min(1024, triton.next_power_of_2(V))
    ce = dict(T=T, V=V, L_BS=lg.strides[0], L_TS=lg.strides[1], L_VS=lg.strides[2], I_BS=ids.strides[0],
              I_TS=ids.strides[1], P_BS=pos.strides[0], P_TS=pos.strides[1], Q_BS=q.strides[0], Q_TS=q.strides[1],
              Q_VS=q.strides[2], U_BS=u.strides[0], U_TS=u.strides[1], TE_S=te.strides[0], N_BS=nxt.strides[0],
              N_TS=nxt.strides[1], K_BS=kept.strides[0], K_TS=kept.strides[1], BV=BV)
    args = {"l_ptr": ("logits", lg), "ids_ptr": ("ids", ids), "pos_ptr": ("pos", pos), "q_ptr": ("draft_probs", q),
            "u_ptr": ("uniforms", u), "t_ptr": ("temperature", te)}
    pointers = [ptr(p, "operand", n, a) for p, (n, a) in args.items()]
    pointers += [ptr("next_ptr", "result", "next_ids", nxt), ptr("kept_ptr", "result", "kept_pos", kept)]
    # the logits and the draft rows read up to 2T + 4 and 3 times; modeled as one pass each. 8 warps: 4 spill
    # 8 bytes on sm_90a (56 registers either way; gfx950 spill-free)
    return [KernelCall(call_name("spec_sample", ce, f"b{B}_t{T}_v{V}_{lg.dtype}"), spec_sample_kernel, ce, pointers,
                       (B, 1, 1), num_warps=8,
                       unaligned=unaligned({p: a for p, (_, a) in args.items()} | {"next_ptr": nxt, "kept_ptr": kept}),
                       bytes_moved=lg.type.nbytes + q.type.nbytes + ids.type.nbytes + 2 * pos.type.nbytes
                       + u.type.nbytes + te.type.nbytes + nxt.type.nbytes)]


def _draft_next_calls(operands: dict[str, TensorArg | None], results: dict[str, TensorArg]) -> list[KernelCall]:
    lg, st, pos = operands["logits"], operands["streams"], operands["pos"]
    ids, nxt, h = results["ids"], results["pos_next"], results["hidden"]
    if lg.type.rank != 2 or st.type.rank != 4:
        raise ValueError(f"draft_next: logits must be [B, V] and streams [B, T, n, D], got {lg.shape}, {st.shape}")
    B, T, N, D = st.shape
    V = lg.shape[1]
    ce = dict(T=T, V=V, N=N, D=D, L_BS=lg.strides[0], L_VS=lg.strides[1], S_BS=st.strides[0], S_TS=st.strides[1],
              S_NS=st.strides[2], S_DS=st.strides[3], P_BS=pos.strides[0], P_TS=pos.strides[1], I_BS=ids.strides[0],
              I_TS=ids.strides[1], Q_BS=nxt.strides[0], Q_TS=nxt.strides[1], H_BS=h.strides[0], H_TS=h.strides[1],
              H_NS=h.strides[2], H_DS=h.strides[3], BT=triton.next_power_of_2(T),
              BV=min(1024, triton.next_power_of_2(V)), BD=min(1024, triton.next_power_of_2(D)))
    args = {"l_ptr": ("operand", "logits", lg), "s_ptr": ("operand", "streams", st), "pos_ptr": ("operand", "pos", pos),
            "ids_ptr": ("result", "ids", ids), "np_ptr": ("result", "pos_next", nxt), "h_ptr": ("result", "hidden", h)}
    pointers = [ptr(p, kind, n, a) for p, (kind, n, a) in args.items()]
    # one program per sequence: the vocabulary streamed once, one lane of streams read, every lane written
    return [KernelCall(call_name("draft_next", ce, f"b{B}_t{T}_v{V}_n{N}_d{D}_{lg.dtype}_{st.dtype}"),
                       draft_next_kernel, ce, pointers, (B, 1, 1), num_warps=4,
                       unaligned=unaligned({p: a for p, (_, _, a) in args.items()}),
                       bytes_moved=lg.type.nbytes + pos.type.nbytes + st.type.nbytes // T + ids.type.nbytes
                       + nxt.type.nbytes + h.type.nbytes)]
