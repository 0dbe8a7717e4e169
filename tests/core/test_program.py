"""The program stage: exact layout, the text form, the verifier, and the executor (the oracle every
runtime is checked against): bit-exact with the IR interpreter, every value read and written at its
place in raw byte buffers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import dense_weights
from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.harness import IRRunner, Scenario, ir_logits
from v4compile.ir.core import Function, Module
from v4compile.ir.types import BYTES
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.program.build import build_program
from v4compile.program.core import Arg
from v4compile.program.execute import Buffers, execute
from v4compile.program.text import parse_program, print_program
from v4compile.program.verify import verify_program
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource, load_ir_weights


def lowered(name: str, numerics: str = "hf", decode_batch: int = 3, batch: int = 3) -> Module:
    m = trace(preset(name), TraceOptions(numerics=numerics, batch=batch, chunk=16, decode_batch=decode_batch,
                                         capacity=160))
    from v4compile.ir.verify import verify

    # verified: a pass that threads the pool planes wrongly (a read before the write it needs) fails here
    return verify(PassManager(DEFAULT_PIPELINE, PipelineOptions()).run(m).module)


@pytest.fixture(scope="module", params=[("tiny", "official"), ("tiny-pro", "hf")])
def case(request):
    name, numerics = request.param
    m = lowered(name, numerics)
    return name, m, verify_program(build_program(m))


def executor_for(prog, bufs):
    def run(fn, weights, inputs, **_):
        return execute(prog.functions[fn.name], bufs, inputs, weights)
    return run


def test_executor_is_bit_exact_with_the_interpreter(case):
    """Ragged batch of 3, chunked prefill (chunk 16, prompts up to 100 tokens), then 32 decode steps."""
    name, m, prog = case
    cfg = preset(name)
    w = load_ir_weights(m, DenseSource(dense_weights(name)))
    sc = Scenario.make(cfg.vocab_size, 3, 100, 32, seed=5)
    want = ir_logits(IRRunner(m, w), sc)
    got = ir_logits(IRRunner(m, w, interpreter=executor_for(prog, Buffers())), sc)
    assert len(got) == 33
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_misplaced_value_gives_wrong_numbers(case):
    """The executor really reads every argument at its place: move one arena result onto a value that is
    still live (bypassing the verifier) and the logits change."""
    name, m, prog = case
    cfg = preset(name)
    f = prog.functions["decode"]
    w = load_ir_weights(m, DenseSource(dense_weights(name)))
    sc = Scenario.make(cfg.vocab_size, 2, 20, 2, seed=6)
    mod = lowered(name, "hf" if name == "tiny-pro" else "official", decode_batch=2, batch=2)
    prog2 = build_program(mod)
    good = ir_logits(IRRunner(mod, w, interpreter=executor_for(prog2, Buffers())), sc)
    f = prog2.functions["decode"]
    # the first launch whose first result lives in the arena while an earlier arena value is still read later
    for i, l in enumerate(f.launches):
        later = {a.root for l2 in f.launches[i + 1:] for _, a in l2.operands if a is not None and a.buffer == "arena"}
        victims = [a for l0 in f.launches[:i] for _, a in l0.results if a.buffer == "arena" and a.root in later]
        name0, r = l.results[0]
        if victims and r.buffer == "arena" and r.root not in {v.root for v in victims}:
            moved = dataclasses.replace(r, offset=victims[-1].offset)
            f.launches[i] = dataclasses.replace(l, results=((name0, moved),) + l.results[1:])
            break
    else:
        pytest.fail("no launch to corrupt")
    with pytest.raises(IRError, match="overlap|placed or typed differently"):
        verify_program(prog2)
    bad = ir_logits(IRRunner(mod, w, interpreter=executor_for(prog2, Buffers())), sc)
    assert not all(torch.equal(a, b) for a, b in zip(good, bad))


def test_text_round_trip(case):
    name, m, prog = case
    text = print_program(prog)
    back = parse_program(text)
    assert back.same_as(prog)
    assert print_program(back) == text
    verify_program(back)


@pytest.mark.parametrize("name", ["tiny", "tiny-pro"])
@pytest.mark.parametrize("decode_batch", [1, 2])
def test_nested_views_compose_offsets_and_strides(name, decode_batch):
    """Regression: a split of a split sits at its parent's offset plus its own, not its root's; at decode
    batch >= 2 both halves are strided (row stride = the root's width)."""
    m = lowered(name, "hf", decode_batch=decode_batch, batch=2)
    fn = m.functions["decode"]
    prog = build_program(m)
    place = {a.value: a for l in prog.functions["decode"].launches for _, a in l.operands + l.results if a}
    root_of = {}
    nested = 0
    for op in fn.ops:
        offs, flat = op.attrs["_arena"], op.attrs["_strides"]
        if op.name != "split":
            for r, o in zip(op.results, offs):
                root_of[r.name] = (o, r.type.shape[-1])
            continue
        src = op.operands[0]
        base_off, width = root_of[src.name]
        item = BYTES[src.type.dtype]
        at = op.attrs["at"]
        assert offs == (base_off, base_off + at * item)
        r0, r1 = op.results
        assert flat == (*(src_stride := flat[:r0.type.rank]), *src_stride)
        assert src_stride[-1] == 1
        if decode_batch >= 2:
            assert src_stride[0] > r0.type.shape[-1]  # a strided view
        root_of[r0.name] = (offs[0], width)
        root_of[r1.name] = (offs[1], width)
        if src.name in {v.name for o in fn.ops if o.name == "split" for v in o.results}:
            nested += 1
        for r, o in zip(op.results, offs):
            if r.name in place:
                assert place[r.name].offset == o
    assert nested >= (2 if name == "tiny" else 3)  # every CSA layer splits a split


def test_a_shifted_view_offset_is_caught():
    m = lowered("tiny", "hf", decode_batch=2, batch=2)
    fn = m.functions["decode"]
    ops = list(fn.ops)
    i = next(k for k, op in enumerate(ops) if op.name == "split")
    offs = ops[i].attrs["_arena"]
    ops[i] = ops[i].replace(attrs={**ops[i].attrs, "_arena": (offs[0], offs[1] + 4)})
    bad = Module(m.name, m.weights, {**m.functions, "decode": Function(fn.name, fn.inputs, ops, fn.outputs,
                                                                       fn.attrs)}, m.attrs)
    with pytest.raises(IRError, match="disagrees with the split rule"):
        build_program(bad)


def _decode(prog):
    return prog.functions["decode"]


def test_verifier_rejects_broken_programs(case):
    name, m, prog = case

    def broken(edit):
        p = parse_program(print_program(prog))
        edit(_decode(p))
        return p

    def out_of_bounds(f):
        i, l = next((i, l) for i, l in enumerate(f.launches) if l.results[0][1].buffer == "arena")
        n, a = l.results[0]
        f.launches[i] = dataclasses.replace(l, results=((n, dataclasses.replace(a, offset=f.buffer("arena").nbytes)),)
                                            + l.results[1:])

    def no_kernel(f):
        f.launches[0] = dataclasses.replace(f.launches[0], kernel=None)

    def not_in_place(f):
        # a compressor's state ring, updated in place (its own launch, or `qkv_rope_compress`'s `c_state_kv_out`)
        i, l = next((i, l) for i, l in enumerate(f.launches) if any(n.endswith("state_kv_out") for n, _ in l.results))
        res = tuple((n, dataclasses.replace(a, buffer="arena", offset=0, root=a.value) if n.endswith("state_kv_out")
                     else a)
                    for n, a in l.results)
        f.launches[i] = dataclasses.replace(l, results=res)

    def misaligned(f):
        i, l = next((i, l) for i, l in enumerate(f.launches) if l.results[0][1].type.dtype == "fp32")
        n, a = l.results[0]
        f.launches[i] = dataclasses.replace(l, results=((n, dataclasses.replace(a, offset=a.offset + 2)),)
                                            + l.results[1:])

    def reordered(f):  # a reader moved before the in-place update it must follow
        i = next(i for i, l in enumerate(f.launches) if l.op.startswith("sparse_attention"))  # (decode: with wo_a/wo_b)
        f.launches.insert(0, f.launches.pop(i))

    cases = {out_of_bounds: "outside buffer", no_kernel: "no kernel family", not_in_place: "not in place",
             misaligned: "not aligned", reordered: "read after|read before|overlap|placed"}
    for edit, msg in cases.items():
        with pytest.raises(IRError, match=msg):
            verify_program(broken(edit))


def test_program_parse_errors_name_line_and_column():
    with pytest.raises(IRError, match=r"line 2:23: unknown buffer kind"):
        parse_program("program @x\nfunc @f { buffer %a : nonsense 3 align 256 }")
    with pytest.raises(IRError, match="strides"):
        parse_program("program @x\nfunc @f {\n buffer %arena : arena 64 align 256\n return y = %arena[0] fp32[2,2] (2,) %y\n}")


def test_ir_dump_program_and_targets(tmp_path):
    from bad_input_util import cli_in_process as cli  # the output is the point, not a fresh interpreter's start-up

    out = tmp_path / "p.txt"
    r = cli("ir", "dump", "--stage", "program", "--func", "all", "-o", str(out))
    assert r.returncode == 0, r.stderr
    prog = verify_program(parse_program(out.read_text()))  # the dump parses back and verifies
    assert set(prog.functions) == {"prefill", "decode"}
    assert all(l.kernel for f in prog.functions.values() for l in f.launches)
    r = cli("ir", "passes", "--target", "cpu")
    assert r.returncode == 0 and "pipeline 'cpu'" in r.stdout and "pipeline 'gpu'" not in r.stdout
    assert "lower_to_program" not in r.stdout.split("pipeline 'cpu'")[1]
    r = cli("ir", "passes")
    assert "pipeline 'gpu' (default)" in r.stdout and "lower_to_program" in r.stdout.split("pipeline 'gpu'")[1]
    r = cli("ir", "dump", "--stage", "final", "--target", "vax")
    assert r.returncode == 2 and "unknown --target" in r.stderr and "Traceback" not in r.stderr
