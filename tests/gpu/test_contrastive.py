"""Contrastive-loss kernels on the GPU against float64 (computed on the very operands the kernels
read): forward statistics (both directions) and the chunked backward (both terms, a partial last
chunk, masked D, label offsets of a ring block), every output poisoned first; fp32 inputs rounded
to bf16 inside the kernels (the benchmark's path), unstaged and staged (chunks of b, or of a and b,
rounded into bf16 buffers), at D = 512 and at a masked D; bf16; tf32; fp16 with small upstream
weights; and the memory of one fwd+bwd, flat in the batch."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton.contrastive import (FWD_STAGE_ROWS, contrastive_grad_accumulate,
                                                       contrastive_lse_fwd, grad_workspace_shape, operand_dtype,
                                                       stage_shape)
from paddlenlp_fused.testing.numerics import assert_close

# (M, N, D, input dtype, precision, symmetric, a_offset, b_offset, upstream weight)
CASES = [
    # two 4096-chunks each way (the second partial), D = 200 masked, both terms, ring-block offsets
    (4500, 4300, 200, "bfloat16", "tf32", True, 4500, 0, 1 / 4500),
    (4500, 4300, 200, "float32", "bf16", True, 0, 4300, 1 / 4500),
    (4500, 4300, 200, "float32", "bf16-ab", True, 0, 4300, 1 / 4500),
    (4500, 4300, 200, "float32", "bf16-b", True, 4500, 0, 1 / 4500),
    # the benchmark's path and tiles (every dimension a multiple of the tile)
    (1024, 1024, 512, "float32", "bf16", False, 0, 0, 1 / 1024),
    (1024, 1024, 512, "float32", "bf16-ab", False, 0, 0, 1 / 1024),
    (1024, 1024, 512, "bfloat16", "tf32", False, 0, 0, 1 / 1024),
    (37, 45, 33, "float32", "tf32", True, 100, 200, 0.5),
    # weights of 1e-6: G near 1e-8 would flush to zero in fp16 without the workspace's scaling
    (300, 300, 512, "float16", "tf32", True, 0, 0, 1e-6),
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


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-{c[4]}{'-sym' if c[5] else ''}"
                                             for c in CASES])
def test_fwd_bwd_match_float64(provider, case):
    M, N, D, dtype, precision, symmetric, a_off, b_off, weight = case
    precision, _, staged = precision.partition("-")  # staged: a's / b's chunks rounded into bf16 buffers
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
    tf32 = precision == "tf32" and dtype == "float32"  # tf32 rounds S by about scale * 2^-11
    scale = 1.0 if tf32 else 20.0
    a = provider.randn((M, D), dtype, scale=1 / np.sqrt(D))
    b = provider.randn((N, D), dtype, scale=1 / np.sqrt(D))
    a64, b64 = provider.to_numpy(a), provider.to_numpy(b)
    if precision == "bf16":  # the operands the tensor cores see: a and b rounded to bf16
        a64 = provider.to_numpy(provider.from_numpy(a64, "bfloat16"))
        b64 = provider.to_numpy(provider.from_numpy(b64, "bfloat16"))
    g_dtype = operand_dtype(dtype, precision)
    labels_a = rng.integers(b_off, b_off + N, M)
    labels_b = rng.integers(a_off, a_off + M, N)
    w_a, w_b = weight * rng.uniform(0.5, 1.0, M), weight * rng.uniform(0.5, 1.0, N)
    ref = _reference(a64, b64, labels_a, labels_b, w_a, w_b, scale, symmetric, a_off, b_off)

    buf_a = provider.poisoned(stage_shape(M, D, 4096), "bfloat16")  # 4500 rows: a full and a partial chunk
    buf_b = provider.poisoned(stage_shape(N, D, 4096), "bfloat16")
    stages = lambda x_buf, y_buf: {**({"stage_a": x_buf} if "a" in staged else {}),
                                   **({"stage": y_buf} if "b" in staged else {})}
    lse, pos = provider.poisoned((M,)), provider.poisoned((M,))
    contrastive_lse_fwd(a, b, provider.from_numpy(labels_a, "int64"), lse, pos, scale, b_offset=b_off,
                        precision=precision, **stages(buf_a, buf_b))
    lse_b, pos_b = provider.poisoned((N,)), provider.poisoned((N,))
    contrastive_lse_fwd(b, a, provider.from_numpy(labels_b, "int64"), lse_b, pos_b, scale, b_offset=a_off,
                        precision=precision, **stages(buf_b, buf_a))
    work = provider.poisoned(grad_workspace_shape(M, N, 4096), g_dtype)  # 4500 rows: a full and a partial chunk
    ua, ub = provider.poisoned((M, D)), provider.poisoned((N, D))
    w_max = provider.from_numpy(np.array([max(w_a.max(), w_b.max())]))
    contrastive_grad_accumulate(a, b, lse, lse_b, provider.from_numpy(w_a), provider.from_numpy(w_b),
                                provider.from_numpy(labels_a, "int64"), provider.from_numpy(labels_b, "int64"),
                                w_max, work, ua, ub, scale, a_offset=a_off, b_offset=b_off, row_term=True,
                                col_term=symmetric, precision=precision, **stages(buf_a, buf_b))
    provider.synchronize()
    # lse/pos are fp32 sums of products exact in fp32 (16-bit operands): float32's bound; the
    # gradients pass through G stored in the operand dtype: that dtype's bound
    assert_close("lse", provider.to_numpy(lse), ref[0], "float32", tf32=tf32)
    assert_close("pos", provider.to_numpy(pos), ref[1], "float32", tf32=tf32)
    assert_close("lse_b", provider.to_numpy(lse_b), ref[2], "float32", tf32=tf32)
    assert_close("ua", provider.to_numpy(ua), ref[3], g_dtype, tf32=tf32)
    assert_close("ub", provider.to_numpy(ub), ref[4], g_dtype, tf32=tf32)


@pytest.mark.parametrize("dtype,precision,staged", [("float32", "bf16", False), ("float32", "bf16", True),
                                                    ("bfloat16", "tf32", False)])
def test_memory_flat_in_the_batch(provider, dtype, precision, staged):
    """One fwd+bwd through the launchers as the op runs them (symmetric) at 8192 and 32768 rows: beyond
    q, k and the fp32 gradient accumulators, the peak is the G chunk plus per-row vectors (no copy of q,
    k or q.T), the same at both sizes."""
    D, chunk = 512, 8192
    extra = {}
    for B in (8192, 32768):
        q = provider.randn((B, D), dtype, scale=1 / np.sqrt(D))
        k = provider.randn((B, D), dtype, scale=1 / np.sqrt(D))
        provider.synchronize()
        before = provider.memory_allocated()
        provider.reset_peak_memory()
        labels = provider.from_numpy(np.arange(B), "int64")
        lse, pos, lse_c, pos_c = (provider.empty((B,)) for _ in range(4))
        # both inputs staged, the forward's and the backward's buffers as the op sizes them
        fwd_st = {name: provider.empty(stage_shape(B, D, rows), "bfloat16")
                  for name, rows in zip(("stage_a", "stage"), FWD_STAGE_ROWS)} if staged else {}
        contrastive_lse_fwd(q, k, labels, lse, pos, 20.0, precision=precision, **fwd_st)
        contrastive_lse_fwd(k, q, labels, lse_c, pos_c, 20.0, precision=precision, **fwd_st)
        del fwd_st
        stages = {name: provider.empty(stage_shape(B, D, chunk), "bfloat16")
                  for name in ("stage_a", "stage")} if staged else {}
        w = provider.from_numpy(np.full(B, 0.5 / B))
        work = provider.empty(grad_workspace_shape(B, B, chunk), operand_dtype(dtype, precision))
        ua, ub = provider.empty((B, D)), provider.empty((B, D))
        contrastive_grad_accumulate(q, k, lse, lse_c, w, w, labels, labels, w[:1], work, ua, ub, 20.0,
                                    row_term=True, col_term=True, precision=precision, **stages)
        provider.synchronize()
        extra[B] = provider.peak_memory() - before - 2 * B * D * 4  # less the two fp32 accumulators
        assert np.isfinite(provider.to_numpy(ua)).all() and np.isfinite(provider.to_numpy(ub)).all()
        del q, k, ua, ub, work, stages
    # the backward's G chunk and stages (the forward's stages, 48 MiB, are freed before it)
    scratch = chunk * chunk * 2 + 2 * chunk * D * 2
    for B, got in extra.items():
        assert got <= scratch + 64 * B + 2**20, f"{B} rows: {got / 2**20:.1f} MiB beyond inputs and gradients"
