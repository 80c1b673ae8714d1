"""Compile every Triton kernel of the package for one GPU target, with no GPU.

``python -m paddlenlp_fused.kernels.compile_check --capability 90`` imports each module of
``paddlenlp_fused.kernels.triton``, runs its ``compile_cases()`` (launcher calls on ``SpecTensor``s)
under ``runtime.compile_only`` and prints one line per case; it exits non-zero if any case fails
to compile or exceeds the target's limits. One process per target: autotune caches are per kernel.

The time is the work: each distinct specialisation (and autotune config) compiles once per process
(Triton's kernel cache), and nothing bounds the whole run's wall time, which a busy machine stretches.
A hang still fails: a case that runs past ``--case-limit`` seconds (default ``CASE_LIMIT_S``, 7 times the
slowest case seen, 80 s on a 2-core machine loaded 6 to 12 times over) prints every thread's traceback
and exits with status 1. A case's "kernel(s)" are those it loaded: compiled, or read back from Triton's
on-disk cache.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import pkgutil
import resource
import sys
import time
import traceback

from ..runtime.compile_only import CAPABILITIES, compile_only
from . import triton as triton_kernels

CASE_LIMIT_S = 600


def kernel_modules():
    for info in sorted(pkgutil.iter_modules(triton_kernels.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
        if hasattr(module, "compile_cases"):
            yield module


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of the ptxas runs it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def check(capability: int, only: str | None = None, case_limit: float = CASE_LIMIT_S) -> int:
    failures, total, began = 0, 0, time.time()
    with compile_only(capability) as compiled:
        for module in kernel_modules():
            if only and only not in module.__name__:
                continue
            for name, launch in module.compile_cases():
                total += 1
                start, before = time.time(), len(compiled)
                # a hung compile (ptxas, an MLIR pass) fails here, with where it hung
                faulthandler.dump_traceback_later(case_limit, exit=True)
                try:
                    launch()
                    loaded = len(compiled) - before
                    print(f"ok   sm_{capability} {name}: {loaded} kernel(s) in {time.time() - start:.1f} s")
                except Exception:
                    failures += 1
                    print(f"FAIL sm_{capability} {name}\n{traceback.format_exc()}")
                finally:
                    faulthandler.cancel_dump_traceback_later()
                sys.stdout.flush()
    print(f"sm_{capability}: {total - failures} passed, {failures} failed in {time.time() - began:.0f} s "
          f"({_cpu_seconds():.0f} s of CPU)")
    return 1 if failures or not total else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, required=True, choices=CAPABILITIES)
    parser.add_argument("--only", help="substring of the kernel module names to check")
    parser.add_argument("--case-limit", type=float, default=CASE_LIMIT_S,
                        help=f"seconds one case may take before the check fails as hung (default {CASE_LIMIT_S})")
    args = parser.parse_args(argv)
    if args.case_limit <= 0:
        parser.error(f"--case-limit: expected a positive number of seconds, got {args.case_limit}")
    return check(args.capability, args.only, args.case_limit)


if __name__ == "__main__":
    sys.exit(main())
