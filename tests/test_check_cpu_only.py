"""On a CPU build of Paddle, ``available_backends("gpu")`` and ``python -m paddlenlp_fused.check
--device gpu`` say that no backend runs on GPU tensors here, and why."""

import re
import subprocess
import sys

import paddle
import pytest

from paddlenlp_fused import available_backends, check
from paddlenlp_fused.runtime import backend

pytestmark = pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="a CUDA build of Paddle")


def test_no_gpu_backend_runs_on_cpu_only_paddle():
    statuses = available_backends("gpu")
    assert set(statuses) == set(backend.BACKENDS)
    for name, status in statuses.items():
        assert not status.available, name
        assert "not compiled with CUDA" in status.reason, (name, status.reason)
    assert available_backends("cpu")["reference"].available


def test_check_gpu_report_names_no_runnable_backend():
    out = subprocess.run([sys.executable, "-m", "paddlenlp_fused.check", "--device", "gpu"], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"none runs here: no GPU here: this Paddle is a CPU build", out), out
    for op in check.OP_BACKENDS:
        assert re.search(rf"{re.escape(op)}\s+has .*runs here: none$", out, re.M), (op, out)


def test_check_gpu_report_without_cuda_build_of_a_gpu_machine(monkeypatch):
    """A CUDA build of Paddle that sees no GPU gives its own reason."""
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 0)
    assert "sees no GPU" in available_backends("gpu")["reference"].reason
