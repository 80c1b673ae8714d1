"""Contrastive-loss kernels on the GPU against float64 (computed on the very operands the kernels
read): forward statistics (both directions) and the chunked backward (both terms, a partial last
chunk, masked D, label offsets of a ring block), every output poisoned first; bf16 at the benchmark's
D = 512; tf32; fp16 with small upstream weights."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton.contrastive import (contrastive_grad_accumulate, contrastive_lse_fwd,
                                                       grad_workspace_shape)
from paddlenlp_fused.testing.numerics import assert_close

# (M, N, D, operand dtype, symmetric, a_offset, b_offset, upstream weight)
CASES = [
    # two 4096-chunks each way (the second partial), D = 200 masked, both terms, ring-block offsets
    (4500, 4300, 200, "bfloat16", True, 4500, 0, 1 / 4500),
    # the benchmark's tiles (every dimension a multiple of the tile)
    (1024, 1024, 512, "bfloat16", False, 0, 0, 1 / 1024),
    (37, 45, 33, "float32", True, 100, 200, 0.5),  # tf32
    # weights of 1e-6: G near 1e-8 would flush to zero in fp16 without the workspace's scaling
    (300, 300, 512, "float16", True, 0, 0, 1e-6),
]


def _reference(a, b, labels_a, labels_b, w_a, w_b, scale, symmetric, a_offset, b_offset):
    scores = scale * a @ b.T
    lse_a = np.logaddexp.reduce(scores, axis=1)
    lse_b = np.logaddexp.reduce(scores, axis=0)
    grad = w_a[:, None] * np.exp(scores - lse_a[:, None])
    grad[np.arange(len(a)), labels_a - b_offset] -= w_a
    if symmetric:
        grad += w_b[None, :] * np.exp(scores - lse_b[None, :])
        grad[labels_b - a_offset, np.arange(len(b))] -= w_b
    return lse_a, scores[np.arange(len(a)), labels_a - b_offset], lse_b, grad @ b, grad.T @ a


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-{c[3]}{'-sym' if c[4] else ''}" for c in CASES])
def test_fwd_bwd_match_float64(provider, case):
    M, N, D, dtype, symmetric, a_off, b_off, weight = case
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
    scale = 20.0 if dtype != "float32" else 1.0  # tf32 rounds S by about scale * 2^-11
    a = provider.randn((M, D), dtype, scale=1 / np.sqrt(D))
    b = provider.randn((N, D), dtype, scale=1 / np.sqrt(D))
    a64, b64 = provider.to_numpy(a), provider.to_numpy(b)
    labels_a = rng.integers(b_off, b_off + N, M)
    labels_b = rng.integers(a_off, a_off + M, N)
    w_a, w_b = weight * rng.uniform(0.5, 1.0, M), weight * rng.uniform(0.5, 1.0, N)
    ref = _reference(a64, b64, labels_a, labels_b, w_a, w_b, scale, symmetric, a_off, b_off)

    lse, pos = provider.poisoned((M,)), provider.poisoned((M,))
    contrastive_lse_fwd(a, b, provider.from_numpy(labels_a, "int64"), lse, pos, scale, b_offset=b_off)
    lse_b, pos_b = provider.poisoned((N,)), provider.poisoned((N,))
    contrastive_lse_fwd(b, a, provider.from_numpy(labels_b, "int64"), lse_b, pos_b, scale, b_offset=a_off)
    work = provider.poisoned(grad_workspace_shape(M, N, 4096), dtype)  # 4500 rows: a full and a partial chunk
    ua, ub = provider.poisoned((M, D)), provider.poisoned((N, D))
    w_max = provider.from_numpy(np.array([max(w_a.max(), w_b.max())]))
    a_t = provider.from_numpy(a64.T, dtype)  # exact: a64 holds a's values
    contrastive_grad_accumulate(a, a_t, b, lse, lse_b, provider.from_numpy(w_a), provider.from_numpy(w_b),
                                provider.from_numpy(labels_a, "int64"), provider.from_numpy(labels_b, "int64"),
                                w_max, work, ua, ub, scale, a_offset=a_off, b_offset=b_off, row_term=True,
                                col_term=symmetric)
    provider.synchronize()
    tf32 = dtype == "float32"  # fp32 operands run on tf32 tensor cores (the launchers' default)
    # lse/pos are fp32 sums of products exact in fp32 (16-bit operands): float32's bound; the
    # gradients pass through G stored in the operand dtype: that dtype's bound
    assert_close("lse", provider.to_numpy(lse), ref[0], "float32", tf32=tf32)
    assert_close("pos", provider.to_numpy(pos), ref[1], "float32", tf32=tf32)
    assert_close("lse_b", provider.to_numpy(lse_b), ref[2], "float32", tf32=tf32)
    assert_close("ua", provider.to_numpy(ua), ref[3], dtype, tf32=tf32)
    assert_close("ub", provider.to_numpy(ub), ref[4], dtype, tf32=tf32)
