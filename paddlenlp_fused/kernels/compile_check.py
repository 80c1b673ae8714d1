"""Compile every Triton kernel of the package for one GPU target, with no GPU.

``python -m paddlenlp_fused.kernels.compile_check --capability 90`` imports each module of
``paddlenlp_fused.kernels.triton``, runs its ``compile_cases()`` (launcher calls on ``SpecTensor``s)
under ``runtime.compile_only`` and prints one line per case; it exits non-zero if any case fails
to compile or exceeds the target's limits. One process per target: autotune caches are per kernel.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
import traceback

from ..runtime.compile_only import CAPABILITIES, compile_only
from . import triton as triton_kernels


def kernel_modules():
    for info in sorted(pkgutil.iter_modules(triton_kernels.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
        if hasattr(module, "compile_cases"):
            yield module


def check(capability: int, only: str | None = None) -> int:
    failures, total = 0, 0
    with compile_only(capability) as compiled:
        for module in kernel_modules():
            if only and only not in module.__name__:
                continue
            for name, launch in module.compile_cases():
                total += 1
                start, before = time.time(), len(compiled)
                try:
                    launch()
                    kernels = len(compiled) - before
                    print(f"ok   sm_{capability} {name}: {kernels} kernel(s) in {time.time() - start:.1f} s")
                except Exception:
                    failures += 1
                    print(f"FAIL sm_{capability} {name}\n{traceback.format_exc()}")
    print(f"sm_{capability}: {total - failures} passed, {failures} failed")
    return 1 if failures or not total else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, required=True, choices=CAPABILITIES)
    parser.add_argument("--only", help="substring of the kernel module names to check")
    args = parser.parse_args(argv)
    return check(args.capability, args.only)


if __name__ == "__main__":
    sys.exit(main())
