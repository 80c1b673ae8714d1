"""Contrastive (InfoNCE / CLIP) loss without the similarity matrix: ``cal_flash_loss`` and
``flash_contrastive_loss``.

For q ``[B, D]``, k ``[B_k, D]`` and ``S = scale * q @ k.T``:

- ``cal_flash_loss(q, k, labels, scale)`` is the per-row loss ``logsumexp_j S[i, j] - S[i, labels[i]]``
  (labels default ``arange``), i.e. ``cross_entropy(S, labels, reduction="none")``;
- ``flash_contrastive_loss(..., symmetric=True)`` adds the k->q direction (CLIP): per row
  ``(row_i + col_i) / 2`` with ``col_j = logsumexp_i S[i, j] - S[labels[j], j]``, then ``reduction``.

Losses are float32 whatever the input dtype. The Triton backend keeps only per-row (and, symmetric,
per-column) log-sum-exps from the forward; backward recomputes the scores blockwise (see
``kernels/triton/contrastive.py``). The kernels read q and k in place (``precision="bf16"`` rounds
fp32 tiles to bf16 in registers), so the memory beyond the inputs and their gradients is per-row
vectors and the backward's constant G chunk, flat in the batch (for 16-bit inputs the gradients are
accumulated in fp32 before the cast). ``scale`` may be a float or a learnable Paddle scalar tensor,
whose gradient is returned.

Data parallel (``group``, default fleet's data-parallel group when it has more than one rank): each
rank passes its local q and k (the same batch size on every rank); labels are then global indices
(default: each row's own global index). The loss is the global batch's: ``"mean"``/``"sum"`` return
the same value on every rank, ``"none"`` the local rows' losses. The k blocks travel around a ring
(``distributed/contrastive_ring.py``), so no rank holds the global similarity matrix. Gradients: q
and k get exactly the rows of the global batch's gradient; a tensor ``scale`` gets this rank's share
(its rows' part), the shares summing to the global gradient. That is the convention of data-parallel
training, where the gradients of replicated parameters are averaged over the group: every
parameter's gradient, the encoders' (through the local features) and the scale's alike, is then the
global gradient divided by the group size.
"""

from __future__ import annotations

import math

import paddle

from ..distributed.comm import reduce_from_parallel
from ..distributed.contrastive_ring import Ring, resolve_group, ring_grad, ring_row_stats
from ..kernels.triton.contrastive import (FWD_STAGE_ROWS, GRAD_CHUNK, STAGE_A_DEFAULT, STAGED_DEFAULT,
                                          contrastive_grad_accumulate, contrastive_lse_fwd, grad_workspace_shape,
                                          operand_dtype, stage_shape)
from ..reference.contrastive import contrastive_loss_ref
from ..runtime import tensor as T
from ..runtime.backend import resolve_backend
from ..runtime.triton_paddle import triton_args
from ._amp import autocast_dtype, cast_float32
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer, grads_for, needs_grad

REDUCTIONS = ("mean", "sum", "none")
PRECISIONS = ("auto", "ieee", "tf32", "bf16")


def _kernel_precision(precision):
    """The launchers' precision: "bf16" rounds fp32 operands to bf16 inside the kernels (no bf16 copy
    of q or k is made); "auto" is tf32 for fp32 inputs; 16-bit inputs ignore it."""
    return "tf32" if precision == "auto" else precision


class _FlashContrastive(TritonPyLayer):
    """Per-row loss [B] float32 of the local rows (see the module docstring) over the Triton kernels.
    Memory beyond q, k and their gradients: per-row vectors, the constant G chunk of the backward
    (``grad_workspace_shape``), the constant bf16 stages (``_stage_buffers``), and in a ring the
    block in flight."""
    op = "flash_contrastive_loss"

    @staticmethod
    def forward(ctx, q, k, scale_tensor, labels, scale, symmetric, precision, ring):
        q, k = contiguous(q), contiguous(k)
        dot_precision = _kernel_precision(precision)
        stages = _stage_buffers(q, k, dot_precision, FWD_STAGE_ROWS)

        def stats(a, labels_a):
            def block(b, b_offset):
                lse = paddle.empty([a.shape[0]], dtype="float32")
                pos = paddle.empty([a.shape[0]], dtype="float32")
                *args, stage_a, stage = triton_args(a, b, labels_a, lse, pos, *stages)
                contrastive_lse_fwd(*args, scale=scale, b_offset=b_offset, precision=dot_precision, stage=stage,
                                    stage_a=stage_a)
                return lse, pos
            return block

        lse_rows, pos_rows = ring_row_stats(ring, q, k, stats(q, labels))
        loss = lse_rows - pos_rows
        lse_cols = None
        if symmetric:  # columns of S are the rows of S.T = scale * k @ q.T: the same ring with q travelling
            lse_cols, pos_cols = ring_row_stats(ring, k, q, stats(k, labels))
            loss = 0.5 * (loss + lse_cols - pos_cols)
        ctx.needs_grad = needs_grad(q, k, scale_tensor, labels)
        ctx.save_for_backward(q, k, labels, lse_rows, lse_cols)
        scale_like = None if scale_tensor is None else (list(scale_tensor.shape), scale_tensor.dtype)
        ctx.config = (scale, symmetric, dot_precision, ring, scale_like)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        q, k, labels, lse_rows, lse_cols = ctx.saved_tensor()
        scale, symmetric, dot_precision, ring, scale_like = ctx.config
        dloss = dloss.astype("float32")
        w_rows = 0.5 * dloss if symmetric else dloss
        rank_offset = ring.rank * q.shape[0]
        g_work = paddle.empty(list(grad_workspace_shape(q.shape[0], k.shape[0])),
                              dtype=operand_dtype(T.dtype_name(q), dot_precision))
        ua = paddle.empty([q.shape[0], q.shape[1]], dtype="float32")
        stages = _stage_buffers(q, k, dot_precision, (GRAD_CHUNK, GRAD_CHUNK))
        # what travels with a k block: the column term's statistics when symmetric
        pack = [k, lse_cols, w_rows, labels] if symmetric else [k]

        def block_grad(visiting, ub, b_offset, first):
            b = visiting[0]
            lse_b, w_b, labels_b = visiting[1:] if symmetric else (lse_rows, w_rows, labels)
            w_max = paddle.maximum(w_rows.abs().max(), w_b.abs().max()).clip(min=1e-30).reshape([1])
            *args, stage_a, stage = triton_args(q, b, lse_rows, lse_b, w_rows, w_b, labels, labels_b, w_max,
                                                g_work, ua, ub, *stages)
            contrastive_grad_accumulate(
                *args, scale=scale, a_offset=rank_offset, b_offset=b_offset, row_term=True, col_term=symmetric,
                accumulate_a=not first, accumulate_b=not first, precision=dot_precision, stage=stage,
                stage_a=stage_a)

        ub = ring_grad(ring, pack, [k.shape[0], k.shape[1]], block_grad)
        del g_work, stages
        dscale = None
        if scale_like is not None:
            shape, dtype = scale_like
            dscale = _scale_grad(q, ua).reshape(shape).astype(dtype)
        dq, dk = ua.scale_(scale), ub.scale_(scale)  # in place: the fp32 accumulators become the gradients
        grads = [dq.astype(q.dtype), dk.astype(k.dtype)] + ([] if scale_like is None else [dscale]) + [None]
        return grads_for(ctx, grads)  # (labels: no gradient)


def _stage_buffers(q, k, dot_precision, rows):
    """(for q's rows, for k's rows): the bf16 buffers the launchers round chunks of q and k into
    (fp32 inputs under "bf16", as ``STAGE_A_DEFAULT`` / ``STAGED_DEFAULT`` say; None otherwise), of
    ``rows`` (q's, k's) rows at most: constant in the batch. The symmetric direction swaps q and k
    (the same rows then)."""
    if not (dot_precision == "bf16" and q.dtype == paddle.float32):
        return None, None
    make = lambda x, n, on: paddle.empty(list(stage_shape(x.shape[0], x.shape[1], n)), dtype="bfloat16") \
        if on else None
    return make(q, rows[0], STAGE_A_DEFAULT), make(k, rows[1], STAGED_DEFAULT)


_SCALE_GRAD_ROWS = 8192


def _scale_grad(q, ua):
    """sum_ij G_ij q_i.k_j = sum_i q_i.(G k)_i over this rank's rows (fp32 scalar), 8192 rows at a
    time so a 16-bit q is upcast a slice at a time (no [B, D] fp32 copy)."""
    total = paddle.zeros([], dtype="float32")
    for r0 in range(0, q.shape[0], _SCALE_GRAD_ROWS):
        rows = q[r0:r0 + _SCALE_GRAD_ROWS]
        total = total + paddle.dot(rows.astype("float32").flatten(), ua[r0:r0 + _SCALE_GRAD_ROWS].flatten())
    return total


def _check_inputs(q, k, labels, scale, symmetric, reduction, precision):
    check_tensor("q", q, min_ndim=2)
    check_tensor("k", k, min_ndim=2)
    if q.ndim != 2 or k.ndim != 2:
        raise ValueError(f"q, k: expected 2-D tensors [batch, dim], got shapes {list(q.shape)} and {list(k.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"k: expected the dtype of q ({q.dtype}), got {k.dtype}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"k: expected dim {q.shape[1]} (q's), got shape {list(k.shape)}")
    if k.shape[0] == 0 and q.shape[0] > 0:  # a row's softmax over no candidates has no value
        raise ValueError(f"k: expected at least one row for the {q.shape[0]} rows of q, got shape {list(k.shape)}")
    if q.shape[1] == 0:
        raise ValueError(f"q, k: expected dim >= 1, got {q.shape[1]}")
    if device_of(q) != device_of(k):
        raise ValueError("k: expected the device of q")
    if symmetric and q.shape[0] != k.shape[0]:
        raise ValueError(f"k: symmetric loss needs as many rows as q ({q.shape[0]}), got {k.shape[0]}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision != "auto" and q.dtype != paddle.float32:
        raise ValueError(f"precision: only float32 inputs take a matmul precision, got {precision!r} for {q.dtype}")
    if isinstance(scale, paddle.Tensor):
        if scale.size != 1 or scale.dtype not in (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16):
            raise TypeError(f"scale: expected a float or a float scalar tensor, got shape {list(scale.shape)} "
                            f"dtype {scale.dtype}")
        value = float(scale.detach().astype("float32").item())  # (a sync; the Triton path reads it anyway)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or a Paddle scalar tensor, got {type(scale).__name__}")
    else:
        value = float(scale)
    if not math.isfinite(value):  # NaN or inf would make every loss and gradient NaN without a word
        raise ValueError(f"scale: expected a finite value, got {value}")
    if labels is not None:
        if not isinstance(labels, paddle.Tensor):
            raise TypeError(f"labels: expected a paddle.Tensor or None, got {type(labels).__name__}")
        if labels.dtype not in (paddle.int32, paddle.int64):
            raise TypeError(f"labels: expected int32 or int64, got {labels.dtype}")
        if list(labels.shape) != [q.shape[0]]:
            raise ValueError(f"labels: expected shape [{q.shape[0]}] (one per row of q), got {list(labels.shape)}")


def _labels(labels, rows, offset, bound, what="labels"):
    """Global int64 labels: default each row's own global index; checked to lie in [0, bound)."""
    if labels is None:
        return paddle.arange(offset, offset + rows, dtype="int64")
    labels = labels.astype("int64")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= bound:
        raise ValueError(f"{what}: expected indices in [0, {bound}) (rows of the global k), got values in "
                         f"[{low}, {high}]")
    return labels


def flash_contrastive_loss(q: paddle.Tensor, k: paddle.Tensor, labels: paddle.Tensor | None = None,
                           scale=1.0, symmetric: bool = False, reduction: str = "mean", group=None,
                           backend: str = "auto", precision: str = "auto") -> paddle.Tensor:
    """InfoNCE loss of ``S = scale * q @ k.T`` (module docstring): q ``[B, D]``, k ``[B_k, D]`` (fp32, fp16
    or bf16, any D), labels ``[B]`` int (default: each row's own index), ``scale`` float or scalar
    tensor. ``precision`` (float32 inputs): ``"auto"``/``"tf32"`` tf32 tensor cores, ``"bf16"`` bf16
    operands (fp32 accumulation), ``"ieee"`` exact fp32. Returns float32: a scalar, or ``[B]`` for
    ``reduction="none"``. Inside an active ``paddle.amp.auto_cast``, float32 q and k run in its dtype
    (the O1 white list casts matmul's inputs), whatever ``precision`` says."""
    target = autocast_dtype()
    if target is not None:
        cast_q, cast_k = cast_float32([q, k], target)
        if (cast_q is not q or cast_k is not k) and precision in PRECISIONS:
            precision = "auto"  # the auto_cast dtype is the matmul's precision now
        q, k = cast_q, cast_k
    _check_inputs(q, k, labels, scale, symmetric, reduction, precision)
    pg = resolve_group(group)
    ring = Ring(pg)
    ring.check_same_rows(q.shape[0], "q")
    if q.shape[0] != k.shape[0] and ring.world > 1:
        raise ValueError(f"k: with a group, q and k must have the same local batch, got {q.shape[0]} and {k.shape[0]}")
    chosen = resolve_backend("flash_contrastive_loss", backend, device_of(q), implemented=("triton", "reference"))
    if q.shape[0] == 0:  # every rank's batch is empty (check_same_rows): no collective, on any backend
        return _empty_batch_loss(q, k, scale, reduction)
    labels = _labels(labels, q.shape[0], ring.rank * q.shape[0], ring.world * k.shape[0])
    if chosen == "reference":
        rows = _reference_rows(q, k, labels, scale, symmetric, pg)
    else:
        scale_tensor = scale if isinstance(scale, paddle.Tensor) else None
        scale_value = float(scale.astype("float32").item()) if scale_tensor is not None else float(scale)
        rows = _FlashContrastive.apply(q, k, scale_tensor, labels, scale_value, bool(symmetric), precision, ring)
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "mean":
        total = total / (ring.world * q.shape[0])
    return reduce_from_parallel(total, pg)  # forward all-reduce, backward identity (each rank its share)


def _empty_batch_loss(q, k, scale, reduction):
    """The loss of a batch of no rows: 0 (``[0]`` for "none"), float32, with zero gradients for q, k
    and a tensor scale (not None: an optimizer steps them as usual)."""
    zero = (q.astype("float32").sum() + k.astype("float32").sum()) * 0.0
    if isinstance(scale, paddle.Tensor):
        zero = zero * scale.astype("float32").reshape([])
    return paddle.zeros([0], dtype="float32") + zero if reduction == "none" else zero


def _reference_rows(q, k, labels, scale, symmetric, pg):
    """The reference path; with a group the global q/k are all-gathered (backward: reduce-scatter)."""
    if pg is None:
        return contrastive_loss_ref(q, k, labels, scale, symmetric)
    from ..distributed.comm import all_gather_sequence

    k_all = all_gather_sequence(k, pg)
    q_all = all_gather_sequence(q, pg) if symmetric else None
    return contrastive_loss_ref(q, k, labels, scale, symmetric, q_all=q_all, k_all=k_all)


def cal_flash_loss(q: paddle.Tensor, k: paddle.Tensor, labels: paddle.Tensor | None = None, scale=None,
                   group=False, backend: str = "auto", precision: str = "auto") -> paddle.Tensor:
    """Per-row loss ``logsumexp_j(scale * q_i.k_j) - scale * q_i.k_{labels_i}`` (float32 ``[B]``; labels
    default ``arange``, scale default 1), as Inf-CL's ``cal_flash_loss``. Single process unless a
    ``group`` is given."""
    return flash_contrastive_loss(q, k, labels, 1.0 if scale is None else scale, symmetric=False,
                                  reduction="none", group=group, backend=backend, precision=precision)
