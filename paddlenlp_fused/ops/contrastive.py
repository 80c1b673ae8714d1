"""Contrastive (InfoNCE / CLIP) loss without the similarity matrix: ``cal_flash_loss`` and
``flash_contrastive_loss``.

For q ``[B, D]``, k ``[B_k, D]`` and ``S = scale * q @ k.T``:

- ``cal_flash_loss(q, k, labels, scale)`` is the per-row loss ``logsumexp_j S[i, j] - S[i, labels[i]]``
  (labels default ``arange``), i.e. ``cross_entropy(S, labels, reduction="none")``;
- ``flash_contrastive_loss(..., symmetric=True)`` adds the k->q direction (CLIP): per row
  ``(row_i + col_i) / 2`` with ``col_j = logsumexp_i S[i, j] - S[labels[j], j]``, then ``reduction``.

Losses are float32 whatever the input dtype. The Triton backend keeps only per-row (and, symmetric,
per-column) log-sum-exps from the forward; backward recomputes the scores blockwise (see
``kernels/triton/contrastive.py``). ``scale`` may be a float or a learnable Paddle scalar tensor,
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

import paddle
from paddle.autograd import PyLayer

from ..distributed.comm import reduce_from_parallel
from ..distributed.contrastive_ring import Ring, resolve_group, ring_grad, ring_row_stats
from ..kernels.triton.contrastive import contrastive_grad_accumulate, contrastive_lse_fwd, grad_workspace_shape
from ..reference.contrastive import contrastive_loss_ref
from ..runtime.backend import resolve_backend
from ..runtime.triton_paddle import triton_args
from ._checks import check_tensor, contiguous, device_of

REDUCTIONS = ("mean", "sum", "none")
PRECISIONS = ("auto", "ieee", "tf32", "bf16")


def _operands(q, k, precision):
    """(q, k as the kernels take them, fp32 dot precision): fp32 inputs become bf16 with "bf16"."""
    if precision == "bf16" and q.dtype == paddle.float32:
        return q.astype("bfloat16"), k.astype("bfloat16"), "ieee"
    return q, k, ("tf32" if precision == "auto" else precision)


class _FlashContrastive(PyLayer):
    """Per-row loss [B] float32 of the local rows (see the module docstring) over the Triton kernels."""

    @staticmethod
    def forward(ctx, q, k, scale_tensor, labels, scale, symmetric, precision, ring):
        q_op, k_op, dot_precision = _operands(contiguous(q), contiguous(k), precision)

        def stats(a, labels_a):
            def block(b, b_offset):
                lse = paddle.empty([a.shape[0]], dtype="float32")
                pos = paddle.empty([a.shape[0]], dtype="float32")
                contrastive_lse_fwd(*triton_args(a, b, labels_a, lse, pos), scale=scale, b_offset=b_offset,
                                    precision=dot_precision)
                return lse, pos
            return block

        lse_rows, pos_rows = ring_row_stats(ring, q_op, k_op, stats(q_op, labels))
        loss = lse_rows - pos_rows
        lse_cols = None
        if symmetric:  # columns of S are the rows of S.T = scale * k @ q.T: the same ring with q travelling
            lse_cols, pos_cols = ring_row_stats(ring, k_op, q_op, stats(k_op, labels))
            loss = 0.5 * (loss + lse_cols - pos_cols)
        ctx.save_for_backward(q, q_op, k_op, labels, lse_rows, lse_cols)
        scale_like = None if scale_tensor is None else (list(scale_tensor.shape), scale_tensor.dtype)
        ctx.config = (scale, symmetric, dot_precision, ring, q.dtype, k.dtype, scale_like)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        q, q_op, k_op, labels, lse_rows, lse_cols = ctx.saved_tensor()
        scale, symmetric, dot_precision, ring, q_dtype, k_dtype, scale_like = ctx.config
        dloss = dloss.astype("float32")
        w_rows = 0.5 * dloss if symmetric else dloss
        rank_offset = ring.rank * q_op.shape[0]
        g_work = paddle.empty(list(grad_workspace_shape(q_op.shape[0], k_op.shape[0])), dtype=q_op.dtype)
        ua = paddle.empty([q_op.shape[0], q_op.shape[1]], dtype="float32")
        q_t = q_op.t().contiguous()  # the kernels' second product reads q transposed
        # what travels with a k block: the column term's statistics when symmetric
        pack = [k_op, lse_cols, w_rows, labels] if symmetric else [k_op]

        def block_grad(visiting, ub, b_offset, first):
            b = visiting[0]
            lse_b, w_b, labels_b = visiting[1:] if symmetric else (lse_rows, w_rows, labels)
            w_max = paddle.maximum(w_rows.abs().max(), w_b.abs().max()).clip(min=1e-30).reshape([1])
            contrastive_grad_accumulate(
                *triton_args(q_op, q_t, b, lse_rows, lse_b, w_rows, w_b, labels, labels_b, w_max, g_work, ua, ub),
                scale=scale, a_offset=rank_offset, b_offset=b_offset, row_term=True, col_term=symmetric,
                accumulate_a=not first, accumulate_b=not first, precision=dot_precision)

        ub = ring_grad(ring, pack, [k_op.shape[0], k_op.shape[1]], block_grad)
        dscale = None
        if scale_like is not None:  # sum_ij G_ij q_i.k_j = sum_i q_i.(G k)_i, over this rank's rows
            shape, dtype = scale_like
            q32 = q if q.dtype == paddle.float32 else q.astype("float32")
            dscale = paddle.dot(q32.flatten(), ua.flatten()).reshape(shape).astype(dtype)
        dq, dk = ua.scale_(scale), ub.scale_(scale)  # in place: the fp32 accumulators become the gradients
        return dq.astype(q_dtype), dk.astype(k_dtype), dscale


def _check_inputs(q, k, labels, scale, symmetric, reduction, precision):
    check_tensor("q", q, min_ndim=2)
    check_tensor("k", k, min_ndim=2)
    if q.ndim != 2 or k.ndim != 2:
        raise ValueError(f"q, k: expected 2-D tensors [batch, dim], got shapes {list(q.shape)} and {list(k.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"k: expected the dtype of q ({q.dtype}), got {k.dtype}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"k: expected dim {q.shape[1]} (q's), got shape {list(k.shape)}")
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(f"q, k: expected at least one row each, got shapes {list(q.shape)} and {list(k.shape)}")
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
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or a Paddle scalar tensor, got {type(scale).__name__}")
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
    ``reduction="none"``."""
    _check_inputs(q, k, labels, scale, symmetric, reduction, precision)
    pg = resolve_group(group)
    ring = Ring(pg)
    ring.check_same_rows(q.shape[0], "q")
    if q.shape[0] != k.shape[0] and ring.world > 1:
        raise ValueError(f"k: with a group, q and k must have the same local batch, got {q.shape[0]} and {k.shape[0]}")
    labels = _labels(labels, q.shape[0], ring.rank * q.shape[0], ring.world * k.shape[0])
    chosen = resolve_backend("flash_contrastive_loss", backend, device_of(q), implemented=("triton", "reference"))
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
