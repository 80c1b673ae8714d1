"""setup.py's decision to compile the CUDA kernel library: a CPU machine with nvcc on PATH installs
without it unless PADDLENLP_FUSED_BUILD_CUDA=1; 0 and 1 keep their meaning."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_script():
    # imported under another name than __main__, so it defines its functions and runs no setup()
    spec = importlib.util.spec_from_file_location("paddlenlp_fused_setup_script", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode, nvcc, gpu, build", [
    ("auto", True, False, False),  # the CPU machine with a CUDA toolkit: no 22 MB library it cannot load
    ("auto", True, True, True),
    ("auto", False, True, False),
    ("auto", False, False, False),
    ("0", True, True, False),
    ("1", True, False, True),  # a cluster wheel built on a machine without a GPU
    ("1", True, True, True),
])
def test_cuda_build_decision(setup_script, mode, nvcc, gpu, build):
    decided, message = setup_script.cuda_build_decision(mode, nvcc_found=nvcc, has_gpu=gpu)
    assert decided is build
    if mode == "auto" and nvcc and not gpu:
        assert "no NVIDIA GPU" in message and "PADDLENLP_FUSED_BUILD_CUDA=1" in message


@pytest.mark.parametrize("mode, nvcc, error", [("1", False, "nvcc was not found"), ("yes", True, "expected unset")])
def test_cuda_build_decision_errors(setup_script, mode, nvcc, error):
    with pytest.raises(SystemExit, match=error):
        setup_script.cuda_build_decision(mode, nvcc_found=nvcc, has_gpu=True)


def test_gpu_probe_reads_device_nodes_then_nvidia_smi(setup_script, monkeypatch):
    monkeypatch.setattr(setup_script.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert setup_script.gpu_present()
    monkeypatch.setattr(setup_script.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(setup_script.shutil, "which", lambda name: None)
    assert not setup_script.gpu_present()
    monkeypatch.setattr(setup_script.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    for listing, found in (("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n", True),
                           ("No devices were found\n", False)):
        monkeypatch.setattr(setup_script.subprocess, "run",
                            lambda *a, listing=listing, **k: type("Done", (), {"stdout": listing})())
        assert setup_script.gpu_present() is found
