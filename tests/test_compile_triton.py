"""Every Triton kernel compiles for sm_90 and sm_80 with no GPU: one process per target, both at once
(the CI machine's two cores), each bounded per case rather than as a whole (a busy machine stretches
the whole run; a hung case fails by itself)."""

import os
import subprocess
import sys

from paddlenlp_fused.runtime.compile_only import CAPABILITIES

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_all_triton_kernels_compile():
    procs = {capability: subprocess.Popen([sys.executable, "-m", "paddlenlp_fused.kernels.compile_check",
                                           "--capability", str(capability)], env=ENV, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
             for capability in CAPABILITIES}
    for capability, proc in procs.items():
        out, err = proc.communicate()
        assert proc.returncode == 0, f"sm_{capability}:\n{out[-8000:]}{err[-4000:]}"
        assert f"sm_{capability}: " in out and " 0 failed" in out


HANGING_CASE = """
import sys, threading, types
from paddlenlp_fused.kernels import compile_check
hung = types.SimpleNamespace(__name__="hung", compile_cases=lambda: [("hung[case]", threading.Event().wait)])
compile_check.kernel_modules = lambda: [hung]
sys.exit(compile_check.check(90, case_limit=1))
"""


def test_a_hung_case_fails_the_check():
    # the timeout only guards this test, should the case bound not fire
    proc = subprocess.run([sys.executable, "-c", HANGING_CASE], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Timeout (0:00:01)!" in proc.stderr and "compile_check.py" in proc.stderr, proc.stderr
