"""Timing, memory and roofline helpers shared by the benchmark cases."""

from __future__ import annotations

import pathlib
import time
import traceback

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


def measure_gemm_TFLOPs(provider, n: int = 8192) -> float:
    """Dense bf16 GEMM throughput (n x n times n x n), this run's compute ceiling."""
    a = provider.randn((n, n), "bfloat16")
    b = provider.randn((n, n), "bfloat16")
    ms = bench_ms(lambda: provider.matmul(a, b))
    del a, b
    return TFLOPs(2.0 * n**3, ms)


def measure_ceilings(provider) -> dict:
    """The ceilings every case's floors and achieved rates are read against, measured on this card in
    this run (cards and runs differ: an H100's copy is about 3.0 TB/s, an H200's 4.2)."""
    return {"copy_TBps": round(measure_copy_TBps(provider), 3),
            "bf16_gemm_TFLOPs": round(measure_gemm_TFLOPs(provider), 1)}


def clear_grads(leaves) -> None:
    for t in leaves:
        t.grad = None


def run_once(provider, fn, exclude_bytes=0, leaves=()) -> tuple:
    """(wall milliseconds, peak GiB) of one call of ``fn``. The gradients the previous call left on
    ``leaves`` are freed *before* the baseline is read (a closure that clears them itself would
    otherwise count them in the baseline and free them inside the measured window, reading low by
    their size). The peak is what the call holds above the baseline (inputs, parameters, persistent
    buffers) less ``exclude_bytes`` (the gradients of inputs and parameters it allocates; a callable
    is asked after the call); the return value of ``fn`` (outputs, gradients) is held until the peak
    is read. Not floored: a negative figure means ``exclude_bytes`` names more than the call
    allocates."""
    clear_grads(leaves)
    provider.synchronize()
    before = provider.memory_allocated()
    provider.reset_peak_memory()
    start = time.perf_counter()
    keep = fn()
    provider.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    peak = provider.peak_memory()
    excluded = exclude_bytes() if callable(exclude_bytes) else exclude_bytes
    del keep
    return ms, (peak - before - excluded) / GiB


def peak_GiB(provider, fn, exclude_bytes=0, leaves=()) -> float:
    """Peak device memory of one call of ``fn`` (``run_once``): the one helper every row uses."""
    return run_once(provider, fn, exclude_bytes, leaves)[1]


def gradient_bytes(leaves) -> int:
    """Bytes the leaves' gradients occupy, less any written into their own leaf's memory (Liger's
    SwiGLU returns its inputs overwritten as their gradients)."""
    return sum(t.grad.nbytes for t in leaves if t.grad is not None
               and t.grad.untyped_storage().data_ptr() != t.untyped_storage().data_ptr())


def autograd_row(provider, impl: str, forward, leaves, grad_out, check, warmup_ms: int = 25,
                 rep_ms: int = 200) -> dict:
    """A row for an implementation driven by torch autograd (torch, torch.compile, the peers):
    ``forward()`` computes the output from ``leaves``; fwd is timed under ``no_grad``, fwd+bwd as
    ``forward().backward(grad_out)`` with the leaves' gradients cleared first; ``check(out, grads)``
    returns the error fields from the no-grad output and the leaves' gradients of the first fwd+bwd.
    ``peak_GiB`` excludes the gradients the call leaves on the leaves (``gradient_bytes``). The
    leaves keep the gradients of the last call (the peak's) when it returns."""
    import torch

    def fwd():
        with torch.no_grad():
            return forward()

    def fwdbwd():
        clear_grads(leaves)
        forward().backward(grad_out)

    # compile and autotune (torch.compile, Triton) outside the timing; the output is read before any
    # backward, since a peer may write its gradients into its inputs (Liger's SwiGLU)
    out = fwd()
    fwdbwd()
    errors = check(out, [t.grad for t in leaves])
    del out
    row = {"impl": impl, "fwd_ms": bench_ms(fwd, warmup_ms, rep_ms), "fwdbwd_ms": bench_ms(fwdbwd, warmup_ms, rep_ms),
           "peak_GiB": peak_GiB(provider, fwdbwd, lambda: gradient_bytes(leaves), leaves)}
    row.update(errors)
    return row


def optional_row(rows: list, skipped: dict, impl: str, build) -> None:
    """Append ``build()`` to ``rows``; an optional row (a peer, torch.compile) that cannot import or
    run is recorded in ``skipped`` with the reason instead of failing the run."""
    try:
        rows.append(build())
    except Exception as exc:  # an optional peer never fails a run; the JSON says why it is missing
        first_line = (str(exc).strip().splitlines() or [""])[0]
        where = traceback.extract_tb(exc.__traceback__)[-1]
        skipped[impl] = (f"{type(exc).__name__}: {first_line[:300]} "
                         f"(at {pathlib.Path(where.filename).name}:{where.lineno})")
        print(f"  {impl}: skipped ({skipped[impl]})", flush=True)
        traceback.print_exc(limit=-3)


def TBps(n_bytes: float, ms: float) -> float:
    return n_bytes / (ms * 1e-3) / 1e12


def TFLOPs(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
