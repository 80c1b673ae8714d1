"""Build script (metadata in pyproject.toml): builds the CUDA kernel library when nvcc is found.

``csrc/*.cu`` -> ``paddlenlp_fused/_lib/libpaddlenlp_fused_cuda.so`` for the archs in
``PADDLENLP_FUSED_CUDA_ARCHS`` (default ``80;90``). Without nvcc, or with
``PADDLENLP_FUSED_BUILD_CUDA=0``, the package installs without it and the ``cuda`` backend reports
itself unavailable.
"""

import importlib.util
import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_cuda", ROOT / "csrc" / "build_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        if os.environ.get("PADDLENLP_FUSED_BUILD_CUDA", "1") == "0":
            return
        builder = _load_builder()
        if builder.find_nvcc() is None:
            print("paddlenlp_fused: nvcc not found, installing without the CUDA kernel library")
            return
        # Editable installs import from the source tree; regular builds package build_lib.
        base = ROOT if getattr(self, "editable_mode", False) else pathlib.Path(self.build_lib)
        builder.build(base / "paddlenlp_fused" / "_lib")


setup(cmdclass={"build_py": BuildPyWithCuda})
