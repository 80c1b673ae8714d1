"""Per-shape choices for the cuBLASLt fused dense GEMMs, apart from the kernels.

``benchmarks/cases/mlp.py`` measures every choice below on the GPU and prints, in its JSON
(``"tuning"``), the values that won; the ops read them from here (``ops/fused_dense.py``'s policy
block says what each one decides).

GEMM kinds (``GEMMS``), each [M, N] = op(A) @ op(B) with a reduction of length K:
    fwd, fwd_bias                      x @ W (+ bias)
    fwd_gelu_aux, fwd_bias_gelu_aux    x @ W (+ bias), gelu applied, the pre-activation saved (GELU_AUX)
    dgrad                              dy @ W^T
    wgrad, wgrad_bgrad                 x^T @ dy (BGRADA: + the bias gradient dy.sum(0))
"""

from __future__ import annotations

from typing import Dict, Tuple

GEMMS = ("fwd", "fwd_bias", "fwd_gelu_aux", "fwd_bias_gelu_aux", "dgrad", "wgrad", "wgrad_bgrad")

# Index into cuBLASLt's algorithm list (its heuristic's order) for a GEMM not in HEURISTIC.
DEFAULT_HEURISTIC = 0
# (kind, dtype, M, N, K) -> index: the fastest of indices 0..7 for that GEMM ("tuning.heuristic").
HEURISTIC: Dict[Tuple[str, str, int, int, int], int] = {
    ('dgrad', 'bfloat16', 16384, 4096, 16384): 2,
    ('dgrad', 'bfloat16', 16384, 4096, 28672): 1,
    ('dgrad', 'bfloat16', 16384, 14336, 4096): 7,
    ('dgrad', 'bfloat16', 16384, 16384, 4096): 6,
    ('fwd', 'bfloat16', 16384, 4096, 14336): 1,
    ('fwd', 'bfloat16', 16384, 4096, 16384): 5,
    ('fwd', 'bfloat16', 16384, 16384, 4096): 2,
    ('fwd', 'bfloat16', 16384, 28672, 4096): 6,
    ('fwd_bias', 'bfloat16', 16384, 4096, 16384): 1,
    ('fwd_bias', 'bfloat16', 16384, 16384, 4096): 1,
    ('wgrad', 'bfloat16', 4096, 16384, 16384): 1,
    ('wgrad', 'bfloat16', 4096, 28672, 16384): 3,
    ('wgrad', 'bfloat16', 16384, 4096, 16384): 2,
}

# The MLP's elementwise work on the CUDA backend ("tuning.FWD_GELU_EPILOGUE", "tuning.BGRAD_EPILOGUE"):
# FWD_GELU_EPILOGUE  gelu_approx in GEMM1's GELU_AUX_BIAS epilogue; False: GEMM1 with the bias
#                    epilogue, then the Triton activation pass.
# BGRAD_EPILOGUE     bias gradients from the weight-gradient GEMM's BGRADA epilogue; False: plain
#                    weight-gradient GEMMs, the bias gradients summed by Triton passes (the hidden
#                    bias's inside the activation-backward pass, which reads that tensor anyway).
FWD_GELU_EPILOGUE = False
BGRAD_EPILOGUE = False


def heuristic(kind: str, dtype: str, M: int, N: int, K: int) -> int:
    """The cuBLASLt algorithm index for one GEMM of ``kind`` with output [M, N] and reduction K."""
    if kind not in GEMMS:
        raise ValueError(f"kind: expected one of {list(GEMMS)}, got {kind!r}")
    return HEURISTIC.get((kind, dtype, int(M), int(N), int(K)), DEFAULT_HEURISTIC)
