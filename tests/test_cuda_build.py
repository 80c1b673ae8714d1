"""The CUDA kernel library: built by the install step with nvcc for sm_80 and sm_90, loadable
without a GPU, exporting every entry point that csrc/ declares."""

import os
import pathlib
import re
import subprocess

import pytest

from paddlenlp_fused.kernels.cuda import library

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"


def _setup_builds_cuda() -> bool:
    """Whether setup.py's automatic choice builds the library on this machine (nvcc being found)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("paddlenlp_fused_setup_script", CSRC.parent / "setup.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return os.environ.get("PADDLENLP_FUSED_BUILD_CUDA") == "1" or script.gpu_present()


def _require_built():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_cuda", CSRC / "build_cuda.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    if builder.find_nvcc() is None:
        pytest.skip("nvcc is not installed: the package installs without the CUDA library")
    if not library.library_path().exists() and not _setup_builds_cuda():
        pytest.skip("no GPU here: the install builds the CUDA library only with PADDLENLP_FUSED_BUILD_CUDA=1")
    lib, error = library.load()
    assert lib is not None, error
    return lib


def test_library_loads_with_matching_abi():
    lib = _require_built()
    assert lib.pnf_abi_version() == library.ABI_VERSION


def test_library_holds_sm80_and_sm90_code():
    _require_built()
    import triton

    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    listing = subprocess.run([str(cuobjdump), "--list-elf", str(library.library_path())], capture_output=True,
                             text=True, check=True).stdout
    archs = set(re.findall(r"sm_(\d+)", listing))
    assert {"80", "90"} <= archs, listing


def test_every_declared_entry_point_is_exported():
    lib = _require_built()
    declared = set()
    for src in CSRC.glob("*.cu"):
        declared |= set(re.findall(r"PNF_EXPORT\s+[\w\s\*]+?\b(pnf_\w+)\s*\(", src.read_text()))
    assert "pnf_abi_version" in declared
    for name in sorted(declared):
        assert hasattr(lib, name), f"{name} is declared in csrc/ but not exported"
