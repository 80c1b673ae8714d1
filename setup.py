"""Build script (metadata in pyproject.toml): builds the CUDA kernel library when nvcc is found.

``csrc/*.cu`` -> ``paddlenlp_fused/_lib/libpaddlenlp_fused_cuda.so`` for the archs in
``PADDLENLP_FUSED_CUDA_ARCHS`` (default ``80;90``). ``PADDLENLP_FUSED_BUILD_CUDA``: unset builds the
library when nvcc is found and installs without it otherwise (the ``cuda`` backend then reports itself
unavailable); ``1`` requires it (a cluster wheel must not silently come out pure); ``0`` skips it.
A wheel that carries the library is tagged for the platform (``py3-none-linux_x86_64``): the library is
not a CPython extension, so one wheel serves every Python version.
"""

import importlib.util
import os
import pathlib

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 ships bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

ROOT = pathlib.Path(__file__).resolve().parent
MODE = os.environ.get("PADDLENLP_FUSED_BUILD_CUDA", "auto")


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_cuda", ROOT / "csrc" / "build_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _will_build_cuda() -> bool:
    if MODE not in ("auto", "0", "1"):
        raise SystemExit(f"PADDLENLP_FUSED_BUILD_CUDA: expected unset, '0' or '1', got {MODE!r}")
    if MODE == "0":
        return False
    found = _load_builder().find_nvcc() is not None
    if MODE == "1" and not found:
        raise SystemExit("PADDLENLP_FUSED_BUILD_CUDA=1 but nvcc was not found (set NVCC or CUDA_HOME)")
    if not found:
        print("paddlenlp_fused: nvcc not found, installing without the CUDA kernel library")
    return found


BUILD_CUDA = _will_build_cuda()


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        if not BUILD_CUDA:
            return
        # Editable installs import from the source tree; regular builds package build_lib.
        base = ROOT if getattr(self, "editable_mode", False) else pathlib.Path(self.build_lib)
        _load_builder().build(base / "paddlenlp_fused" / "_lib")


class CudaDistribution(Distribution):
    def has_ext_modules(self):
        # a platform build: the library goes into platlib and the wheel gets a platform tag
        return BUILD_CUDA


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        tag = super().get_tag()
        return tag if self.root_is_pure else ("py3", "none", tag[2])


setup(distclass=CudaDistribution, cmdclass={"build_py": BuildPyWithCuda, "bdist_wheel": PlatformWheel})
