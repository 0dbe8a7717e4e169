"""The host device's one-call speculative steps: the program's `spec_b<B>` (greedy), `spec_b<B>_d<k>` (greedy, k
drafts in the call) and `spec_s<B>` (sampled) (`passes/spec_steps.py`: verify, the `spec_accept` / `spec_sample`
op, the MTP block's draft; `spec_b<B>_d<k>`: each recursive draft fed by `draft_next`) against the two-call path
(verify, the host's acceptance, then `draft_b<B>` calls), on the C runtime's buffers with the ops' reference
kernels (tiny-doc, K = 2).

* one step in the batch-2 bucket from the same pool (sequence 0's drafts right, sequence 1's first wrong;
  sampled: seeded uniforms, q uniform / one-hot so that sequence 0 keeps both and sequence 1 draws from the
  residual; on the gfx950 program sequence 1 greedy in the sampled step): logits, kept lanes, the MTP logits and
  streams and every pool / state byte after the undo equal the two calls' bit for bit, and the outputs the
  program executor's (each launch's reference at the program's byte places); an acceptance keeping one lane too
  many (sampled: accepting with min(1, q/p)) differs;
* the same step drafting K = 2 (`spec_b2_d2` against verify_b2, draft_b2 and the recursive draft_b2 call): logits,
  kept lanes, both drafts and every pool / state byte after the undo bit for bit; a recursive draft left at its
  predecessor's position, or fed lane 0's streams, differs;
* generation with K drafts, greedy then sampled (seeded): the ids (greedy: plain decoding's), the acceptance and
  the pool equal the two-call path's, one `spec_b<B>_d2` (no draft call after it) / `spec_s<B>` (the second draft
  a `draft_b<B>` call) per step, captured once and replayed; the broken greedy acceptance is refused by the host's
  check, the broken sampled one changes the ids;
* each step adds no kernel specialisation but its acceptance's (and `spec_b<B>_d<k>` `draft_next`'s, one for
  every draft), whose Triton kernel the C runtime runs on the program's buffers as the reference (a broken kernel
  caught);
* the GPU program (gfx950, its kernels placeholders: each launch its reference): the same one steps bit for
  bit, the same new specialisations, and generation with one captured `spec_b2_d2` (sampled: `spec_s2`) a
  step on the host device and on the fake HIP and CUDA drivers (greedy: plain decoding's ids on the cpu device,
  the broken acceptance refused; sampled: the ids of a host session).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import v4compile
from spec_rollback import host_acceptance, pool_bytes
from v4compile import frontend
from v4compile.artifact import Buckets, load_artifact
from v4compile.cli.driver import compile_artifact
from v4compile.ir.registry import get_op
from v4compile.runtime import speculative as rs
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 10
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    """tiny-doc (trained: its MTP block's drafts are mostly right) with K = 2 (decode 1, 2; prefill 16): the
    artifact, two seeded prompts, their plain greedy ids."""
    fe = frontend.load(str(EXAMPLE), None, None, TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    art = compile_artifact(fe, tmp_path_factory.mktemp("doc") / "doc", Buckets((1, 2), (16,), draft_tokens=2))
    prompts = [[int(x) for x in np.random.default_rng(n).integers(0, fe.cfg.vocab_size, n)] for n in (5, 11)]
    s = v4compile.load(art, device="cpu", threads=1)
    try:
        return art, prompts, s.generate(prompts, NEW)
    finally:
        s.close()


@pytest.fixture(scope="module")
def gpu_doc(doc, tmp_path_factory):
    """The same model and K compiled for the cpu target and gfx950 (one weights directory; the GPU program, which
    the host device runs, in its one decode bucket, 2; the AOT a placeholder whose sidecars load, `fake_aot`): the
    artifact, `doc`'s prompts and plain greedy ids (the cpu device's)."""
    from fake_aot import placeholder_compile_calls
    from v4compile.codegen import aot

    fe = frontend.load(str(EXAMPLE), None, None, TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(aot, "compile_calls", placeholder_compile_calls(loadable=True))
        art = compile_artifact(fe, tmp_path_factory.mktemp("gdoc") / "doc", Buckets((2,), (16,), draft_tokens=2),
                               targets=("cpu", "gfx950"))
    return (art, *doc[1:])


def host_session(art):
    return v4compile.load(art, device="host", threads=1, kernels="reference")


@pytest.fixture(scope="module")
def host(doc):
    s = host_session(doc[0])
    yield s
    s.close()


@pytest.fixture(scope="module")
def gpu_host(gpu_doc):
    s = host_session(gpu_doc[0])
    yield s
    s.close()


def keep_one_too_many(monkeypatch) -> None:
    """The acceptance's reference keeping the lane after the last surviving draft too (where there is one)."""
    op = get_op("spec_accept")
    ref = op.ref

    def broken(logits, ids, pos):
        best, kept = ref(logits, ids, pos)
        n = (kept >= 0).sum(1)
        for b in range(kept.shape[0]):
            if n[b] < kept.shape[1] and pos[b, n[b]] >= 0:
                kept[b, n[b]] = pos[b, n[b]]
        return best, kept
    monkeypatch.setattr(op, "ref", broken)


def inverted_ratio_op(monkeypatch) -> None:
    """`spec_sample`'s reference accepting with min(1, q/p) (`spec_sampling.inverted_ratio`)."""
    import torch

    from spec_sampling import inverted_ratio

    rule = inverted_ratio()

    def broken(*args):
        return tuple(torch.from_numpy(x) for x in rule(*(a.float().numpy() if a.is_floating_point() else a.numpy()
                                                         for a in args)))
    monkeypatch.setattr(get_op("spec_sample"), "ref", broken)


SAMPLED = ("draft_probs", "uniforms", "temperature")  # `spec_s<B>`'s own inputs


def sampling(vocab: int, ids: np.ndarray, mixed: bool) -> dict:
    """`spec_s2`'s own inputs for `both_steps`'s drafts (temperature 0.8 each, seeded uniforms): sequence 0's
    drafts (plain greedy's) drawn from a uniform q (p/q large: both survive; q/p small: rejected), sequence 1's
    from a q one-hot at each (survives with probability p(d): its first, wrong, rejected by its uniform 0.99,
    the token then drawn from the residual); `mixed`: sequence 1 greedy instead (temperature 0: the argmax
    rule, its first draft rejected all the same)."""
    q = np.zeros((2, 3, vocab), dtype=np.float32)
    q[0, 1:] = 1.0 / vocab
    q[1, 1:] = np.eye(vocab, dtype=np.float32)[ids[1, 1:]]
    u = np.random.default_rng(5).random((2, 3), dtype=np.float32)
    u[1, 1] = 0.99
    return {"draft_probs": q, "uniforms": u, "temperature": np.array([0.8, 0.0 if mixed else 0.8], dtype=np.float32)}


def one_step(s, seqs, drafts, inputs, fused: bool) -> dict:
    """One step of `seqs` in the batch-2 bucket, greedy or (`inputs` with `SAMPLED`) sampled: `spec_b2` /
    `spec_s2`, or `verify_b2`, the host's acceptance (`speculation.accept`'s greedy rule / `sample_accept`) and
    `draft_b2`; the rejected positions' rows restored either way. Its outputs."""
    from v4compile.runtime.undo import PoolUndo
    from v4compile.speculation import sample_accept

    sampled = "uniforms" in inputs
    undo = PoolUndo(s.backend, [(q.slot, list(q.blocks), q.length + 1, q.length + 2) for q in seqs])
    if fused:
        r = s.backend.run_outputs("spec_s2" if sampled else "spec_b2", inputs)
        out = {"logits": r["logits"], "kept": r["spec.kept_pos"], "draft.logits": r["draft.logits"],
               "draft.streams": r["draft.streams"]}
    else:
        r = s.backend.run_outputs("verify_b2", {k: v for k, v in inputs.items() if k not in SAMPLED})
        if sampled:
            nxt, kept = sample_accept(r["logits"], inputs["ids"], inputs["pos"], *(inputs[k] for k in SAMPLED))
        else:
            kept, nxt = host_acceptance(inputs, r["logits"], drafts)
        out = {"logits": r["logits"], "kept": kept}
    undo.restore({q.slot: int(k.max()) + 1 for q, k in zip(seqs, out["kept"])})
    if not fused:
        out["draft.logits"], out["draft.streams"] = rs.CompiledDraft(s).after_verify(2, r["streams"], nxt, kept, seqs)
    out["draft.streams"] = np.where(out["kept"][..., None, None] >= 0, out["draft.streams"], 0)  # kept lanes
    return out


@contextmanager
def drafted_pair(s, doc):
    """Both prompts prefilled plainly, each holding two drafts (sequence 0's right, sequence 1's first wrong), room
    reserved for a step: (sequences, drafts, the step's inputs); the sequences released after."""
    _, prompts, want = doc
    seqs = [s.open() for _ in prompts]
    try:
        for q, p in zip(seqs, prompts):
            s.extend(q, p)
        drafts = [want[0][1:3], [(want[1][1] + 1) % s.vocab, want[1][2]]]
        ids = np.array([[w[0]] + d for w, d in zip(want, drafts)], dtype=np.int64)
        pos = np.array([np.arange(q.length, q.length + 3) for q in seqs], dtype=np.int64)
        for q in seqs:
            s.reserve(q, q.length + 2)
        table, slot = s.table(seqs, 2)
        yield seqs, drafts, {"ids": ids, "pos": pos, "block_table": table, "slot": slot}
    finally:
        for q in seqs:
            s.release(q)


def both_steps(s, doc, sampled: str = "") -> tuple[tuple[dict, dict], tuple[dict, dict], dict]:
    """`one_step` both ways from the same pool and state (both prompts prefilled plainly; two drafts each:
    sequence 0's right, sequence 1's first wrong; `sampled` "sampled" / "mixed": with `sampling`'s inputs):
    (outputs, pool and state bytes after) of each, and `executed`'s outputs."""
    import torch

    from v4compile.runtime.undo import access

    with drafted_pair(s, doc) as (seqs, drafts, inputs):
        if sampled:
            inputs.update(sampling(s.vocab, inputs["ids"], sampled == "mixed"))
        start = pool_bytes(s.backend)
        got = []
        for fused in (True, False):
            for n, a in start.items():
                access(s.backend).put_rows(n, 0, torch.from_numpy(a.copy()))
            got.append((one_step(s, seqs, drafts, inputs, fused), pool_bytes(s.backend)))
        return got[0], got[1], executed(s, inputs, start)


def executed(s, inputs, start) -> dict:
    """`spec_b2` (`spec_s2` with sampling inputs) run by the program executor (`program/execute.py`: each launch's reference on the program's
    own byte places) from the pool and state `start`: its outputs, the oracle of the C runtime's run."""
    import torch

    from v4compile.program.execute import Buffers, execute

    f = s.backend.program.functions["spec_s2" if "uniforms" in inputs else "spec_b2"]
    weights = load_artifact(s.art.path).weights()
    try:
        return {n: t.numpy() for n, t in execute(f, Buffers(), {**{k: torch.from_numpy(v) for k, v in inputs.items()},
                                                               **{n: torch.from_numpy(a.copy()) for n, a in start.items()}},
                                               weights).items()}
    finally:
        weights.close()


def differences(s, doc, sampled: str = "") -> list[str]:
    """What the one-call step gives otherwise than the two calls, and (`executor: ...`) than the executor."""
    (a, pa), (b, pb), ex = both_steps(s, doc, sampled)
    assert [int((k >= 0).sum()) for k in b["kept"]] == [3, 1]  # both drafts kept; the first rejected
    oracle = {"logits": ex["logits"], "kept": ex["spec.kept_pos"], "draft.logits": ex["draft.logits"]}
    return [n for n in b if not np.array_equal(a[n], b[n])] + [n for n in pb if not np.array_equal(pa[n], pb[n])] + \
        [f"executor: {n}" for n in oracle if not np.array_equal(a[n], oracle[n])]


@pytest.mark.parametrize("program,sampled", [("host", ""), ("gpu", ""), ("host", "sampled"), ("gpu", "mixed")],
                         ids=["host", "gpu", "host-sampled", "gpu-mixed"])
def test_one_call_step_equals_two_calls_bit_for_bit(program, sampled, request, monkeypatch):
    """(The gfx950 program's sampled step with a greedy sequence in it: `spec_sample`'s greedy rows.)"""
    doc = request.getfixturevalue({"host": "doc", "gpu": "gpu_doc"}[program])
    host = request.getfixturevalue({"host": "host", "gpu": "gpu_host"}[program])
    assert differences(host, doc, sampled) == []
    (keep_one_too_many if not sampled else inverted_ratio_op)(monkeypatch)
    bad = differences(host, doc, sampled)
    assert "kept" in bad and "draft.logits" in bad and "pool.main" in bad



def not_advanced(monkeypatch) -> None:
    """`draft_next`'s reference leaving the next draft at its predecessor's last position (not one on)."""
    op = get_op("draft_next")
    ref = op.ref

    def broken(logits, streams, pos):
        ids, nxt, hidden = ref(logits, streams, pos)
        nxt[:, 0] = nxt[:, 0] - (nxt[:, 0] >= 0).long()
        return ids, nxt, hidden
    monkeypatch.setattr(op, "ref", broken)


def first_lane(monkeypatch) -> None:
    """`draft_next`'s reference taking the streams of lane 0 instead of the last valid lane's."""
    op = get_op("draft_next")
    ref = op.ref

    def broken(logits, streams, pos):
        import torch

        return ref(logits, streams, torch.where(pos[:, :1] >= 0, torch.zeros_like(pos), pos))
    monkeypatch.setattr(op, "ref", broken)


def recursive_steps(s, doc) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """K = 2 drafts made by one step of `both_steps`' sequences (from the same pool both ways): `spec_b2_d2` (its
    recursive draft's MTP ring rows saved before the call and restored after it, with the verify's rejected rows,
    as `SpecStep` does), and the two-call path (`one_step`'s verify_b2, the host's acceptance and draft_b2, then
    `CompiledDraft.drafts`' recursive draft_b2 call, its ring writes undone). Each: (outputs: logits, kept lanes,
    the drafts; every pool and state byte after)."""
    import torch

    from v4compile.runtime.undo import PoolUndo, access

    with drafted_pair(s, doc) as (seqs, drafts, inputs):
        start = pool_bytes(s.backend)
        mtp = rs.CompiledDraft(s)
        got = []
        for fused in (True, False):
            for n, a in start.items():
                access(s.backend).put_rows(n, 0, torch.from_numpy(a.copy()))
            if fused:
                undo = PoolUndo(s.backend, [(q.slot, list(q.blocks), q.length + 1, q.length + 2) for q in seqs])
                ring = PoolUndo(s.backend, [(q.slot, list(q.blocks), q.length + 3, q.length + 3) for q in seqs],
                                window_layer=mtp.layer)
                r = s.backend.run_outputs("spec_b2_d2", inputs)
                keep = {q.slot: int(k.max()) + 1 for q, k in zip(seqs, r["spec.kept_pos"])}
                undo.restore(keep)
                ring.restore(keep)
                out = {"logits": r["logits"], "kept": r["spec.kept_pos"],
                       "drafts": np.stack([r["spec.draft1"][:, 0], r["spec.draft2"][:, 0]], 1)}
            else:
                out = one_step(s, seqs, drafts, inputs, False)
                lengths = [int(k.max()) + 1 for k in out["kept"]]
                for q, n in zip(seqs, lengths):  # the sequences as the step leaves them, for the recursive call
                    q.length = n
                entries = [(q, n, out["draft.logits"][b], out["draft.streams"][b, n - 1 - q0])
                           for b, (q, n, q0) in enumerate(zip(seqs, lengths, inputs["pos"][:, 0]))]
                made = mtp.drafts(entries, [2, 2], [rs.Picker(0.0, None)] * 2)
                for q, q0 in zip(seqs, inputs["pos"][:, 0]):
                    q.length = int(q0)
                out = {"logits": out["logits"], "kept": out["kept"], "drafts": np.array([d for d, _ in made])}
            got.append((out, pool_bytes(s.backend)))
        return got[0], got[1]


def test_drafts_in_the_call_equal_draft_calls_bit_for_bit(doc, host, monkeypatch):
    """`spec_b2_d2` (verify, the acceptance, the MTP draft, `draft_next`, the recursive draft, `draft_next`) gives
    the logits, kept lanes and drafts of verify_b2, the host's acceptance, draft_b2 and the recursive draft_b2 call,
    and leaves every pool and state byte as they do; its recursive draft at its predecessor's position, or fed
    the streams of lane 0 (sequence 0 keeps three lanes), does not."""
    (a, pa), (b, pb) = recursive_steps(host, doc)
    assert [int((k >= 0).sum()) for k in b["kept"]] == [3, 1] and b["drafts"].shape == (2, 2)
    assert [n for n in b if not np.array_equal(a[n], b[n])] + [n for n in pb if not np.array_equal(pa[n], pb[n])] \
        == []
    for broken, want in ((not_advanced, {"pool.main"}), (first_lane, {"drafts"})):
        with monkeypatch.context() as m:
            broken(m)
            (a, pa), (b, pb) = recursive_steps(host, doc)
        bad = {n for n in b if not np.array_equal(a[n], b[n])} | {n for n in pb if not np.array_equal(pa[n], pb[n])}
        assert want <= bad and not {"logits", "kept"} & bad, broken.__name__


K = 2


def generate(art, prompts, monkeypatch, fused: bool = True, sample: bool = True, greedy: bool = True,
             in_call: bool = True) -> dict:
    """In a fresh host session, `generate` speculatively: greedy with K drafts (ids, acceptance rates, the pool and
    state bytes after but the MTP ring rows of each sequence's last 2K + 1 positions, calls by function), then
    with `sample` the same prompts sampled (K drafts, temperature 0.8, seeded; the same, keyed `sampled ...`;
    `greedy` False: only those; `in_call` False: the greedy step `spec_b<B>` drafting one, the recursive draft a
    `draft_b<B>` call, as where the drafts cannot be made in the call, `CompiledDraft.in_call`).
    Those rows differ by design: the one-call step drafts on every step's kept lanes (as the cpu device's), the
    two calls skip the draft once no sequence wants one (the steps whose end leaves fewer than K tokens to make:
    at most those positions), rows nothing reads after; `test_one_call_step_equals_two_calls_bit_for_bit`
    compares them."""
    s = v4compile.load(art, device="host", threads=1, kernels="reference")
    calls: Counter = Counter()
    ended = []
    run, release = s.backend.run_outputs, s.release
    got = {}
    try:
        with monkeypatch.context() as m:
            m.setattr(s.backend, "run_outputs", lambda f, i: calls.update([f]) or run(f, i))
            m.setattr(s, "release", lambda q: ended.append((q.slot, list(q.blocks), q.length)) or release(q))
            if not in_call:
                m.setattr(rs.CompiledDraft, "in_call", lambda self, k: False)
            if not fused:
                m.setattr(rs.CompiledDraft, "fused", lambda self, B, k=1, lanes=None: None)
                m.setattr(rs.CompiledDraft, "sampled", lambda self, B: None)
            runs = [("", {})] * greedy + [("sampled ", {"temperature": 0.8, "seed": 3})] * sample
            for key, how in runs:
                calls.clear()
                before = {k: s.backend.rt.stats()[k] for k in ("captures", "replays")}
                got[key + "ids"] = s.generate(prompts, NEW, speculative="mtp", draft_tokens=K, **how)
                got[key + "rates"], got[key + "calls"] = s.last_acceptance.rates(), +calls
                got[key + "pool"] = unread_rows_zeroed(s, pool_bytes(s.backend), ended[-len(prompts):])
                got[key + "graphs"] = {k: s.backend.rt.stats()[k] - v for k, v in before.items()}
        return got
    finally:
        s.close()


def unread_rows_zeroed(s, pool: dict, ended: list) -> dict:
    """`pool` (session `s`'s) with the MTP ring rows of each `ended` sequence's (slot, blocks, length) last
    2K + 1 positions zeroed (`generate`)."""
    from v4compile.runtime.undo import access, written_rows

    store = access(s.backend)
    layer = int(s.art.manifest["pool"]["n_window_layers"]) - 1  # the MTP block's ring: the last of a slot's
    for slot, blocks, length in ended:
        for q in range(length - 2 * K - 1, length):
            for n, row in written_rows(store.geometry, store, slot, blocks, q, window_layer=layer):
                rb = pool[n].nbytes // store.shape(n)[0]
                pool[n][row * rb: (row + 1) * rb] = 0
    return pool


def test_generation_one_call_equals_two_calls(doc, monkeypatch):
    """Greedy and sampled: the one-call step's ids, acceptance and pool are the two calls' (greedy: the ids plain
    decoding's), one `spec_b<B>_d2` (sampled: `spec_s<B>`) a step, captured like decode, and no verify call
    (greedy: no draft call but the first drafts after prefill, the recursive draft in the call; sampled: a
    `draft_b<B>` call), and greedy the same with the recursive draft out of the call (`spec_b<B>`, then
    `draft_b<B>`); with a broken `spec_sample` the sampled ids are not the two calls'."""
    art, prompts, want = doc
    one, two = generate(art, prompts, monkeypatch), generate(art, prompts, monkeypatch, fused=False)
    assert one["ids"] == two["ids"] == want
    assert one["sampled ids"] != want  # (sampled: other ids)
    for key, step in (("", "spec_b{}_d2"), ("sampled ", "spec_s{}")):
        assert one[key + "ids"] == two[key + "ids"] and one[key + "rates"] == two[key + "rates"]
        assert 0 < min(one[key + "rates"]) < 1  # accepted and rejected drafts
        assert [n for n in one[key + "pool"] if not np.array_equal(one[key + "pool"][n], two[key + "pool"][n])] == []
        c, c2 = one[key + "calls"], two[key + "calls"]
        steps, drafts = sum(c[step.format(b)] for b in (1, 2)), c["draft_b2"] + c["draft_b1"]
        assert steps > 0 and c["verify_b2"] + c["verify_b1"] == 0 and sum(c.values()) == steps + drafts + c[
            "prefill_c16"] + c["draft_c16"]  # (greedy: no spec_b<B> drafting one, no plain decode either)
        # greedy: draft_b<B> only for the prompts' first drafts (one call: admitted together); sampled: after steps
        assert drafts == 1 if not key else 0 < drafts <= steps
        assert not any(n.startswith("spec_") for n in c2) and c2["verify_b2"] > 0
        # the one-call step captured once per bucket and replayed (bit for bit, above); nothing captured without
        assert one[key + "graphs"] == {"captures": sum(c[step.format(b)] > 0 for b in (1, 2)), "replays": steps}
        assert two[key + "graphs"]["captures"] == 0
    # the recursive draft out of the call (`spec_b<B>`, then a draft_b<B> call): the same ids, acceptance and pool
    out = generate(art, prompts, monkeypatch, sample=False, in_call=False)
    c = out["calls"]
    assert (out["ids"], out["rates"]) == (one["ids"], one["rates"]) and c["spec_b2_d2"] + c["spec_b1_d2"] == 0
    assert [n for n in out["pool"] if not np.array_equal(out["pool"][n], one["pool"][n])] == []
    assert c["spec_b2"] + c["spec_b1"] > 0 and c["draft_b2"] + c["draft_b1"] > 1
    inverted_ratio_op(monkeypatch)  # `spec_sample` accepting with min(1, q/p): other sampled ids and rates
    bad = generate(art, prompts, monkeypatch, greedy=False)
    assert (bad["sampled ids"], bad["sampled rates"]) != (two["sampled ids"], two["sampled rates"])


def test_a_wrong_acceptance_is_refused(doc, monkeypatch):
    """The acceptance keeping one lane too many: the host's check of `spec_b<B>`'s kept lanes stops the run."""
    keep_one_too_many(monkeypatch)
    with pytest.raises(RuntimeError, match="in-graph acceptance disagrees"):
        generate(doc[0], doc[1], monkeypatch, sample=False)


@pytest.mark.parametrize("program", ["host", "gpu"])
def test_the_step_adds_no_specialisation_but_the_acceptance(program, request):
    """Every launch of `spec_b<B>` but `spec_accept` (of `spec_s<B>` but `spec_sample`; of `spec_b<B>_d2` but
    `spec_accept` and `draft_next`) is one the program's verify or draft functions have (same op, attributes,
    types and strides: the same compiled kernel on a GPU); the step is verify's launches, the acceptance, then the
    draft's (`spec_b<B>_d2`: then `draft_next`, the draft's again, `draft_next`). The GPU program's (after every
    fusion of its pipeline): likewise, its AOT compiled the three new kernels for the target, and the report
    models each k's step from its own launches."""
    import json

    from v4compile.runtime.program_backend import artifact_program

    art = load_artifact(request.getfixturevalue({"host": "doc", "gpu": "gpu_doc"}[program])[0])
    prog = artifact_program(art)
    buckets = (1, 2) if program == "host" else (2,)
    assert {n for n in prog.functions if n.startswith("spec_")} == {
        n for b in buckets for n in (f"spec_b{b}", f"spec_s{b}", f"spec_b{b}_d{K}")}
    if program == "gpu":
        for op in ("spec_accept", "spec_sample", "draft_next"):
            assert {k["target"] for k in art.manifest["kernels"] if k["name"].startswith(op)} == {"gfx950"}
    old = {l.specialisation for n, f in prog.functions.items() if not n.startswith("spec_") for l in f.launches}
    for b in buckets:
        v, d = (prog.functions[f"{k}_b{b}"].launches for k in ("verify", "draft"))
        for step, acceptance in (("spec_b", "spec_accept"), ("spec_s", "spec_sample")):
            f = prog.functions[f"{step}{b}"].launches
            if program == "gpu" and step == "spec_b":  # the report's modeled step is this program's
                m = json.loads((art.path / "report.json").read_text())["spec_step"]["gfx950"][f"spec_b{b}"]
                assert (m["launches"], m["draft_tokens"]) == (len(f), K) and m["cost_ratio"] > 1
                assert m["launches_k"] == [len(f), len(prog.functions[f"spec_b{b}_d{K}"].launches)]
                assert m["steps_us"][0] < m["steps_us"][1] == m["step_us"]
            assert {l.op for l in f if l.specialisation not in old} == {acceptance}
            assert [l.op for l in f] == [l.op for l in v] + [acceptance] + [l.op for l in d]
        f = prog.functions[f"spec_b{b}_d{K}"].launches
        assert {l.op for l in f if l.specialisation not in old} == {"spec_accept", "draft_next"}
        assert len({l.specialisation for l in f if l.op == "draft_next"}) == 1  # one for every draft
        assert [l.op for l in f] == [l.op for l in v] + ["spec_accept"] + ([l.op for l in d] + ["draft_next"]) * K


def acceptance_kernel_run(doc, broken=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`spec_b2` from a zero pool on two host runtimes: every launch its reference, and the same but the
    acceptance's Triton kernel (interpreted, bound to the program's buffers by the C runtime). The drafts are
    the step's own argmax ids (sequence 0's both right, sequence 1's second wrong). (kept lanes of the first,
    of the second, next ids equal)."""
    import torch

    from v4compile.codegen.program_kernels import family_specialise
    from v4compile.runtime.c_backend import CRuntime
    from v4compile.runtime.kernels import make_kernel_calls
    from v4compile.runtime.program_backend import artifact_program

    art = load_artifact(doc[0])
    prog, w = artifact_program(art), art.weights()
    only = make_kernel_calls(lambda fam: family_specialise(fam) if fam == "spec_accept" else None)
    rts = [CRuntime(prog, w, "host", functions=["spec_b2"]), CRuntime(prog, w, "host", functions=["spec_b2"],
                                                                        kernel_calls=only)]
    try:
        ids = torch.tensor([[5, 0, 0], [9, 0, 0]], dtype=torch.int64)
        inputs = {"ids": ids, "pos": torch.arange(3).repeat(2, 1), "slot": torch.tensor([0, 1], dtype=torch.int32),
                  "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}
        for j in (1, 2):  # each draft the argmax of the lane before it (causal: earlier lanes do not change)
            ids[:, j] = rts[0].run("spec_b2", inputs)["spec.next_ids"][:, j - 1]
            rts[0].close()
            rts[0] = CRuntime(prog, w, "host", functions=["spec_b2"])  # a zero pool again
        ids[1, 2] = (ids[1, 2] + 1) % art.manifest["vocab_size"]
        a, b = (rt.run("spec_b2", inputs) for rt in rts)
        return a["spec.kept_pos"].numpy(), b["spec.kept_pos"].numpy(), bool(torch.equal(a["spec.next_ids"],
                                                                                          b["spec.next_ids"]))
    finally:
        for rt in rts:
            rt.close()
        w.close()


def test_the_acceptance_kernel_on_the_host_device(doc, monkeypatch, tmp_path):
    """The C runtime runs `spec_accept`'s Triton kernel on the program's buffers as the reference: the same kept
    lanes and ids; the kernel comparing each draft with the first lane's argmax differs."""
    import kernel_check as kc
    from v4compile.codegen.kernels import spec_accept

    ref, got, same = acceptance_kernel_run(doc)
    assert ref.tolist() == [[0, 1, 2], [0, 1, -1]] and got.tolist() == ref.tolist() and same
    kc.install_broken_kernel(monkeypatch, tmp_path, spec_accept, "greedy_lanes", "prev = bi", "prev = prev")
    ref, got, _ = acceptance_kernel_run(doc)
    assert got.tolist() != ref.tolist()


GPU_NEW = 6  # tokens per prompt on the GPU program (its ids: the first of plain decoding's NEW)


def gpu_generation(s, prompts, new: int = GPU_NEW, **how) -> dict:
    """Speculative generation (K drafts; greedy, or as `how` says) on the session `s` of the gfx950 program: ids,
    calls by function and the C runtime's captures and replays during it."""
    calls: Counter = Counter()
    run = s.backend.run_outputs
    before = {k: s.backend.rt.stats()[k] for k in ("captures", "replays")}
    try:
        s.backend.run_outputs = lambda f, i: calls.update([f]) or run(f, i)
        ids = s.generate(prompts, new, speculative="mtp", draft_tokens=K, **how)
    finally:
        del s.backend.run_outputs
    return {"ids": ids, "calls": +calls,
            "graphs": {k: s.backend.rt.stats()[k] - v for k, v in before.items()}}


@pytest.fixture(scope="module")
def gpu_sampled(gpu_doc, gpu_host) -> dict:
    """The gfx950 program's sampled speculative generation on the host device (`gpu_generation`, temperature
    0.8): one `spec_s2` a step (no verify call), captured once and replayed."""
    got = gpu_generation(gpu_host, gpu_doc[1], temperature=0.8, seed=3)
    c = got["calls"]
    assert c["spec_s2"] > 0 and c["verify_b2"] + c["spec_b2"] == 0 and got["graphs"]["replays"] == c["spec_s2"]
    assert got["graphs"]["captures"] <= 1  # (the module's earlier steps may have captured it already)
    return got


@pytest.mark.parametrize("device", ["host", "hip", "cuda"])
def test_gpu_program_speculates_in_one_captured_call(gpu_doc, gpu_sampled, device, monkeypatch):
    """The GPU program on the host device and on the fake HIP / CUDA drivers made to compute (`Fake.computing_hip`):
    plain decoding's ids, one `spec_b2_d2` a step (no verify call, no draft call after it), captured
    once and replayed (on a fake: one driver graph, launched each step); then, on a fake, sampled: one `spec_s2`
    a step, captured once more, the ids and calls the host session's (`gpu_sampled`). On the host, the checks' broken variants: without the one-call step the same ids from verify calls,
    nothing captured; the broken acceptance refused."""
    from runtime_helpers import Fake

    art, prompts, want = gpu_doc
    s = host_session(art)
    try:
        fake = None if device == "host" else Fake.computing_hip(s, kind=device)
        got = gpu_generation(s, prompts)
        c = got["calls"]
        assert got["ids"] == [w[:GPU_NEW] for w in want]
        n = c["spec_b2_d2"]  # the greedy steps (each drafting K = 2: the recursive draft in the call)
        assert n > 0 and c["verify_b2"] + c["spec_b2"] == 0 and c["draft_b2"] == 1  # (the prompts' first drafts)
        assert got["graphs"] == {"captures": 1, "replays": n}
        if fake is not None:
            assert {k: fake.counts()[k] for k in ("captures", "graph_launches")} == {"captures": 1,
                                                                                     "graph_launches": n}
        if fake is not None:  # (on the host: `gpu_sampled` itself)
            sampled = gpu_generation(s, prompts, temperature=0.8, seed=3)
            c2 = sampled["calls"]
            assert sampled["ids"] == gpu_sampled["ids"] and sampled["calls"] == gpu_sampled["calls"]
            assert c2["spec_s2"] > 0 and c2["verify_b2"] + c2["spec_b2"] == 0 and sampled["graphs"] == {
                "captures": 1, "replays": c2["spec_s2"]}
            assert {k: fake.counts()[k] for k in ("captures", "graph_launches")} == {
                "captures": 2, "graph_launches": n + c2["spec_s2"]}
            return
        with monkeypatch.context() as m:
            m.setattr(rs.CompiledDraft, "fused", lambda self, B, k=1, lanes=None: None)
            two = gpu_generation(s, prompts)
        assert two["ids"] == got["ids"] and two["calls"]["spec_b2_d2"] == 0 and two["calls"]["verify_b2"] > 0
        assert two["graphs"] == {"captures": 0, "replays": 0}
    finally:
        s.close()
    keep_one_too_many(monkeypatch)
    s = host_session(art)
    try:  # (NEW tokens: the first GPU_NEW reject no draft before a lane the broken rule could keep)
        with pytest.raises(RuntimeError, match="in-graph acceptance disagrees"):
            gpu_generation(s, prompts, NEW)
    finally:
        s.close()
