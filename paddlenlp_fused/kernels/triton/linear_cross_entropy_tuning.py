"""Launch tuning of the chunked linear cross-entropy paths (``linear_cross_entropy.py``, lean and
bounded), kept apart from the kernels: buffer sizes, cuBLASLt heuristic indices, Triton tiles.

The lean path's sizes keep its workspace under 0.1 GiB whatever T, D and V are: forward fp32 logits
blocks of ``LEAN_LOGITS_BYTES`` with ``GEMM_WORKSPACE[1]`` of cuBLASLt workspace; 16-bit backward fp32
logits blocks of ``LEAN_NARROW_LOGITS_BYTES`` (the gradient written over them in 16 bits), an fp32 dh
accumulator of at most ``LEAN_DH_ACC_BYTES`` and ``GEMM_WORKSPACE[0]``; fp32 backward as the forward
(dh accumulates in place). The measurements behind the values are in ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

MiB = 2**20

GEMM_WORKSPACE = (4 * MiB, 32 * MiB)  # cuBLASLt workspace: least (bounded, lean backward), most
LEAN_TOKENS = 4096  # token block of the lean path at most (fewer blocks: fewer passes over dW)
LEAN_LOGITS_BYTES = 64 * MiB
LEAN_NARROW_LOGITS_BYTES = 32 * MiB
LEAN_DH_ACC_BYTES = 64 * MiB

# cuBLASLt heuristic index (0: its first choice) of the (logits, dh, dW) GEMMs of each path
GEMM_HEURISTIC = {"lean": (0, 0, 0), "bounded": (5, 0, 2)}

STATS_TILE = (1, 2048, 4)  # the stats kernel: rows per program, columns per step, warps
GRAD_TILE = (32, 256, 8)  # the gradient kernel (in the logits' dtype): rows, columns, warps
NARROW_GRAD_TILE = (1, 2048, 4)  # ... 16-bit over fp32 logits: rows per program walking the columns
