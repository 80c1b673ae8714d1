"""Build ``csrc/*.cu`` into one shared library, ``libpaddlenlp_fused_cuda.so``.

Used by setup.py (when nvcc is found) and runnable by hand:

    python csrc/build_cuda.py --out paddlenlp_fused/_lib [--archs 80;90] [--jobs 2]

Architectures come from ``PADDLENLP_FUSED_CUDA_ARCHS`` (default ``80;90``): SASS for each, plus PTX
of the newest so later GPUs can JIT it. cudart is linked statically; cuBLASLt is loaded at run time
by the kernels that use it, so the library loads (and reports its ABI) on machines without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys

CSRC = pathlib.Path(__file__).resolve().parent
LIB_NAME = "libpaddlenlp_fused_cuda.so"
DEFAULT_ARCHS = "80;90"


def find_nvcc() -> str | None:
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def arch_flags(archs: str) -> list[str]:
    values = sorted({int(a) for a in archs.replace(",", ";").split(";") if a.strip()})
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in values]
    flags.append(f"-gencode=arch=compute_{values[-1]},code=compute_{values[-1]}")
    return flags


def build(out_dir: pathlib.Path, archs: str | None = None, jobs: int | None = None, nvcc: str | None = None,
          verbose: bool = True) -> pathlib.Path:
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set NVCC or CUDA_HOME)")
    archs = archs or os.environ.get("PADDLENLP_FUSED_CUDA_ARCHS", DEFAULT_ARCHS)
    sources = sorted(CSRC.glob("*.cu"))
    obj_dir = out_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    common = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "--expt-relaxed-constexpr",
              "-lineinfo", *arch_flags(archs), f"-I{CSRC}"]

    def compile_one(src: pathlib.Path) -> pathlib.Path:
        obj = obj_dir / (src.stem + ".o")
        cmd = common + ["-c", str(src), "-o", str(obj)]
        if verbose:
            print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return obj

    jobs = jobs or max(1, min(len(sources), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        objects = list(pool.map(compile_one, sources))
    lib = out_dir / LIB_NAME
    link = [nvcc, "-shared", *arch_flags(archs), "-cudart=static", "-o", str(lib), *map(str, objects), "-ldl"]
    if verbose:
        print(" ".join(link), flush=True)
    subprocess.run(link, check=True)
    shutil.rmtree(obj_dir)
    return lib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--archs", default=None, help="e.g. '80;90' (default $PADDLENLP_FUSED_CUDA_ARCHS or 80;90)")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    print(build(args.out, args.archs, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
