"""Op sets are loaded explicitly: reading and verifying IR of core ops loads neither the reference model,
nor the model / lowered op sets, nor torch."""

import subprocess
import sys
import textwrap


def test_core_ir_parses_without_the_model_or_torch():
    code = textwrap.dedent('''
        import sys
        import v4compile.ops
        from v4compile.ir.text import parse_module, print_module
        from v4compile.ir.verify import verify
        v4compile.ops.load("core")
        m = verify(parse_module("""module @m
        weight @w : fp32[8,4] from "w"
        func @f(%x : fp32[2,4]) {
          %0 = linear(%x, @w, none) : fp32[2,8]
          %1 = rms_norm(%0, none) {eps = 1e-6} : fp32[2,8]
          return y = %1
        }"""))
        print_module(m)
        bad = [n for n in ("torch", "v4compile.model", "v4compile.ops.paged", "v4compile.ops.mhc") if n in sys.modules]
        print("loaded:", bad)
        assert not bad, bad
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout


def test_an_op_of_an_unloaded_set_is_a_clear_error():
    code = textwrap.dedent('''
        import v4compile.ops
        from v4compile.errors import IRError
        from v4compile.ir.text import parse_module
        v4compile.ops.load("core")
        try:
            parse_module("module @m\\nfunc @f(%x : fp32[2,1,4,8]) {\\n  %0 = hc_post(%x, %x, %x, %x) : fp32[2,1,4,8]\\n  return y = %0\\n}")
        except IRError as e:
            print(e)
            assert "unknown op 'hc_post'" in str(e) and "line 3" in str(e)
        else:
            raise SystemExit("accepted")
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
