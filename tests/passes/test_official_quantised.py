"""Official numerics on quantised checkpoints (`init-random --quantized`: FP8 dense weights, FP4 experts),
end to end (issue 27): the reference model, the IR interpreter (the compiled module), the program executor
and the C runtime on the host device agree, and greedy decoding gives the same ids everywhere.

Every stage runs the same op references, so the agreement is bit for bit (tolerance 0), in fp32 and bf16:
the traced and the compiled module give the reference model's logits exactly on a ragged scenario (with
`V4_OFFICIAL_SEEDS`, after every pass: the passes' own numerics check, `compile --check-numerics`, run in
the trace's dtype, not only its fp32 shadow); the lowered program run by the executor and by the C runtime
gives the interpreter's logits exactly. Greedy: 2 ragged prompts (chunked prefill), 32 new tokens each.

CI runs one case (quantised tiny-pro in bf16, ~30 s); `V4_OFFICIAL_SEEDS=3` runs tiny and tiny-pro in fp32
and bf16 on that many seeds (~2 min a case on one core).
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from v4compile import frontend
from v4compile.config import preset
from v4compile.ops import op
from v4compile.harness import IRRunner, PagedAllocator, Scenario, max_error, reference_logits
from v4compile.init_random import init_random
from v4compile.model.batching import prefill_chunks
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.passes.numerics import NumericsCheck
from v4compile.pool import PoolGeometry
from v4compile.program.build import build_program
from v4compile.program.execute import Buffers, execute
from v4compile.program.verify import verify_program
from v4compile.runtime.c_backend import CRuntime
from v4compile.trace import TraceOptions
from v4compile.weights_convert import load_ir_weights

NEW = 32
PROMPTS = [[5, 77, 301, 12, 9, 400, 33, 2, 18, 250, 7, 91, 66, 3, 140, 88, 21, 404, 11, 500],
           [42, 7, 13, 260, 99, 1, 310, 58, 8, 71, 222]]
_SEEDS = int(os.environ.get("V4_OFFICIAL_SEEDS", "0"))
CASES = ([(p, d, s) for p in ("tiny", "tiny-pro") for d in ("fp32", "bf16") for s in range(_SEEDS)] if _SEEDS
         else [("tiny-pro", "bf16", 2)])

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.isa]  # isa: see .ci/run


@pytest.fixture(scope="module", params=CASES, ids=[f"{p}-{d}-seed{s}" for p, d, s in CASES])
def case(request, tmp_path_factory):
    name, dtype, seed = request.param
    ck = init_random(tmp_path_factory.mktemp("ck") / name, preset(name), seed=seed, quantized=True)
    opts = TraceOptions(numerics="official", dtype=dtype, batch=len(PROMPTS), chunk=16, decode_batch=len(PROMPTS),
                        capacity=64)
    fe = frontend.load(str(ck), None, None, opts)
    ref = fe.reference()
    sc = Scenario.make(fe.cfg.vocab_size, 2, 24, 3, seed=seed)
    check = NumericsCheck(ref, fe.source, sc, 16, 0.0, capacity=64)
    every_pass = PipelineOptions(check_numerics=check, out=io.StringIO()) if _SEEDS else PipelineOptions()
    result = PassManager(DEFAULT_PIPELINE, every_pass).run(fe.module)
    m = result.module
    return fe, ref, check, result, m, load_ir_weights(m, fe.source)


def greedy(step, m, prompts, new):
    """Greedy ids and every step's logits, stepping as a runtime does (chunked ragged prefill, paged pool);
    `step(fname, inputs)` runs one function and returns its logits."""
    alloc = PagedAllocator(PoolGeometry.from_attrs(m.attrs))
    T = m.functions["prefill"].attrs["tokens"]
    last = [None] * len(prompts)
    for ids, pos, n in prefill_chunks(prompts, [0] * len(prompts), T):
        logits = step("prefill", {"ids": ids, "pos": pos, **alloc.step_inputs(pos)})
        for b in range(len(prompts)):
            if n[b]:
                last[b] = logits[b]
    lengths = [len(p) for p in prompts]

    def decode(tok):
        pos = torch.tensor(lengths).view(-1, 1)
        lengths[:] = [n + 1 for n in lengths]
        return step("decode", {"ids": tok.view(-1, 1), "pos": pos, **alloc.step_inputs(pos)})
    return _greedy_from(torch.stack(last), decode, new)


def _greedy_from(logits, decode, new):
    """`new` greedy ids per row from the first logits, `decode(tokens) -> logits` giving the next ones; also
    every logits seen."""
    out, seen = [[] for _ in range(logits.shape[0])], [logits]
    for _ in range(new):
        tok = logits.float().argmax(-1)
        for b in range(len(out)):
            out[b].append(int(tok[b]))
        if len(out[0]) == new:
            break
        logits = decode(tok)
        seen.append(logits)
    return out, seen


def reference_greedy(ref, prompts, new):
    cache, logits = ref.prefill(prompts, chunk=16, capacity=64)
    return _greedy_from(logits, lambda tok: ref.decode(tok.tolist(), cache), new)


def interpreter_greedy(m, w, prompts, new):
    r = IRRunner(m, w)
    logits = r.prefill(prompts)
    out, seen = [[] for _ in prompts], [logits]
    for _ in range(new):
        tok = logits.argmax(-1)
        for b in range(len(prompts)):
            out[b].append(int(tok[b]))
        if len(out[0]) == new:
            break
        logits = r.decode(tok.tolist())
        seen.append(logits)
    return out, seen


def executor_step(prog, w):
    bufs = Buffers()

    def step(fname, inputs):
        f = prog.functions[fname]
        state = {b.name: torch.zeros(b.nbytes, dtype=torch.uint8) for b in f.buffers if b.kind in ("pool", "state")}
        return execute(f, bufs, {**inputs, **state}, w)["logits"]
    return step


def _same(a, b) -> bool:
    return all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))


def test_the_compiled_module_is_bit_exact_against_the_reference(case):
    """Tolerance 0: the traced and the compiled module's logits are the reference model's on a ragged
    scenario (prefill chunks + decode steps); with V4_OFFICIAL_SEEDS also after every pass."""
    fe, ref, check, result, m, w = case
    assert check.error(fe.module) == 0.0 and check.error(m) == 0.0
    if _SEEDS:
        errors = {r.name: r.numerics_error for r in result.records}
        assert result.traced_error == 0.0 and set(errors.values()) == {0.0}, errors
    for name in ("moe_router_experts_shared", "moe_mhc_post_pre", "mhc_moe_mhc"):  # the last layer's MoE, layer 0's, the others'
        assert any(op.name == name and op.attrs["route_weight"] == "before_w2" and op.attrs["act"] == "fp8"
                   for fn in m.functions.values() for op in fn.ops), name


def test_greedy_ids_agree_everywhere(case):
    """Reference model, IR interpreter, program executor, host device: the same 32 greedy ids per prompt
    and the same logits at every step, bit for bit."""
    fe, ref, check, result, m, w = case
    want, want_logits = reference_greedy(ref, PROMPTS, NEW)
    assert len(want[0]) == NEW and len(set(want[0])) > 1  # a real continuation, not one token repeated
    got, logits = interpreter_greedy(m, w, PROMPTS, NEW)
    assert got == want and _same(logits, want_logits)
    prog = verify_program(build_program(m))
    got, logits = greedy(executor_step(prog, w), m, PROMPTS, NEW)
    assert got == want and _same(logits, want_logits)
    rt = CRuntime(prog, w, "host")
    try:
        got, logits = greedy(lambda f, inputs: rt.run(f, inputs, graph=f == "decode")["logits"], m, PROMPTS, NEW)
    finally:
        rt.close()
    assert got == want and _same(logits, want_logits)


def test_hf_order_in_the_reference_is_caught(case, monkeypatch):
    """The same comparison fails when the reference model alone weights the experts after w2 (HF's
    order): on these quantised weights the logits move by > 1e-2 of their scale (issue 27 measured 40 %
    on tiny-pro), far beyond the tolerance 0 above."""
    fe, ref, check, result, m, w = case
    experts = op.moe_experts.ref
    monkeypatch.setattr(op.moe_experts, "ref", lambda *a, route_weight, **k: experts(*a, route_weight="after_w2", **k))
    old = reference_logits(ref, check.scenario, 16, 64)
    assert max_error(old, check.expected) / check.scale > 1e-2
