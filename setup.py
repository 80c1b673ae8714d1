"""Build script (metadata in pyproject.toml): builds the CUDA kernel library where it can be used.

``csrc/*.cu`` -> ``paddlenlp_fused/_lib/libpaddlenlp_fused_cuda.so`` for the archs in
``PADDLENLP_FUSED_CUDA_ARCHS`` (default ``80;90``). ``PADDLENLP_FUSED_BUILD_CUDA``: unset builds the
library when nvcc is found *and* this machine has an NVIDIA GPU (a ``/dev/nvidia<N>`` device node, or
``nvidia-smi -L`` listing a GPU; Paddle is not imported here), and installs without it otherwise (the
``cuda`` backend then reports itself unavailable); ``1`` requires it (a cluster wheel built on a
machine without a GPU, which must not silently come out pure); ``0`` skips it.
A wheel that carries the library is tagged for the platform (``py3-none-linux_x86_64``): the library is
not a CPython extension, so one wheel serves every Python version.
"""

import glob
import importlib.util
import os
import pathlib
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 ships bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

ROOT = pathlib.Path(__file__).resolve().parent


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_cuda", ROOT / "csrc" / "build_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU, without importing Paddle: the driver's device nodes
    (``/dev/nvidia0``, ...; also inside containers given a GPU), else ``nvidia-smi -L`` listing one."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "GPU " in listing


def cuda_build_decision(mode: str, nvcc_found: bool, has_gpu: bool):
    """(build the CUDA library?, what to print or None) for ``PADDLENLP_FUSED_BUILD_CUDA=mode``
    ('auto' when unset). A missing nvcc under mode '1' and a bad mode raise SystemExit."""
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"PADDLENLP_FUSED_BUILD_CUDA: expected unset, '0' or '1', got {mode!r}")
    if mode == "0":
        return False, None
    if mode == "1":
        if not nvcc_found:
            raise SystemExit("PADDLENLP_FUSED_BUILD_CUDA=1 but nvcc was not found (set NVCC or CUDA_HOME)")
        return True, None
    if not nvcc_found:
        return False, "paddlenlp_fused: nvcc not found, installing without the CUDA kernel library"
    if not has_gpu:
        return False, ("paddlenlp_fused: no NVIDIA GPU on this machine, installing without the CUDA kernel "
                       "library (PADDLENLP_FUSED_BUILD_CUDA=1 builds it anyway)")
    return True, None


def _will_build_cuda() -> bool:
    mode = os.environ.get("PADDLENLP_FUSED_BUILD_CUDA", "auto")
    nvcc_found = mode != "0" and _load_builder().find_nvcc() is not None
    # the GPU probe only matters (and only runs) when nvcc is there and the mode is automatic
    build, message = cuda_build_decision(mode, nvcc_found, mode == "auto" and nvcc_found and gpu_present())
    if message:
        print(message)
    return build


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        if not self.distribution.build_cuda:
            return
        # Editable installs import from the source tree; regular builds package build_lib.
        base = ROOT if getattr(self, "editable_mode", False) else pathlib.Path(self.build_lib)
        _load_builder().build(base / "paddlenlp_fused" / "_lib")


class CudaDistribution(Distribution):
    build_cuda = False  # set before setup() runs

    def has_ext_modules(self):
        # a platform build: the library goes into platlib and the wheel gets a platform tag
        return self.build_cuda


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        tag = super().get_tag()
        return tag if self.root_is_pure else ("py3", "none", tag[2])


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import the decision above
    CudaDistribution.build_cuda = _will_build_cuda()
    setup(distclass=CudaDistribution, cmdclass={"build_py": BuildPyWithCuda, "bdist_wheel": PlatformWheel})
