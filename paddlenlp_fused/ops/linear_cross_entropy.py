"""LM head + cross-entropy without materialising the ``[tokens, V]`` logits.

``linear_cross_entropy(hidden, weight, labels, ...)`` equals the plain composition
``F.cross_entropy(matmul(hidden, weight, transpose_y).astype("float32"), labels)`` (plus the options
below) in loss and gradients, holding no logits: the forward keeps per-token log-sum-exp statistics
only; the backward recomputes logits chunk by chunk. Vocabulary parallel with ``tp_group``.

Backends: ``triton`` (kernels in ``kernels/triton/linear_cross_entropy.py``; on CPU tensors under
``TRITON_INTERPRET=1``) and ``reference`` (pure Paddle, float32, blockwise over tokens). A label
outside ``[0, V)`` (and not ``ignore_index``) raises ``ValueError`` on the reference path; the Triton
path does not synchronise with the host to look, and gives that token a NaN loss instead.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import paddle
from paddle.autograd import PyLayer

from ..distributed import vocab_parallel
from ..kernels.triton import linear_cross_entropy as kernels
from ..reference import linear_cross_entropy as ref
from ..runtime import tensor as T
from ..runtime.backend import resolve_backend
from ..runtime.triton_paddle import triton_args
from ._checks import check_tensor, contiguous, device_of

REDUCTIONS = ("mean", "sum", "none")


class _Options(NamedTuple):
    backend: str
    transpose_y: bool
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]
    filter_eps: Optional[float]
    vocab_chunk: Optional[int]
    pg: object  # comm.ParallelGroup or None
    shard: vocab_parallel.VocabShard


# ----------------------------------------------------------------------------------------------
# the two engines: same three stages (stats, token loss, gradients)


def _triton_stats(hidden, weight, labels, bias, o: _Options):
    n_tok = hidden.shape[0]
    V = weight.shape[0] if o.transpose_y else weight.shape[1]
    n_split = kernels.forward_splits(n_tok, V, dtype=T.dtype_name(hidden))
    partials = paddle.empty([4, n_split, n_tok], dtype="float32", device=hidden.place)
    stats = paddle.empty([3, n_tok], dtype="float32", device=hidden.place)
    kernels.lse_forward(*triton_args(hidden, weight, labels, bias, partials, stats), transpose_y=o.transpose_y,
                        vocab_start=o.shard.start, softcap=o.softcap, need_sum=o.label_smoothing > 0)
    return stats


def _triton_token_loss(stats, labels, o: _Options):
    loss = paddle.empty([labels.shape[0]], dtype="float32", device=labels.place)
    kernels.token_loss(*triton_args(stats, labels, loss), vocab_total=o.shard.total, ignore_index=o.ignore_index,
                       label_smoothing=o.label_smoothing, z_loss=o.z_loss)
    return loss


def _triton_grads(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, o: _Options, need):
    n_tok, D = hidden.shape
    V = weight.shape[0] if o.transpose_y else weight.shape[1]
    dtype = T.dtype_name(hidden)
    ws = kernels.backward_workspace(n_tok, D, V, dtype, chunk=o.vocab_chunk)
    place = hidden.place
    g = paddle.empty(list(ws.g), dtype=hidden.dtype, device=place)
    lo = paddle.empty(list(ws.lo), dtype=hidden.dtype, device=place) if ws.lo else None
    flags = paddle.empty(list(ws.flags), dtype="int8", device=place)
    dbias_acc = paddle.zeros(list(ws.dbias), dtype="float32", device=place) if bias is not None else None
    dh = paddle.empty([n_tok, D], dtype=hidden.dtype, device=place)
    dw = paddle.empty(list(weight.shape), dtype=weight.dtype, device=place)
    db = paddle.empty(list(bias.shape), dtype=bias.dtype, device=place) if bias is not None else None
    kernels.lce_backward(*triton_args(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, dh, dw, db, g, lo,
                                      flags, dbias_acc),
                         transpose_y=o.transpose_y, vocab_start=o.shard.start, vocab_total=o.shard.total,
                         softcap=o.softcap, label_smoothing=o.label_smoothing, filter_eps=o.filter_eps)
    return dh, dw, db


def _reference_stats(hidden, weight, labels, bias, o: _Options):
    return ref.lse_stats_ref(hidden, weight, labels, bias, transpose_y=o.transpose_y, vocab_start=o.shard.start,
                             softcap=o.softcap)


def _reference_token_loss(stats, labels, o: _Options):
    return ref.token_loss_ref(stats, labels, vocab_total=o.shard.total, ignore_index=o.ignore_index,
                              label_smoothing=o.label_smoothing, z_loss=o.z_loss)


def _reference_grads(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, o: _Options, need):
    dh, dw, db = ref.grads_ref(hidden, weight, labels, bias, lse, coef_p * scale, coef_y * scale,
                               transpose_y=o.transpose_y, vocab_start=o.shard.start, vocab_total=o.shard.total,
                               softcap=o.softcap, label_smoothing=o.label_smoothing, need=need)
    return dh, dw, db


_ENGINES = {
    "triton": (_triton_stats, _triton_token_loss, _triton_grads),
    "reference": (_reference_stats, _reference_token_loss, _reference_grads),
}


class LinearCrossEntropyFunction(PyLayer):
    """(hidden2d ``[T, D]``, weight, bias, labels ``[T]``) -> (per-token fp32 loss ``[T]``, fp32 lse ``[T]``);
    both outputs are differentiable (d lse / d logit = softmax)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, o: _Options):
        stats_fn, loss_fn, _ = _ENGINES[o.backend]
        stats = vocab_parallel.combine_stats(stats_fn(hidden, weight, labels, bias, o), o.pg)
        loss = loss_fn(stats, labels, o)
        lse = stats[0].clone()
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.opts = o
        ctx.need = (not hidden.stop_gradient, not weight.stop_gradient, bias is not None and not bias.stop_gradient)
        ctx.has_bias = bias is not None
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, dlse):
        hidden, weight, bias, labels, lse = ctx.saved_tensor()
        o = ctx.opts
        valid = labels != o.ignore_index
        dl = paddle.where(valid, dloss.astype("float32"), paddle.zeros_like(lse))
        coef_p = dl * (1.0 + 2.0 * o.z_loss * lse) if o.z_loss else dl
        if dlse is not None:
            coef_p = coef_p + dlse.astype("float32")
        if lse.shape[0]:
            # G is stored in the input dtype: normalise the per-token coefficients to at most 1
            # (fp16 would flush 1/T-sized ones) and multiply the scale back in the GEMM epilogues.
            scale = paddle.maximum(paddle.maximum(coef_p.abs().max(), dl.abs().max()),
                                   paddle.to_tensor(1e-30, dtype="float32", place=lse.place)).reshape([1])
        else:
            scale = paddle.ones([1], dtype="float32")
        dh, dw, db = _ENGINES[o.backend][2](hidden, weight, labels, bias, lse, coef_p / scale, dl / scale,
                                             scale, o, ctx.need)
        grads = [dh if ctx.need[0] else None, dw if ctx.need[1] else None]
        if ctx.has_bias:
            grads.append(db if ctx.need[2] else None)
        return tuple(grads + [None])  # labels


# ----------------------------------------------------------------------------------------------
# argument checks and the public functions


def _check_args(hidden, weight, labels, bias, reduction, label_smoothing, z_loss, softcap, shift, transpose_y):
    check_tensor("hidden", hidden, min_ndim=2)
    check_tensor("weight", weight, min_ndim=2)
    if weight.ndim != 2:
        raise ValueError(f"weight: expected a 2-D tensor, got shape {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {T.dtype_name(hidden)} (as hidden), got {T.dtype_name(weight)}")
    D = hidden.shape[-1]
    wd = weight.shape[1] if transpose_y else weight.shape[0]
    if wd != D:
        layout = "[V, D] (transpose_y=True)" if transpose_y else "[D, V] (transpose_y=False)"
        raise ValueError(f"weight: expected {layout} with D={D}, got shape {list(weight.shape)}")
    V = weight.shape[0] if transpose_y else weight.shape[1]
    if not isinstance(labels, paddle.Tensor):
        raise TypeError(f"labels: expected a paddle.Tensor, got {type(labels).__name__}")
    if T.dtype_name(labels) not in ("int64", "int32"):
        raise TypeError(f"labels: expected dtype int64 or int32, got {T.dtype_name(labels)}")
    if list(labels.shape) != list(hidden.shape[:-1]):
        raise ValueError(f"labels: expected shape {list(hidden.shape[:-1])} (hidden's without D), "
                         f"got {list(labels.shape)}")
    if bias is not None:
        check_tensor("bias", bias)
        if list(bias.shape) != [V] or bias.dtype != hidden.dtype:
            raise ValueError(f"bias: expected shape [{V}] and dtype {T.dtype_name(hidden)}, got "
                             f"{list(bias.shape)} {T.dtype_name(bias)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {label_smoothing}")
    if float(z_loss) < 0.0:
        raise ValueError(f"z_loss: expected >= 0, got {z_loss}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap: expected None or > 0, got {softcap}")
    steps = int(shift)
    if isinstance(shift, bool) or steps == shift:
        if steps < 0 or (steps and steps >= hidden.shape[-2]):
            raise ValueError(f"shift: expected 0 <= shift < sequence length {hidden.shape[-2]}, got {shift}")
    else:
        raise TypeError(f"shift: expected a bool or an int, got {shift!r}")
    return V, steps


def _filter_eps(filter_eps):
    if filter_eps is None:
        return None
    if filter_eps == "auto":
        return kernels.AUTO_FILTER_EPS
    if isinstance(filter_eps, str) or not float(filter_eps) > 0.0:
        raise ValueError(f"filter_eps: expected None (exact), 'auto' or a float > 0, got {filter_eps!r}")
    return float(filter_eps)


def _shifted(labels, steps: int, ignore_index: int):
    """Labels of position t + steps at position t; the last ``steps`` positions are ignored."""
    if not steps:
        return labels
    pad = paddle.full(list(labels.shape[:-1]) + [steps], ignore_index, dtype=labels.dtype)
    return paddle.concat([labels[..., steps:], pad], axis=-1)


def linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, shift=False, transpose_y=True,
                         return_lse=False, tp_group=None, backend="auto", *, sequence_parallel=False,
                         filter_eps=None, vocab_chunk=None):
    """Cross-entropy of ``logits = hidden @ weight^T (+ bias)`` without holding the logits.

    hidden ``[..., D]`` (float32/float16/bfloat16); weight ``[V, D]`` with ``transpose_y=True`` (tied
    embedding, GPT) or ``[D, V]`` with ``transpose_y=False`` (PaddleNLP LLaMA LM head); labels ``[...]``
    int. ``shift`` (True or n) predicts token t+n from position t (the last n positions drop out).
    ``reduction``: mean over non-ignored tokens (0 when all are ignored), sum, or none (per token,
    float32). ``label_smoothing`` eps mixes eps/V uniform targets in; ``z_loss`` adds ``z * lse^2``;
    ``softcap`` c applies ``c * tanh(logit / c)``. ``return_lse``: also the float32 log-sum-exp per
    token (differentiable). ``tp_group`` (a group, ``"fleet"`` for fleet's model-parallel group, or
    None): vocabulary parallel, each rank holding ``V/n`` rows; ``sequence_parallel``: hidden and labels
    are this rank's sequence chunk and are all-gathered. ``filter_eps`` (None = exact, ``"auto"`` =
    2^-12, or a float): the Triton backward skips gradient tiles whose entries are all below it.
    ``vocab_chunk``: vocabulary rows per backward chunk (default: about 32 MiB of scratch).
    """
    V, steps = _check_args(hidden, weight, labels, bias, reduction, label_smoothing, z_loss, softcap, shift,
                           transpose_y)
    pg = vocab_parallel.resolve_group(tp_group)
    if sequence_parallel and steps and pg is not None:
        raise ValueError("shift: not supported with sequence_parallel (shift the labels before scattering them)")
    chosen = resolve_backend("linear_cross_entropy", backend, device_of(hidden), implemented=("triton", "reference"))
    D = hidden.shape[-1]
    labels_eff = _shifted(labels, steps, ignore_index)
    hidden2d = contiguous(hidden).reshape([-1, D])
    labels1d = labels_eff.reshape([-1])
    hidden2d, labels1d = vocab_parallel.gather_inputs(hidden2d, labels1d, pg, sequence_parallel)
    shard = vocab_parallel.shard(pg, V)
    if chosen == "reference":
        ref.check_labels(labels1d, shard.total, ignore_index)
    opts = _Options(chosen, bool(transpose_y), int(ignore_index), float(label_smoothing), float(z_loss),
                    None if softcap is None else float(softcap), _filter_eps(filter_eps), vocab_chunk, pg, shard)
    loss_tok, lse = LinearCrossEntropyFunction.apply(hidden2d, weight, bias, labels1d, opts)
    if reduction == "mean":
        n_valid = (labels1d != ignore_index).astype("float32").sum()
        loss = loss_tok.sum() / paddle.clip(n_valid, min=1.0)
    elif reduction == "sum":
        loss = loss_tok.sum()
    else:
        loss = _per_token(loss_tok, labels_eff, steps, pg is not None and sequence_parallel)
    if return_lse:
        return loss, _per_token(lse, labels_eff, steps, pg is not None and sequence_parallel)
    return loss


def _per_token(values, labels_shaped, steps: int, gathered: bool):
    """Per-token values in the labels' shape (less the shifted-out positions); flat when the tokens
    were gathered over a sequence-parallel group."""
    if gathered:
        return values
    out = values.reshape(list(labels_shaped.shape))
    return out[..., :-steps] if steps else out


def cce_linear_cross_entropy(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean",
                             shift=False, filter_eps=None, **kwargs):
    """``linear_cross_entropy`` in the argument order of Apple's ``cut_cross_entropy.linear_cross_entropy``:
    embeddings ``e [..., D]``, classifier ``c [V, D]``, ``targets [...]``. Differences from that package:
    ``filter_eps`` defaults to None (exact) rather than 'auto'. Further keywords (``label_smoothing``,
    ``z_loss``, ``return_lse``, ``tp_group``, ``backend``, ...) pass through."""
    return linear_cross_entropy(e, c, targets, bias=bias, ignore_index=ignore_index, reduction=reduction,
                                softcap=softcap, shift=shift, transpose_y=True, filter_eps=filter_eps, **kwargs)
