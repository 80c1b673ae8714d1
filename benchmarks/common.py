"""Timing, memory and roofline helpers shared by the benchmark cases."""

from __future__ import annotations

# Ceilings measured on the H200 on 2026-11-30 (../shared/PERFORMANCE.md); each run also measures the
# copy bandwidth itself and reports both.
CEILING = {"copy_TBps": 4.25, "bf16_gemm_TFLOPs": 787}
GiB = 2**30


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` (CUDA events, L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure_copy_TBps(provider, n_bytes: int = 4 * GiB) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), this run's ceiling."""
    src = provider.randn((n_bytes // 2,), "bfloat16")
    dst = provider.empty((n_bytes // 2,), "bfloat16")
    ms = bench_ms(lambda: provider.copy_(dst, src))
    del src, dst
    return 2 * n_bytes / (ms * 1e-3) / 1e12


def peak_GiB(provider, fn, exclude_bytes: int = 0) -> float:
    """Peak device memory of one call of ``fn`` above what was allocated before it, less
    ``exclude_bytes`` (gradients of the inputs the call allocates)."""
    provider.synchronize()
    before = provider.memory_allocated()
    provider.reset_peak_memory()
    keep = fn()
    peak = provider.peak_memory()
    del keep
    return max(0.0, (peak - before - exclude_bytes) / GiB)


def TBps(n_bytes: float, ms: float) -> float:
    return n_bytes / (ms * 1e-3) / 1e12


def TFLOPs(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12

