"""Contrastive loss: Triton kernels (interpreter) and the reference against float64
``cross_entropy(scale * q @ k.T, labels)`` (and its transpose, symmetric): loss and gradients of q, k
and a learnable scale; launcher-level poisoned outputs and chunking; the 2-process gloo ring against
the single-process global batch; the layer; bad input."""

import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.triton.contrastive import (contrastive_grad_accumulate, contrastive_lse_fwd,
                                                       grad_workspace_shape, stage_shape)
from paddlenlp_fused.layers.contrastive import FlashContrastiveLoss
from paddlenlp_fused.ops.contrastive import cal_flash_loss, flash_contrastive_loss
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.distributed import init_fleet, run_distributed
from paddlenlp_fused.testing.numerics import assert_close, rel_err
from helpers import as_leaf64, randn, to64

# (q rows, k rows, D, symmetric, custom labels): non-power-of-two batch and dim, size 1, D < 16
CASES = [(37, 37, 50, True, True), (21, 33, 19, False, True), (40, 64, 128, False, False), (1, 1, 1, True, False)]
# (input dtype, precision, the dtype whose bound applies): bf16 operands from fp32 inputs are held
# to bf16's bound
PRECISIONS = [("float32", "ieee", "float32"), ("float16", "auto", "float16"), ("bfloat16", "auto", "bfloat16"),
              ("float32", "bf16", "bfloat16")]


def _cross_entropy64(scores, labels):
    """Per-row ``cross_entropy(scores, labels)``, written out: Paddle's ``F.cross_entropy`` clips each
    row's loss at 64 (-log of its epsilon), which large scales reach (see test_equals_paddle_cross_entropy)."""
    target = paddle.to_tensor(labels).reshape([-1, 1])
    return paddle.logsumexp(scores, axis=1) - paddle.take_along_axis(scores, target, axis=1).reshape([-1])


def _reference64(q, k, labels, scale, symmetric, reduction, upstream=None):
    """Float64 loss and gradients (q, k, scale) of the plain composition."""
    q64, k64 = as_leaf64(q), as_leaf64(k)
    s64 = paddle.to_tensor(float(scale), dtype="float64", stop_gradient=False)
    scores = s64 * paddle.matmul(q64, k64, transpose_y=True)
    rows = _cross_entropy64(scores, labels)
    if symmetric:
        rows = 0.5 * (rows + _cross_entropy64(scores.T, labels))
    loss = {"mean": rows.mean(), "sum": rows.sum(), "none": rows}[reduction]
    grads = paddle.grad(loss, [q64, k64, s64], None if upstream is None else paddle.to_tensor(upstream))
    return [loss.numpy()] + [g.numpy() for g in grads]


def _assert_dscale(got, ref, q, k, labels, scale, symmetric, reduction, upstream, bound_dtype):
    """dscale is a single sum of terms of both signs, w_i (P_ij - Y_ij) S_ij / scale (and the column
    terms when symmetric): its float32 error grows with the cancellation, so at float32 the bound is
    DESIGN.md's 1e-5 relative to the summed magnitudes, not to the (possibly much smaller) sum."""
    if bound_dtype != "float32":
        assert_close("dscale", got, ref, bound_dtype)
        return
    rows_q = q.shape[0]
    labels = np.arange(rows_q) if labels is None else np.asarray(labels)
    w = {"mean": np.full(rows_q, 1.0 / rows_q), "sum": np.ones(rows_q), "none": upstream}[reduction]
    S = scale * to64(q) @ to64(k).T
    Y = np.zeros_like(S)
    Y[np.arange(rows_q), labels] = 1.0
    P = np.exp(S - S.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    half = 0.5 if symmetric else 1.0
    magnitude = half * (np.abs(w)[:, None] * (P + Y) * np.abs(S)).sum() / scale
    if symmetric:
        PT = np.exp(S - S.max(0, keepdims=True))
        PT /= PT.sum(0, keepdims=True)
        YT = np.zeros_like(S)
        YT[labels, np.arange(S.shape[1])] = 1.0
        magnitude += half * (np.abs(w)[None, :] * (PT + YT) * np.abs(S)).sum() / scale
    err = float(np.abs(np.asarray(got, np.float64) - ref).max())
    assert err <= 1e-5 * magnitude, f"dscale (float32): error {err:.3e} exceeds 1e-5 x {magnitude:.3e}"


def _run(q, k, labels, scale_value, symmetric, reduction, backend, precision="auto", upstream=None):
    scale = paddle.to_tensor(scale_value, dtype="float32", stop_gradient=False)
    loss = flash_contrastive_loss(q, k, None if labels is None else paddle.to_tensor(labels), scale,
                                  symmetric=symmetric, reduction=reduction, backend=backend, precision=precision)
    assert loss.dtype == paddle.float32
    grads = paddle.grad(loss, [q, k, scale], None if upstream is None else paddle.to_tensor(upstream))
    return [to64(loss)] + [to64(g) for g in grads]


def _inputs(rows_q, rows_k, dim, dtype, custom_labels):
    q = randn((rows_q, dim), dtype, scale=0.5, requires_grad=True)
    k = randn((rows_k, dim), dtype, scale=0.5, requires_grad=True)
    labels = np.random.randint(0, rows_k, rows_q) if custom_labels else None
    return q, k, labels


@pytest.mark.parametrize("dtype,precision,bound_dtype", PRECISIONS, ids=[f"{d}-{p}" for d, p, _ in PRECISIONS])
@pytest.mark.parametrize("case", CASES, ids=[f"{m}x{n}x{d}{'-sym' if s else ''}{'-labels' if l else ''}"
                                             for m, n, d, s, l in CASES])
def test_triton_loss_and_grads_match_float64(case, dtype, precision, bound_dtype):
    rows_q, rows_k, dim, symmetric, custom = case
    q, k, labels = _inputs(rows_q, rows_k, dim, dtype, custom)
    scale = float(np.random.uniform(1.0, 4.0))
    got = _run(q, k, labels, scale, symmetric, "mean", "triton", precision)
    targets = np.arange(rows_q) if labels is None else labels
    ref = _reference64(q, k, targets, scale, symmetric, "mean")
    baselines = [None] * 3
    if dtype != bound_dtype:  # float32 inputs as bf16 operands: the plain composition rounds them too
        rounded = [t.astype(bound_dtype).astype(dtype) for t in (q, k)]
        baselines = [rel_err(b, r) for b, r in zip(_reference64(*rounded, targets, scale, symmetric, "mean"), ref)]
    for name, out, expected, baseline in zip(("loss", "dq", "dk"), got, ref, baselines):
        assert_close(name, out, expected, bound_dtype, baseline_err=baseline)
    _assert_dscale(got[3], ref[3], q, k, labels, scale, symmetric, "mean", None, bound_dtype)


def test_equals_paddle_cross_entropy():
    """Both directions against ``F.cross_entropy`` itself (float64, per-row losses under its clip)."""
    q, k, labels = _inputs(29, 29, 36, "float32", True)
    loss = flash_contrastive_loss(q, k, paddle.to_tensor(labels), 2.0, symmetric=True, backend="triton",
                                  precision="ieee")
    scores = 2.0 * paddle.matmul(as_leaf64(q), as_leaf64(k), transpose_y=True)
    target = paddle.to_tensor(labels).reshape([-1, 1])
    expected = 0.5 * (F.cross_entropy(scores, target) + F.cross_entropy(scores.T, target))
    assert_close("loss vs F.cross_entropy", to64(loss), expected.numpy(), "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_backend_matches_float64(dtype):
    q, k, labels = _inputs(23, 23, 30, dtype, True)
    got = _run(q, k, labels, 2.0, True, "mean", "reference")
    ref = _reference64(q, k, labels, 2.0, True, "mean")
    for name, out, expected in zip(("loss", "dq", "dk", "dscale"), got, ref):
        assert_close(name, out, expected, dtype)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_with_random_upstream(reduction):
    q, k, labels = _inputs(19, 19, 24, "float32", True)
    upstream = np.random.randn(19).astype(np.float32) if reduction == "none" else None
    got = _run(q, k, labels, 1.5, True, reduction, "triton", "ieee", upstream)
    ref = _reference64(q, k, labels, 1.5, True, reduction, upstream)
    for name, out, expected in zip(("loss", "dq", "dk"), got, ref):
        assert_close(name, out, expected, "float32")
    _assert_dscale(got[3], ref[3], q, k, labels, 1.5, True, reduction, upstream, "float32")


def test_cal_flash_loss_is_per_row_cross_entropy():
    q, k, _ = _inputs(17, 29, 40, "float32", False)
    rows = cal_flash_loss(q, k, scale=3.0, backend="triton", precision="ieee")
    scores = 3.0 * to64(q) @ to64(k).T
    expected = np.log(np.exp(scores).sum(1)) - scores[np.arange(17), np.arange(17)]
    assert rows.shape == [17]
    assert_close("cal_flash_loss", to64(rows), expected, "float32")
    default_scale = cal_flash_loss(q, k, backend="triton", precision="ieee")
    scores = to64(q) @ to64(k).T
    assert_close("scale=None is 1", to64(default_scale),
                 np.log(np.exp(scores).sum(1)) - np.diag(scores[:, :17]), "float32")


# (input dtype, launcher precision, the dtype of G and of the gradients' bound)
LAUNCH_CASES = [("float32", "ieee", "float32", ""), ("bfloat16", "tf32", "bfloat16", ""),
                ("float32", "bf16", "bfloat16", ""), ("float32", "bf16", "bfloat16", "b"),
                ("float32", "bf16", "bfloat16", "ab")]


@pytest.mark.parametrize("dtype,precision,g_dtype,staged", LAUNCH_CASES,
                         ids=[f"{d}-{p}{'-staged-' + st if st else ''}" for d, p, _, st in LAUNCH_CASES])
def test_launchers_fill_poisoned_outputs_across_chunks(dtype, precision, g_dtype, staged):
    """A 16-row chunk over 37 x 45 scores: full and partial chunks, the first-write/accumulate switch,
    both terms, labels with an offset (a ring block); every output starts as NaN. "bf16" reads the
    float32 inputs in place and rounds them to bf16 in the kernels (``staged``: b's, and a's, chunks
    through 16-row bf16 buffers; the forward's log-sum-exp folded over three chunks of b, its rows
    written a chunk of a at a time): the reference takes the rounded operands (so lse/pos keep
    float32's bound) and the gradients bf16's (G is bf16)."""
    M, N, D, chunk, a_off, b_off = 37, 45, 33, 16, 100, 200
    a, b = randn((M, D), dtype), randn((N, D), dtype)
    a64, b64 = to64(a), to64(b)
    if precision == "bf16":  # the operands the tensor cores see
        a64, b64 = to64(a.astype("bfloat16")), to64(b.astype("bfloat16"))
    labels_a = np.random.randint(b_off, b_off + N, M)
    labels_b = np.random.randint(a_off, a_off + M, N)
    scale = 1.7
    scores = scale * a64 @ b64.T
    lse_a = np.log(np.exp(scores).sum(1))
    lse_b = np.log(np.exp(scores).sum(0))
    w_a, w_b = np.random.rand(M), np.random.rand(N)

    buffer = lambda rows, on: paddle.full(list(stage_shape(rows, D, chunk)), float("nan"), dtype="bfloat16") \
        if on else None
    stage, stage_a = buffer(N, "b" in staged), buffer(M, "a" in staged)
    lse, pos = paddle.full([M], float("nan")), paddle.full([M], float("nan"))
    *args, stage_arg, stage_a_arg = triton_args(a, b, paddle.to_tensor(labels_a), lse, pos, stage, stage_a)
    contrastive_lse_fwd(*args, scale=scale, b_offset=b_off, precision=precision, stage=stage_arg,
                        stage_a=stage_a_arg)
    assert_close("lse", lse.numpy(), lse_a, "float32")
    assert_close("pos", pos.numpy(), scores[np.arange(M), labels_a - b_off], "float32")

    grad = w_a[:, None] * np.exp(scores - lse_a[:, None]) + w_b[None, :] * np.exp(scores - lse_b[None, :])
    grad[np.arange(M), labels_a - b_off] -= w_a
    grad[labels_b - a_off, np.arange(N)] -= w_b
    work = paddle.full(list(grad_workspace_shape(M, N, chunk)), float("nan"), dtype=g_dtype)
    ua, ub = paddle.full([M, D], float("nan")), paddle.full([N, D], float("nan"))
    f32 = lambda x: paddle.to_tensor(np.asarray(x, np.float32))
    *args, stage_arg, stage_a_arg = triton_args(a, b, f32(lse_a), f32(lse_b), f32(w_a), f32(w_b),
                                                paddle.to_tensor(labels_a), paddle.to_tensor(labels_b),
                                                f32([max(w_a.max(), w_b.max())]), work, ua, ub, stage, stage_a)
    contrastive_grad_accumulate(*args, scale=scale, a_offset=a_off, b_offset=b_off, row_term=True, col_term=True,
                                precision=precision, stage=stage_arg, stage_a=stage_a_arg)
    assert_close("ua", ua.numpy(), grad @ b64, g_dtype)
    assert_close("ub", ub.numpy(), grad.T @ a64, g_dtype)


def test_fp16_gradient_of_tiny_weights_is_not_flushed():
    """Upstream weights of 1e-6 make G about 1e-8, under fp16's smallest subnormal (6e-8); the
    workspace holds G scaled by 2^14 / max|w|, so the gradient survives."""
    M, D = 48, 32
    a, b = randn((M, D), "float16"), randn((M, D), "float16")
    a64, b64 = to64(a), to64(b)
    scores = a64 @ b64.T
    lse_a = np.log(np.exp(scores).sum(1))
    w = np.full(M, 1e-6)
    grad = w[:, None] * np.exp(scores - lse_a[:, None])
    grad[np.arange(M), np.arange(M)] -= w
    work = paddle.full(list(grad_workspace_shape(M, M)), float("nan"), dtype="float16")
    ua, ub = paddle.full([M, D], float("nan")), paddle.full([M, D], float("nan"))
    f32 = lambda x: paddle.to_tensor(np.asarray(x, np.float32))
    labels = paddle.arange(M, dtype="int64")
    contrastive_grad_accumulate(*triton_args(a, b, f32(lse_a), f32(lse_a), f32(w), f32(w),
                                             labels, labels, f32([1e-6]), work, ua, ub), scale=1.0)
    assert_close("ua", ua.numpy(), grad @ b64, "float16")
    assert_close("ub", ub.numpy(), grad.T @ a64, "float16")


def test_layer_learnable_scale_and_clamp():
    q, k, labels = _inputs(26, 26, 20, "float32", True)
    layer = FlashContrastiveLoss(init_scale=5.0, max_scale=50.0, backend="triton", precision="ieee")
    loss = layer(q, k, paddle.to_tensor(labels))
    loss.backward()
    ref = _reference64(q, k, labels, 5.0, True, "mean")
    assert_close("layer loss", to64(loss), ref[0], "float32")
    assert_close("layer dq", to64(q.grad), ref[1], "float32")
    # d loss / d logit_scale = d loss / d scale * scale
    assert_close("d logit_scale", to64(layer.logit_scale.grad), ref[3] * 5.0, "float32")
    layer.logit_scale.set_value(paddle.to_tensor(np.log(80.0), dtype="float32"))  # beyond max_scale
    layer.clear_gradients()
    loss = layer(q, k, paddle.to_tensor(labels))
    loss.backward()
    assert_close("clamped loss", to64(loss), _reference64(q, k, labels, 50.0, True, "mean")[0], "float32")
    assert float(layer.logit_scale.grad) == 0.0
    fixed = FlashContrastiveLoss(symmetric=False, learnable_scale=False, init_scale=3.0, backend="triton",
                                 precision="ieee")
    assert not fixed.parameters()
    assert_close("fixed-scale loss", to64(fixed(q, k)), _reference64(q, k, np.arange(26), 3.0, False, "mean")[0],
                 "float32")


# ---------------------------------------------------------------------------------------------------
# two processes over gloo: the ring (Triton) and the all-gather reference equal the global batch


def _ring_body():
    """Each rank holds rows [rank * B, (rank + 1) * B) of the global q, k; fleet's data-parallel group
    is the default group."""
    import paddle.distributed as dist

    hcg = init_fleet(dp_degree=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(int(os.environ["PNF_CONTRASTIVE_SEED"]))
    B, D = 13, 21
    q_all = rng.standard_normal((world * B, D)).astype(np.float32) * 0.5
    k_all = rng.standard_normal((world * B, D)).astype(np.float32) * 0.5
    labels_all = rng.integers(0, world * B, world * B)
    local = slice(rank * B, (rank + 1) * B)
    for symmetric, custom, backend in ((True, True, "triton"), (False, False, "triton"), (True, True, "reference")):
        labels = labels_all if custom else np.arange(world * B)
        q = paddle.to_tensor(q_all[local], stop_gradient=False)
        k = paddle.to_tensor(k_all[local], stop_gradient=False)
        scale = paddle.to_tensor(2.5, stop_gradient=False)
        group = None if backend == "triton" else hcg.get_data_parallel_group()
        loss = flash_contrastive_loss(q, k, paddle.to_tensor(labels[local]) if custom else None, scale,
                                      symmetric=symmetric, group=group, backend=backend,
                                      precision="ieee" if backend == "triton" else "auto")
        loss.backward()
        dscale = scale.grad.clone()
        dist.all_reduce(dscale)  # each rank holds its rows' share
        ref = _reference64(paddle.to_tensor(q_all), paddle.to_tensor(k_all), labels, 2.5, symmetric, "mean")
        what = f"rank {rank} {backend} symmetric={symmetric}"
        assert_close(f"{what} loss", to64(loss), ref[0], "float32")
        assert_close(f"{what} dq", to64(q.grad), ref[1][local], "float32")
        assert_close(f"{what} dk", to64(k.grad), ref[2][local], "float32")
        assert_close(f"{what} dscale", to64(dscale), ref[3], "float32")
    rows = flash_contrastive_loss(paddle.to_tensor(q_all[local]), paddle.to_tensor(k_all[local]), scale=2.0,
                                  reduction="none", backend="triton", precision="ieee")
    scores = 2.0 * q_all.astype(np.float64) @ k_all.T.astype(np.float64)
    expected = np.log(np.exp(scores).sum(1)) - np.diag(scores)
    assert_close(f"rank {rank} per-row", to64(rows), expected[local], "float32")


def test_ring_over_two_processes_equals_global_batch(monkeypatch):
    monkeypatch.setenv("PNF_CONTRASTIVE_SEED", str(np.random.randint(2**31)))
    run_distributed(_ring_body)


# ---------------------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    q, k = randn((4, 8)), randn((4, 8))
    with pytest.raises(ValueError, match="q, k: expected 2-D"):
        flash_contrastive_loss(randn((2, 4, 8)), k)
    with pytest.raises(ValueError, match="k: expected dim 8"):
        flash_contrastive_loss(q, randn((4, 9)))
    with pytest.raises(TypeError, match="k: expected the dtype of q"):
        flash_contrastive_loss(q, k.astype("bfloat16"))
    with pytest.raises(TypeError, match="q: expected dtype"):
        flash_contrastive_loss(paddle.ones([4, 8], dtype="int32"), k)
    with pytest.raises(ValueError, match=r"labels: expected indices in \[0, 4\)"):
        flash_contrastive_loss(q, k, paddle.to_tensor([0, 1, 2, 4]))
    with pytest.raises(ValueError, match=r"labels: expected shape \[4\]"):
        flash_contrastive_loss(q, k, paddle.to_tensor([0, 1]))
    with pytest.raises(TypeError, match="labels: expected int32 or int64"):
        flash_contrastive_loss(q, k, paddle.to_tensor([0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="k: symmetric loss needs as many rows as q"):
        flash_contrastive_loss(q, randn((5, 8)), symmetric=True)
    with pytest.raises(ValueError, match="reduction"):
        flash_contrastive_loss(q, k, reduction="avg")
    with pytest.raises(ValueError, match="precision: only float32 inputs"):
        flash_contrastive_loss(q.astype("float16"), k.astype("float16"), precision="bf16")
    with pytest.raises(TypeError, match="scale: expected a float"):
        flash_contrastive_loss(q, k, scale="20")
    with pytest.raises(TypeError, match="scale: expected a float or a float scalar tensor"):
        flash_contrastive_loss(q, k, scale=paddle.ones([2]))
    with pytest.raises(ValueError, match="k: expected at least one row"):
        flash_contrastive_loss(q, randn((0, 8)))
    with pytest.raises(ValueError, match="backend"):
        flash_contrastive_loss(q, k, backend="cudnn")
    with pytest.raises(ValueError, match="max_scale"):
        FlashContrastiveLoss(init_scale=200.0, max_scale=100.0)


def test_stage_buffers_are_checked():
    """Staging buffers: only for float32 inputs under "bf16", bf16 [C, D] with C no more than the rows,
    and in the backward exactly the G chunk's rows; each error names the buffer."""
    a, b = randn((20, 8), "float32"), randn((24, 8), "float32")
    labels, lse, pos = paddle.arange(20, dtype="int64"), paddle.empty([20]), paddle.empty([20])
    buffer = lambda rows, D=8, dtype="bfloat16": paddle.empty([rows, D], dtype=dtype)

    def fwd(precision="bf16", **stages):
        args = triton_args(a, b, labels, lse, pos, *stages.values())
        contrastive_lse_fwd(*args[:5], scale=1.0, precision=precision, **dict(zip(stages, args[5:])))

    with pytest.raises(ValueError, match="stage: only float32 inputs with precision 'bf16'"):
        fwd("tf32", stage=buffer(8))
    with pytest.raises(ValueError, match=r"stage_a: expected a contiguous bfloat16 \[C, 8\]"):
        fwd(stage_a=buffer(8, D=9))
    with pytest.raises(ValueError, match=r"stage: expected a contiguous bfloat16 \[C, 8\] buffer with 1 <= C <= 24"):
        fwd(stage=buffer(8, dtype="float32"))
    with pytest.raises(ValueError, match="stage_a: expected a contiguous bfloat16"):
        fwd(stage_a=buffer(21))
    work = paddle.empty(list(grad_workspace_shape(20, 24, 16)), dtype="bfloat16")
    vec, grads = paddle.empty([24]), (paddle.empty([20, 8]), paddle.empty([24, 8]))
    *args, stage = triton_args(a, b, lse, vec, lse, vec, labels, paddle.arange(24, dtype="int64"),
                               paddle.ones([1]), work, *grads, buffer(8))
    with pytest.raises(ValueError, match="stage: expected 16 rows"):
        contrastive_grad_accumulate(*args, scale=1.0, precision="bf16", stage=stage)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_autocast_casts_float32_q_and_k(backend, monkeypatch):
    """Inside an active auto_cast (simulated: Paddle's CPU build never enables it) float32 q and k run
    in its dtype, as the O1 white list casts matmul's inputs (``precision`` then has no say); their
    gradients and the learnable scale's come in float32."""
    q, k = randn((6, 8), "float32", requires_grad=True), randn((6, 8), "float32", requires_grad=True)
    scale = paddle.to_tensor(2.0, dtype="float32", stop_gradient=False)
    monkeypatch.setattr(paddle.amp, "is_autocast_enabled", lambda *a, **kw: True)
    monkeypatch.setattr(paddle.amp, "get_autocast_dtype", lambda *a, **kw: paddle.bfloat16)
    loss = flash_contrastive_loss(q, k, scale=scale, symmetric=True, backend=backend, precision="ieee")
    grads = paddle.grad(loss, [q, k, scale])
    monkeypatch.undo()
    assert all(g.dtype == paddle.float32 for g in grads)
    q16, k16 = (paddle.to_tensor(t.numpy()).astype("bfloat16") for t in (q, k))
    q16.stop_gradient = k16.stop_gradient = False
    want = flash_contrastive_loss(q16, k16, scale=scale, symmetric=True, backend=backend)
    for name, got, expected in zip(("loss", "dq", "dk", "dscale"), [loss, *grads],
                                   [want, *paddle.grad(want, [q16, k16, scale])]):
        np.testing.assert_array_equal(got.astype("float32").numpy(), expected.astype("float32").numpy(), err_msg=name)
