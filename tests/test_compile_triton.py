"""Every Triton kernel compiles for sm_90 and sm_80 with no GPU (one process per target)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("capability", [90, 80])
def test_all_triton_kernels_compile(capability):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "paddlenlp_fused.kernels.compile_check", "--capability",
                           str(capability)], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert f"sm_{capability}: " in proc.stdout and " 0 failed" in proc.stdout
