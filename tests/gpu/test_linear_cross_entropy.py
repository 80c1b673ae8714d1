"""LinearCrossEntropy kernels on the GPU against float64: per-token stats and loss, dh, dW, dbias,
both weight layouts, a vocabulary shard (vocab_start), odd shapes, fp32/fp16/bf16, poisoned outputs
and workspaces, the gradient filter, and a weight with more than 2^31 elements; the cuBLASLt GEMM
entry point and the chunked paths built on it (lean and bounded), the label-range flag."""

import functools

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton import linear_cross_entropy as K
from paddlenlp_fused.testing.numerics import assert_close, rel_err

# (dtype, T, D, V, transpose_y, options)
CASES = [
    ("bfloat16", 1000, 512, 32000, True, False),
    ("bfloat16", 333, 200, 5003, False, True),
    ("float16", 77, 136, 3001, True, True),
    ("float32", 50, 72, 999, False, False),
]
VOCAB_START, VOCAB_TOTAL = 1000, 50000  # the weight holds ids [1000, 1000 + V) of 50000


def _reference(h, w_vd, b, labels, coef_p, coef_y, scale, softcap, eps, z):
    """float64 stats (lse, target logit, logit sum), per-token loss and gradients (dh, dW [V, D], db)."""
    a = h @ w_vd.T + (b if b is not None else 0.0)
    s = softcap * np.tanh(a / softcap) if softcap else a
    peak = s.max(axis=1, keepdims=True)
    lse = np.log(np.exp(s - peak).sum(axis=1)) + peak[:, 0]
    local = labels - VOCAB_START
    held = (local >= 0) & (local < w_vd.shape[0])
    tgt = np.where(held, s[np.arange(len(labels)), np.clip(local, 0, w_vd.shape[0] - 1)], 0.0)
    total = s.sum(axis=1) if eps else np.zeros_like(lse)  # the kernel sums the logits only when smoothing
    loss = lse - (1 - eps) * tgt - eps / VOCAB_TOTAL * total + z * lse * lse
    onehot = np.zeros_like(s)
    onehot[np.arange(len(labels))[held], local[held]] = 1.0
    g = coef_p[:, None] * np.exp(s - lse[:, None]) - coef_y[:, None] * ((1 - eps) * onehot + eps / VOCAB_TOTAL)
    if softcap:
        g = g * (1 - (s / softcap) ** 2)
    g = g * scale
    return np.stack([lse, tgt, total]), loss, g @ w_vd, g.T @ h, g.sum(axis=0)


def _run(provider, dtype, n_tok, D, V, transpose_y, options, filter_eps=None, scale_logits=3.0,
         deterministic=False, chunk=1024):
    """Forward and backward on fresh inputs, vocabulary chunks of ``chunk`` rows (the returned tile flags
    are the last chunk's); ``deterministic``: the backward twice through the bias gradient's partials
    workspace (got["db_runs"]: both runs' db)."""
    torch = provider.torch
    h = provider.randn((n_tok, D), dtype)
    w = provider.randn((V, D) if transpose_y else (D, V), dtype, scale=scale_logits / np.sqrt(D))
    b = provider.randn((V,), dtype) if options else None
    labels_np = np.random.randint(0, VOCAB_TOTAL, n_tok)
    # half held here (ids inside the global vocabulary: the flag catches any other)
    labels_np[: n_tok // 2] = np.random.randint(VOCAB_START, min(VOCAB_START + V, VOCAB_TOTAL), n_tok // 2)
    labels_np[np.random.random_sample(n_tok) < 0.1] = -100
    labels = torch.from_numpy(labels_np).to(provider.device)
    softcap, eps, z = (15.0, 0.1, 1e-3) if options else (None, 0.0, 0.0)

    n_split = K.forward_splits(n_tok, V, dtype)
    partials, stats = provider.poisoned((4, n_split, n_tok)), provider.poisoned((3, n_tok))
    loss = provider.poisoned((n_tok,))
    K.lse_forward(h, w, labels, b, partials, stats, transpose_y=transpose_y, vocab_start=VOCAB_START,
                  softcap=softcap, need_sum=eps > 0)
    flag = provider.from_numpy(np.array([-100]), "int64")
    K.token_loss(stats, labels, loss, flag, vocab_total=VOCAB_TOTAL, label_smoothing=eps, z_loss=z)
    assert int(provider.to_numpy(flag)[0]) == -100

    coef_np = np.random.uniform(-1, 1, (2, n_tok))
    coef = provider.from_numpy(coef_np, "float32")
    scale = provider.from_numpy(np.array([0.37]), "float32")
    ws = K.backward_workspace(n_tok, D, V, dtype, chunk=chunk)
    lse = stats[0].contiguous()
    db_runs = []
    for _ in range(2 if deterministic else 1):
        dh, dw = provider.poisoned((n_tok, D), dtype), provider.poisoned(tuple(w.shape), dtype)
        db = provider.poisoned((V,), dtype) if options else None
        g_work = provider.poisoned(ws.g, dtype)
        lo = provider.poisoned(ws.lo, dtype) if ws.lo else None
        flags = provider.zeros(ws.flags, "int8")
        dbias_acc = provider.zeros(ws.dbias) if options else None
        parts = provider.poisoned(ws.dbias_parts) if deterministic else None
        K.lce_backward(h, w, labels, b, lse, coef[0].contiguous(), coef[1].contiguous(), scale, dh, dw, db,
                       g_work, lo, flags, dbias_acc, transpose_y=transpose_y, vocab_start=VOCAB_START,
                       vocab_total=VOCAB_TOTAL, softcap=softcap, label_smoothing=eps, filter_eps=filter_eps,
                       dbias_parts=parts)
        provider.synchronize()
        db_runs.append(provider.to_numpy(db) if options else None)

    h64, w64 = provider.to_numpy(h), provider.to_numpy(w)
    w_vd = w64 if transpose_y else w64.T
    b64 = provider.to_numpy(b) if options else None
    ref = _reference(h64, w_vd, b64, labels_np, coef_np[0], coef_np[1], 0.37, softcap, eps, z)
    valid = labels_np != -100
    ref_loss = np.where(valid, ref[1], 0.0)
    got = dict(stats=provider.to_numpy(stats), loss=provider.to_numpy(loss), dh=provider.to_numpy(dh),
               dw=provider.to_numpy(dw) if transpose_y else provider.to_numpy(dw).T,
               db=provider.to_numpy(db) if options else None, db_runs=db_runs)
    return got, dict(stats=ref[0], loss=ref_loss, dh=ref[2], dw=ref[3], db=ref[4]), flags


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-D{c[2]}-V{c[3]}-{'VD' if c[4] else 'DV'}"
                                                      f"{'-options' if c[5] else ''}")
def test_forward_and_backward_match_float64(provider, case):
    dtype, n_tok, D, V, transpose_y, options = case
    got, want, _ = _run(provider, dtype, n_tok, D, V, transpose_y, options)
    # the stats and loss are fp32 from exact 16-bit inputs with fp32 accumulation
    assert_close("stats", got["stats"], want["stats"], "float32", tf32=dtype != "float32")
    assert_close("loss", got["loss"], want["loss"], "float32", tf32=dtype != "float32")
    for name in ("dh", "dw") + (("db",) if options else ()):
        # G is stored in the input dtype (as the plain composition's logit gradient is), then one GEMM
        assert_close(name, got[name], want[name], dtype, baseline_err=2.0 ** -8 if dtype != "float32" else None)


@pytest.mark.parametrize("case", [("bfloat16", 1000, 256, 5003, False, True), ("float16", 700, 136, 3001, True, True),
                                  ("float32", 333, 72, 999, False, True)], ids=lambda c: f"{c[0]}-T{c[1]}-V{c[3]}")
def test_deterministic_bias_gradient_bit_identical(provider, case):
    """dbias through the per-token-block partials and the fixed-order sum (several token blocks add
    into each element of every 1024-row chunk): within float64's bound, two runs bit-identical."""
    dtype, n_tok, D, V, transpose_y, options = case
    got, want, _ = _run(provider, dtype, n_tok, D, V, transpose_y, options, deterministic=True)
    assert -(-n_tok // K.default_tiles(dtype).grad.block_m) > 1
    for name in ("dh", "dw", "db"):
        assert_close(name, got[name], want[name], dtype, baseline_err=2.0 ** -8 if dtype != "float32" else None)
    assert np.array_equal(*got["db_runs"]), "db: two deterministic runs differ"


def test_gradient_filter(provider):
    """Sharp logits: most G tiles fall below the threshold and are skipped (one vocabulary chunk, so the
    flags cover every tile: about one in five holds a token's argmax or label); the result stays within
    the bf16 bound of the exact gradient, and a threshold above every |G| zeroes it."""
    got, want, flags = _run(provider, "bfloat16", 256, 256, 200000, True, False, filter_eps=2.0**-12,
                            scale_logits=40.0, chunk=200000)
    kept = float(provider.to_numpy(flags).mean())
    assert kept < 0.5, f"filter kept {kept:.0%} of the tiles on sharp logits"
    for name in ("dh", "dw"):
        assert_close(name, got[name], want[name], "bfloat16", baseline_err=2.0 ** -8)
    got, _, flags = _run(provider, "bfloat16", 300, 128, 3000, False, True, filter_eps=2.0)
    assert not provider.to_numpy(flags).any() and not np.any(got["dh"]) and not np.any(got["dw"])


@pytest.mark.xdist_group("huge")
def test_weight_past_2_31_elements(provider):
    """W [V, D] with V * D > 2^31: 64-bit row offsets in every kernel (rows checked at the end)."""
    torch = provider.torch
    n_tok, D = 64, 4096
    V = 2**31 // D + 700
    h = provider.randn((n_tok, D), "bfloat16")
    w = provider.randn((V, D), "bfloat16", scale=2.0 / np.sqrt(D))
    labels = torch.randint(V - 600, V, (n_tok,), device=provider.device)
    n_split = K.forward_splits(n_tok, V, "bfloat16")
    partials, stats = provider.poisoned((4, n_split, n_tok)), provider.poisoned((3, n_tok))
    K.lse_forward(h, w, labels, None, partials, stats)
    ones = provider.from_numpy(np.ones(n_tok), "float32")
    ws = K.backward_workspace(n_tok, D, V, "bfloat16")
    dh, dw = provider.poisoned((n_tok, D), "bfloat16"), provider.empty((V, D), "bfloat16")
    dw[-1000:].fill_(float("nan"))
    K.lce_backward(h, w, labels, None, stats[0].contiguous(), ones, ones, provider.from_numpy(np.ones(1), "float32"),
                   dh, dw, None, provider.empty(ws.g, "bfloat16"), provider.empty(ws.lo, "bfloat16"),
                   provider.zeros(ws.flags, "int8"), None)
    provider.synchronize()
    logits = h.float() @ w.float().T  # fp32 reference on the GPU (no TF32)
    lse = torch.logsumexp(logits, dim=1)
    tgt = logits.gather(1, labels[:, None])[:, 0]
    assert_close("lse", provider.to_numpy(stats[0]), provider.to_numpy(lse), "float32", tf32=True)
    assert_close("target", provider.to_numpy(stats[1]), provider.to_numpy(tgt), "float32", tf32=True)
    g = torch.softmax(logits, dim=1)
    g[torch.arange(n_tok, device=provider.device), labels] -= 1.0
    tail = g[:, -1000:].T @ h.float()
    err = rel_err(provider.to_numpy(dw[-1000:]), provider.to_numpy(tail))
    assert err < 1e-2, f"dW tail rows: relative error {err:.3e}"
    assert_close("dh", provider.to_numpy(dh), provider.to_numpy(g @ w.float()), "bfloat16", baseline_err=2.0 ** -8)


# ----------------------------------------------------------------------------------------------
# cuBLASLt GEMM and the chunked paths


def _gemm(provider):
    from paddlenlp_fused.kernels.cuda import fused_dense
    from paddlenlp_fused.kernels.cuda import gemm as cuda_gemm

    ok, why = cuda_gemm.available()
    assert ok, why
    return functools.partial(cuda_gemm.gemm, workspace=provider.empty((fused_dense.workspace_bytes(0),), "uint8"))


@pytest.mark.parametrize("dtype,d_dtype", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "float32"),
                                           ("float32", "float32")])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_blocks_alpha_beta(provider, dtype, d_dtype, trans_a, trans_b):
    """D[m,n] = alpha op(A) op(B) + beta D on blocks of larger tensors (offsets, row strides), odd sizes;
    the rest of D untouched."""
    gemm = _gemm(provider)
    m, n, k = 77, 45, 133
    big_a = provider.randn((300, 160), dtype)
    big_b = provider.randn((200, 150), dtype)
    a_rows, a_cols = (k, m) if trans_a else (m, k)
    b_rows, b_cols = (n, k) if trans_b else (k, n)
    a_off, b_off = 3 * 160 + 5, 7 * 150 + 2
    d = provider.randn((m + 4, 64), d_dtype)
    d0 = provider.to_numpy(d)
    a_np = provider.to_numpy(big_a).reshape(-1)[a_off:a_off + a_rows * 160].reshape(a_rows, 160)[:, :a_cols]
    b_np = provider.to_numpy(big_b).reshape(-1)[b_off:b_off + b_rows * 150].reshape(b_rows, 150)[:, :b_cols]
    op_a = a_np.T if trans_a else a_np
    op_b = b_np.T if trans_b else b_np
    gemm(big_a, big_b, d, m=m, n=n, k=k, trans_a=trans_a, trans_b=trans_b, alpha=0.75, beta=0.5, a_offset=a_off,
         b_offset=b_off, d_offset=64 * 2 + 3, lda=160, ldb=150, ldd=64)
    provider.synchronize()
    got = provider.to_numpy(d)
    want = d0.copy()
    want[2:2 + m, 3:3 + n] = 0.75 * op_a @ op_b + 0.5 * d0[2:2 + m, 3:3 + n]
    untouched = np.ones_like(got, dtype=bool)
    untouched[2:2 + m, 3:3 + n] = False
    np.testing.assert_array_equal(got[untouched], d0[untouched])
    assert_close("gemm", got[2:2 + m, 3:3 + n], want[2:2 + m, 3:3 + n], d_dtype if d_dtype == dtype else "float32",
                 baseline_err=2.0 ** -8 if d_dtype == "bfloat16" else None, tf32=dtype != "float32")
    with pytest.raises(ValueError, match="a: a 77 x 133 block"):
        gemm(big_a, big_b, d, m=m, n=n, k=k, a_offset=300 * 160 - 10, lda=160, ldb=150, ldd=64)


def _chunked_setup(provider, dtype, n_tok, D, V, transpose_y, options):
    torch = provider.torch
    h = provider.randn((n_tok, D), dtype)
    w = provider.randn((V, D) if transpose_y else (D, V), dtype, scale=3.0 / np.sqrt(D))
    b = provider.randn((V,), dtype) if options else None
    labels_np = np.random.randint(0, VOCAB_TOTAL, n_tok)
    labels_np[: n_tok // 2] = np.random.randint(VOCAB_START, VOCAB_START + V, n_tok // 2)
    labels_np[np.random.random_sample(n_tok) < 0.1] = -100
    labels = torch.from_numpy(labels_np).to(provider.device)
    return h, w, b, labels, labels_np, ((15.0, 0.1, 1e-3) if options else (None, 0.0, 0.0))


def _reference_of(provider, h, w, b, labels_np, transpose_y, coef_p, coef_y, scale, opts):
    h64, w64 = provider.to_numpy(h), provider.to_numpy(w)
    w_vd = w64 if transpose_y else w64.T
    b64 = provider.to_numpy(b) if b is not None else None
    return _reference(h64, w_vd, b64, labels_np, coef_p, coef_y, scale, *opts)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-D{c[2]}-V{c[3]}-{'VD' if c[4] else 'DV'}"
                                                      f"{'-options' if c[5] else ''}")
def test_lean_path_matches_float64(provider, case):
    """Several token blocks and vocabulary chunks (odd last ones); dW accumulated over the blocks in its dtype."""
    dtype, n_tok, D, V, transpose_y, options = case
    gemm = _gemm(provider)
    h, w, b, labels, labels_np, (softcap, eps, z) = _chunked_setup(provider, dtype, n_tok, D, V, transpose_y, options)
    plan = K.lean_plan(n_tok, V, D, dtype, backward=False, tokens=max(n_tok // 3, 1), vocab=1000)
    state, stats = provider.poisoned((4, n_tok)), provider.poisoned((3, n_tok))
    loss = provider.poisoned((n_tok,))
    flag = provider.from_numpy(np.array([-100]), "int64")
    K.lean_forward(gemm, h, w, labels, b, provider.poisoned(*K.lean_workspace(plan, D)["logits"]), state, stats,
                   plan=plan, transpose_y=transpose_y, vocab_start=VOCAB_START, softcap=softcap, need_sum=eps > 0)
    K.token_loss(stats, labels, loss, flag, vocab_total=VOCAB_TOTAL, label_smoothing=eps, z_loss=z)
    coef_np = np.random.uniform(-1, 1, (2, n_tok))
    coef = provider.from_numpy(coef_np, "float32")
    dh, dw = provider.poisoned((n_tok, D), dtype), provider.poisoned(tuple(w.shape), dtype)
    db = provider.poisoned((V,), dtype) if options else None
    dbias_acc = provider.zeros((V,)) if options else None
    # chunks of 3000 rows: a 16-bit G written over the fp32 logits in two column steps of each program
    bwd = K.lean_plan(n_tok, V, D, dtype, backward=True, tokens=max(n_tok // 4, 1), vocab=3000)
    work = {k: provider.poisoned(*v) for k, v in K.lean_workspace(bwd, D).items()}
    K.lean_backward(gemm, h, w, labels, b, stats[0].contiguous(), coef[0].contiguous(), coef[1].contiguous(), 0.37,
                    dh, dw, db, work["logits"], work.get("dh_acc"), dbias_acc, plan=bwd, transpose_y=transpose_y,
                    vocab_start=VOCAB_START, vocab_total=VOCAB_TOTAL, softcap=softcap, label_smoothing=eps)
    provider.synchronize()
    assert int(provider.to_numpy(flag)[0]) == -100
    ref = _reference_of(provider, h, w, b, labels_np, transpose_y, coef_np[0], coef_np[1], 0.37, (softcap, eps, z))
    valid = labels_np != -100
    assert_close("stats", provider.to_numpy(stats), ref[0], "float32", tf32=dtype != "float32")
    assert_close("loss", provider.to_numpy(loss), np.where(valid, ref[1], 0.0), "float32", tf32=dtype != "float32")
    got_dw = provider.to_numpy(dw) if transpose_y else provider.to_numpy(dw).T
    base = 2.0 ** -8 if dtype != "float32" else None
    assert_close("dh", provider.to_numpy(dh), ref[2], dtype, baseline_err=base)
    assert_close("dw", got_dw, ref[3], dtype, baseline_err=base)
    if options:
        assert_close("db", provider.to_numpy(db), ref[4], dtype, baseline_err=base)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lean_path_deterministic_bias_gradient_bit_identical(provider, dtype):
    """The lean path's dbias through its partials workspace (token blocks of 128 rows: 4 row blocks of
    the gradient kernel add into each element of a chunk): within float64's bound, two runs
    bit-identical."""
    gemm = _gemm(provider)
    n_tok, D, V = 600, 256, 5003
    h, w, b, labels, labels_np, (softcap, eps, z) = _chunked_setup(provider, dtype, n_tok, D, V, True, True)
    plan = K.lean_plan(n_tok, V, D, dtype, backward=True, tokens=128, vocab=1000)
    work = {k: provider.poisoned(*v) for k, v in K.lean_workspace(plan, D).items()}
    fwd = K.lean_plan(n_tok, V, D, dtype, backward=False)
    state, stats = provider.poisoned((4, n_tok)), provider.poisoned((3, n_tok))
    K.lean_forward(gemm, h, w, labels, b, provider.poisoned(*K.lean_workspace(fwd, D)["logits"]), state, stats,
                   plan=fwd, vocab_start=VOCAB_START, softcap=softcap, need_sum=True)
    coef_np = np.random.uniform(-1, 1, (2, n_tok))
    coef = provider.from_numpy(coef_np, "float32")
    runs = []
    for _ in range(2):
        dh, dw, db = (provider.poisoned(s, dtype) for s in ((n_tok, D), (V, D), (V,)))
        parts = provider.poisoned(K.chunk_dbias_parts_shape(plan))
        K.lean_backward(gemm, h, w, labels, b, stats[0].contiguous(), coef[0].contiguous(), coef[1].contiguous(),
                        0.37, dh, dw, db, work["logits"], work.get("dh_acc"), provider.zeros((V,)),
                        plan=plan, vocab_start=VOCAB_START, vocab_total=VOCAB_TOTAL, softcap=softcap,
                        label_smoothing=eps, dbias_parts=parts)
        provider.synchronize()
        runs.append(provider.to_numpy(db))
    ref = _reference_of(provider, h, w, b, labels_np, True, coef_np[0], coef_np[1], 0.37, (softcap, eps, z))
    assert_close("db", runs[0], ref[4], dtype, baseline_err=2.0 ** -8 if dtype != "float32" else None)
    assert np.array_equal(runs[0], runs[1]), "db: two deterministic runs differ"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-D{c[2]}-V{c[3]}-{'VD' if c[4] else 'DV'}"
                                                      f"{'-options' if c[5] else ''}")
@pytest.mark.parametrize("dw_fp32", [False, True], ids=["dw-input-dtype", "dw-fp32-accumulated"])
def test_bounded_path_matches_float64(provider, case, dw_fp32):
    """Gradients in the forward pass over token blocks that fit a bound (3 blocks here); loss and lse from
    the input-dtype logits as the plain composition in that dtype has them; dW in the input dtype or added
    to an existing fp32 buffer."""
    dtype, n_tok, D, V, transpose_y, options = case
    gemm = _gemm(provider)
    h, w, b, labels, labels_np, (softcap, eps, z) = _chunked_setup(provider, dtype, n_tok, D, V, transpose_y, options)
    size = 2 if dtype != "float32" else 4
    plan = K.bounded_plan(n_tok, V, dtype, (n_tok // 3 + 1) * -(-V // 8) * 8 * size + K.tuning.GEMM_WORKSPACE[0])
    assert -(-n_tok // plan.tokens) == 3
    logits, stats = provider.poisoned((plan.tokens, plan.ld), dtype), provider.poisoned((3, plan.tokens))
    loss = provider.poisoned((n_tok,))
    flag = provider.from_numpy(np.array([-100]), "int64")
    dh = provider.poisoned((n_tok, D), dtype)
    prior = provider.randn(tuple(w.shape), "float32", scale=1e-4) if dw_fp32 else None
    dw = prior.clone() if dw_fp32 else provider.poisoned(tuple(w.shape), dtype)
    dbias_acc = provider.zeros((V,)) if options else None
    valid = labels_np != -100
    alpha = 1.0 / max(valid.sum(), 1)
    K.bounded_forward(gemm, h, w, labels, b, logits, stats, loss, flag, dh, dw, dbias_acc, plan=plan, alpha=alpha,
                      accumulate_dw=dw_fp32, transpose_y=transpose_y, vocab_start=VOCAB_START, vocab_total=VOCAB_TOTAL,
                      ignore_index=-100, softcap=softcap, label_smoothing=eps, z_loss=z)
    provider.synchronize()
    assert int(provider.to_numpy(flag)[0]) == -100
    ref0 = _reference_of(provider, h, w, b, labels_np, transpose_y, np.zeros(n_tok), np.zeros(n_tok), 1.0,
                         (softcap, eps, z))
    coef_y = valid.astype(np.float64)
    coef_p = coef_y * (1 + 2 * z * ref0[0][0])
    ref = _reference_of(provider, h, w, b, labels_np, transpose_y, coef_p, coef_y, alpha, (softcap, eps, z))
    # the logits are rounded to the input dtype once (as the plain composition in that dtype rounds them)
    bound = "float32" if dtype == "float32" else dtype
    assert_close("loss", provider.to_numpy(loss), np.where(valid, ref[1], 0.0), bound,
                 baseline_err=2.0 ** -8 if dtype != "float32" else None)
    base = 2.0 ** -8 if dtype != "float32" else None
    assert_close("dh", provider.to_numpy(dh), ref[2], dtype, baseline_err=base)
    got_dw = provider.to_numpy(dw) - (provider.to_numpy(prior) if dw_fp32 else 0.0)
    got_dw = got_dw if transpose_y else got_dw.T
    assert_close("dw", got_dw, ref[3], dtype, baseline_err=base)
    if options:
        assert_close("db", provider.to_numpy(dbias_acc) * alpha, ref[4], dtype, baseline_err=base)


def test_label_out_of_range_sets_the_flag(provider):
    torch = provider.torch
    n_tok, V = 300, 1000
    stats = provider.randn((3, n_tok))
    labels = torch.randint(0, V, (n_tok,), device=provider.device)
    labels[17] = V + 5
    labels[40] = -100
    loss = provider.poisoned((n_tok,))
    flag = provider.from_numpy(np.array([-100]), "int64")
    K.token_loss(stats, labels, loss, flag, vocab_total=V)
    got = provider.to_numpy(loss)
    assert int(provider.to_numpy(flag)[0]) == V + 5
    assert np.isnan(got[17]) and got[40] == 0.0 and np.isfinite(np.delete(got, 17)).all()
