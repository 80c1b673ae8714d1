"""LM head + cross-entropy without materialising the ``[tokens, V]`` logits.

``linear_cross_entropy(hidden, weight, labels, ...)`` gives each labelled token the loss
``logsumexp(logits) - logits[label]`` of ``logits = matmul(hidden, weight, transpose_y).astype("float32")``
(plus the options below), in loss and gradients; ``reduction="mean"`` divides by the labelled tokens.
That is ``F.cross_entropy`` of the logits except where Paddle's CPU kernel caps a token's loss at 64
or, for ``ignore_index < 0``, divides the mean by every token (docs/ops.md). Vocabulary parallel with
``tp_group``.

Backends and paths:

- ``cuda`` (the GPU default when the CUDA library and cuBLASLt load): cuBLASLt GEMMs on chunks, the
  softmax work in Triton (``kernels/triton/linear_cross_entropy.py``, chunked section), two paths:
  *bounded* (the default): token blocks whose ``[Tb, V]`` logits fit ``max_workspace_gib`` (``"auto"``:
  ``DEFAULT_MAX_WORKSPACE_GIB``, 1 GiB), the gradients computed in the forward pass (3 GEMMs; faster
  than lean, benchmarks/NOTES.md); the loss comes from logits rounded once to the input dtype (as in
  the plain composition in that dtype). It needs the gradient of a scalar loss: ``reduction="none"``,
  ``return_lse=True``, calls under ``no_grad`` and calls where no input needs a gradient take the
  lean path instead (a warning says so once where the bound was given as a number), and so does a
  call whose bound holds not one token's logits (``"auto"``: the lean path; a number: ValueError);
  *lean* (``max_workspace_gib="lean"``): token blocks x vocabulary chunks of fp32 logits, recomputed
  in the backward (4 GEMMs), where the gradient (input dtype) is written over them and dh accumulates
  in fp32; under 0.1 GiB of workspace whatever T and V are.
- ``triton``: every GEMM in Triton (forward 1 GEMM, backward 3), the fallback where the CUDA library
  is absent, and the only path with the (approximate, opt-in) gradient filter ``filter_eps``: a call
  with a filter on the ``cuda`` backend runs here.
- ``reference``: pure Paddle, float32 (CPU fallback): where the ``[tokens, V]`` logits fit one block,
  Paddle's autograd over the logits, the loss written as lse - the label's logit (3 GEMMs); else
  blockwise over tokens, the logits recomputed in the backward.

``deterministic`` (None follows ``FLAGS_cudnn_deterministic``, see ``runtime/determinism.py``): the
bias gradient, the one gradient the kernels add with fp32 atomics, is summed in a fixed order instead
(a float32 workspace of one row of column sums per token block of a logits chunk, and one small
fixed-order sum launch per chunk), on the ``triton`` and ``cuda`` backends alike; dh and dW accumulate
in order on every path already. Without a bias it changes nothing.

Dtypes (AMP): as Paddle's AMP gives matmul's inputs (``ops/_amp.py``): inside an active
``paddle.amp.auto_cast`` float32 hidden, weight and bias are cast to its dtype (the O1 white list);
outside, a float32 weight and bias with float16 / bfloat16 hidden (O1's master weights, a tied fp32
embedding) are cast to the hidden's dtype, as ``fused_dense_func`` does. The casts are autograd ops:
a float32 weight gets a float32 gradient.

A label outside ``[0, V)`` (and not ``ignore_index``) raises the same ``ValueError`` on every backend:
the reference checks before computing; the kernels store any such label in a flag the op reads once
per call.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import paddle

from ..distributed import vocab_parallel
from ..kernels.triton import linear_cross_entropy as kernels
from ..reference import linear_cross_entropy as ref
from ..runtime import tensor as T
from ..runtime.backend import resolve_backend
from ..runtime.determinism import deterministic_requested
from ..runtime.triton_paddle import triton_args
from ._amp import amp_cast
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer

REDUCTIONS = ("mean", "sum", "none")
DEFAULT_MAX_WORKSPACE_GIB = 1.0  # the bounded path's bound under max_workspace_gib="auto"
_warned: set = set()


class _Options(NamedTuple):
    backend: str
    transpose_y: bool
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]
    filter_eps: Optional[float]
    filter_dh: bool
    filter_dw: bool
    accum_dw_fp32: bool
    vocab_chunk: Optional[int]
    max_workspace_bytes: Optional[int]
    pg: object  # comm.ParallelGroup or None
    shard: vocab_parallel.VocabShard
    deterministic: bool = False  # the bias gradient summed in a fixed order (no atomics)


def _empty(shape, dtype, like):
    return paddle.empty(list(shape), dtype=dtype, device=like.place)


def _parts_buffer(shape, like):
    """The deterministic bias gradient's float32 partials workspace, as the launchers take it."""
    return triton_args(_empty(shape, "float32", like))[0]


def _gemm_for(like, nbytes=None):
    """cuBLASLt GEMM with a fresh workspace (``nbytes``, default the device's full one) from Paddle's
    caching allocator, so nothing stays allocated between calls."""
    from ..kernels.cuda import fused_dense
    from ..kernels.cuda import gemm as cuda_gemm

    full = fused_dense.workspace_bytes(like.place.gpu_device_id())
    workspace = _empty([min(full, nbytes or full)], "uint8", like)
    return functools.partial(cuda_gemm.gemm, workspace=workspace)


def _raise_bad_label(flag, o: _Options) -> None:
    """The kernels' label flag, read once per call (ignore_index: every label was in range)."""
    bad = int(flag.numpy()[0])
    if bad != o.ignore_index:
        raise ValueError(f"labels: expected values in [0, {o.shard.total}) or ignore_index={o.ignore_index}, "
                         f"got {bad}")


def _vocab(weight, o: _Options) -> int:
    return weight.shape[0] if o.transpose_y else weight.shape[1]


# ----------------------------------------------------------------------------------------------
# the engines of the recompute design: stats (forward), token loss, gradients (backward)


def _triton_stats(hidden, weight, labels, bias, o: _Options):
    n_tok = hidden.shape[0]
    n_split = kernels.forward_splits(n_tok, _vocab(weight, o), dtype=T.dtype_name(hidden))
    partials = _empty([4, n_split, n_tok], "float32", hidden)
    stats = _empty([3, n_tok], "float32", hidden)
    kernels.lse_forward(*triton_args(hidden, weight, labels, bias, partials, stats), transpose_y=o.transpose_y,
                        vocab_start=o.shard.start, softcap=o.softcap, need_sum=o.label_smoothing > 0)
    return stats


def _cuda_stats(hidden, weight, labels, bias, o: _Options):
    n_tok, D = hidden.shape
    plan = kernels.lean_plan(n_tok, _vocab(weight, o), D, T.dtype_name(hidden), backward=False, vocab=o.vocab_chunk)
    gemm = _gemm_for(hidden, plan.workspace)
    logits = _empty(*kernels.lean_workspace(plan, D)["logits"], hidden)
    state, stats = _empty([4, n_tok], "float32", hidden), _empty([3, n_tok], "float32", hidden)
    kernels.lean_forward(gemm, *triton_args(hidden, weight, labels, bias, logits, state, stats), plan=plan,
                         transpose_y=o.transpose_y, vocab_start=o.shard.start, softcap=o.softcap,
                         need_sum=o.label_smoothing > 0)
    return stats


def _kernel_token_loss(stats, labels, o: _Options):
    loss = _empty([labels.shape[0]], "float32", labels)
    flag = paddle.full([1], o.ignore_index, dtype="int64", device=labels.place)
    kernels.token_loss(*triton_args(stats, labels, loss, flag), vocab_total=o.shard.total,
                       ignore_index=o.ignore_index, label_smoothing=o.label_smoothing, z_loss=o.z_loss)
    _raise_bad_label(flag, o)
    return loss


def _dw_buffer(weight, o: _Options, need_dw: bool):
    if not need_dw:
        return None
    dtype = "float32" if o.accum_dw_fp32 else weight.dtype
    return _empty(weight.shape, dtype, weight)


def _triton_grads(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, o: _Options, need):
    n_tok, D = hidden.shape
    dtype = T.dtype_name(hidden)
    ws = kernels.backward_workspace(n_tok, D, _vocab(weight, o), dtype, chunk=o.vocab_chunk)
    g = _empty(ws.g, hidden.dtype, hidden)
    lo = _empty(ws.lo, hidden.dtype, hidden) if ws.lo else None
    flags = _empty(ws.flags, "int8", hidden)
    dbias_acc = paddle.zeros(list(ws.dbias), dtype="float32", device=hidden.place) if bias is not None else None
    dbias_parts = _parts_buffer(ws.dbias_parts, hidden) if bias is not None and o.deterministic else None
    dh = _empty([n_tok, D], hidden.dtype, hidden)
    dw = _empty(weight.shape, weight.dtype, weight)
    db = _empty(bias.shape, bias.dtype, bias) if bias is not None else None
    kernels.lce_backward(*triton_args(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, dh, dw, db, g, lo,
                                      flags, dbias_acc),
                         transpose_y=o.transpose_y, vocab_start=o.shard.start, vocab_total=o.shard.total,
                         softcap=o.softcap, label_smoothing=o.label_smoothing, filter_eps=o.filter_eps,
                         filter_dh=o.filter_dh, filter_dw=o.filter_dw,
                         dbias_parts=dbias_parts)
    return dh, dw, db


def _cuda_grads(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, o: _Options, need):
    n_tok, D = hidden.shape
    dtype = T.dtype_name(hidden)
    plan = kernels.lean_plan(n_tok, _vocab(weight, o), D, dtype, backward=True, vocab=o.vocab_chunk)
    ws = kernels.lean_workspace(plan, D)
    gemm = _gemm_for(hidden, plan.workspace)
    logits = _empty(*ws["logits"], hidden)
    dh_acc = _empty(*ws["dh_acc"], hidden) if "dh_acc" in ws and need[0] else None
    dh = _empty([n_tok, D], hidden.dtype, hidden) if need[0] else None
    dw = _dw_buffer(weight, o, need[1])
    need_db = bias is not None and need[2]
    db = _empty(bias.shape, bias.dtype, bias) if need_db else None
    dbias_acc = paddle.zeros([bias.shape[0]], dtype="float32", device=bias.place) if need_db else None
    dbias_parts = _parts_buffer(kernels.chunk_dbias_parts_shape(plan), hidden) if need_db and o.deterministic else None
    kernels.lean_backward(gemm, *triton_args(hidden, weight, labels, bias, lse, coef_p, coef_y), float(scale),
                          *triton_args(dh, dw, db, logits, dh_acc, dbias_acc), plan=plan,
                          transpose_y=o.transpose_y, vocab_start=o.shard.start, vocab_total=o.shard.total,
                          softcap=o.softcap, label_smoothing=o.label_smoothing,
                          dbias_parts=dbias_parts)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.astype(weight.dtype)
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
    "cuda": (_cuda_stats, _kernel_token_loss, _cuda_grads),
    "triton": (_triton_stats, _kernel_token_loss, _triton_grads),
    "reference": (_reference_stats, _reference_token_loss, _reference_grads),
}


def _needs(hidden, weight, bias):
    return (not hidden.stop_gradient, not weight.stop_gradient, bias is not None and not bias.stop_gradient)


def _grads_out(grads, need, has_bias):
    out = [grads[0] if need[0] else None, grads[1] if need[1] else None]
    if has_bias:
        out.append(grads[2] if need[2] else None)
    return tuple(out + [None])  # labels


class LinearCrossEntropyFunction(TritonPyLayer):
    """(hidden2d ``[T, D]``, weight, bias, labels ``[T]``) -> (per-token fp32 loss ``[T]``, fp32 lse ``[T]``);
    both outputs are differentiable (d lse / d logit = softmax). The lean / triton / reference paths."""
    op = "linear_cross_entropy"

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, o: _Options):
        if not hidden.shape[0]:  # no tokens: zero gradients, no launch on empty workspaces
            o = o._replace(backend="reference")
        stats_fn, loss_fn, _ = _ENGINES[o.backend]
        stats = vocab_parallel.combine_stats(stats_fn(hidden, weight, labels, bias, o), o.pg)
        loss = loss_fn(stats, labels, o)
        lse = stats[0].clone()
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.opts = o
        ctx.need = _needs(hidden, weight, bias)
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
            # (fp16 would flush 1/T-sized ones) and multiply the scale back in the GEMMs.
            scale = paddle.maximum(paddle.maximum(coef_p.abs().max(), dl.abs().max()),
                                   paddle.to_tensor(1e-30, dtype="float32", place=lse.place)).reshape([1])
        else:
            scale = paddle.ones([1], dtype="float32")
        grads = _ENGINES[o.backend][2](hidden, weight, labels, bias, lse, coef_p / scale, dl / scale, scale, o,
                                       ctx.need)
        return _grads_out(grads, ctx.need, ctx.has_bias)


class BoundedLinearCrossEntropyFunction(TritonPyLayer):
    """(hidden2d, weight, bias, labels, reduction) -> the reduced fp32 loss, with the gradients computed
    in the forward pass (cuBLASLt, token blocks within ``o.max_workspace_bytes``); the backward
    multiplies them by the incoming scalar gradient."""
    op = "linear_cross_entropy"

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, o: _Options, reduction: str):
        n_tok, D = hidden.shape
        V = _vocab(weight, o)
        dtype = T.dtype_name(hidden)
        need = _needs(hidden, weight, bias)
        n_valid = int((labels != o.ignore_index).astype("int64").sum())  # one host read
        alpha = 1.0 / max(n_valid, 1) if reduction == "mean" else 1.0
        # what the bound leaves after the per-token buffers (loss, stats, flags: under 32 bytes a token)
        plan = kernels.bounded_plan(n_tok, V, dtype, o.max_workspace_bytes - 32 * max(n_tok, 1))
        gemm = _gemm_for(hidden, plan.workspace)
        logits = _empty([plan.tokens, plan.ld], hidden.dtype, hidden)
        stats = _empty([3, plan.tokens], "float32", hidden)
        loss = _empty([n_tok], "float32", hidden)
        flag = paddle.full([1], o.ignore_index, dtype="int64", device=hidden.place)
        dh = _empty([n_tok, D], hidden.dtype, hidden) if need[0] else None
        dw = _dw_buffer(weight, o, need[1])
        dbias_acc = paddle.zeros([V], dtype="float32", device=hidden.place) if bias is not None else None
        dbias_parts = _parts_buffer(kernels.chunk_dbias_parts_shape(plan), hidden) \
            if bias is not None and o.deterministic else None
        combine = None
        if o.pg is not None:
            combine = lambda _: triton_args(vocab_parallel.combine_stats(stats, o.pg))[0]  # noqa: E731
        kernels.bounded_forward(gemm, *triton_args(hidden, weight, labels, bias, logits, stats, loss, flag, dh, dw,
                                                   dbias_acc),
                                plan=plan, alpha=alpha, combine=combine, transpose_y=o.transpose_y,
                                vocab_start=o.shard.start, vocab_total=o.shard.total, ignore_index=o.ignore_index,
                                softcap=o.softcap, label_smoothing=o.label_smoothing, z_loss=o.z_loss,
                                dbias_parts=dbias_parts)
        _raise_bad_label(flag, o)
        del logits
        if dw is not None and dw.dtype != weight.dtype:
            dw = dw.astype(weight.dtype)
        db = (dbias_acc * alpha).astype(bias.dtype) if bias is not None and need[2] else None
        ctx.grads = [dh, dw, db]
        ctx.need, ctx.has_bias = need, bias is not None
        return loss.sum() * alpha

    @staticmethod
    def backward(ctx, dloss):
        grads, ctx.grads = ctx.grads, None  # the op holds them no longer: each is returned once, fresh
        factor = float(dloss.astype("float32").reshape([-1])[0])  # one host read
        if factor != 1.0:
            grads = [g.scale_(factor) if g is not None else None for g in grads]
        return _grads_out(grads, ctx.need, ctx.has_bias)


# ----------------------------------------------------------------------------------------------
# argument checks and the public functions


def _layout(weight, D, transpose_y):
    """transpose_y as given, or read off a non-square weight's shape ([V, D]: True, [D, V]: False)."""
    if transpose_y is not None:
        if not isinstance(transpose_y, bool):
            raise TypeError(f"transpose_y: expected None or a bool, got {transpose_y!r}")
        return transpose_y
    rows, cols = weight.shape
    if rows == cols:
        raise ValueError(f"transpose_y: required for a square weight {list(weight.shape)} (True: [V, D], "
                         "False: [D, V]); a square weight can be read either way")
    if cols == D:
        return True
    if rows == D:
        return False
    raise ValueError(f"weight: expected [V, D] or [D, V] with D={D}, got shape {list(weight.shape)}")


def _check_args(hidden, weight, labels, bias, reduction, label_smoothing, z_loss, softcap, shift, transpose_y):
    check_tensor("hidden", hidden, min_ndim=2)
    check_tensor("weight", weight, min_ndim=2)
    if weight.ndim != 2:
        raise ValueError(f"weight: expected a 2-D tensor, got shape {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {T.dtype_name(hidden)} (as hidden), got {T.dtype_name(weight)}")
    D = hidden.shape[-1]
    transpose_y = _layout(weight, D, transpose_y)
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
    return V, steps, transpose_y


def _filter_eps(filter_eps, dtype: str):
    if filter_eps is None:
        return None
    if filter_eps == "auto":
        return kernels.AUTO_FILTER_EPS[dtype]
    if isinstance(filter_eps, str) or not float(filter_eps) > 0.0:
        raise ValueError(f"filter_eps: expected None (exact), 'auto' or a float > 0, got {filter_eps!r}")
    return float(filter_eps)


def check_workspace_bound(max_workspace_gib):
    """``max_workspace_gib`` as given ("auto", "lean") or as a float (a number of GiB > 0)."""
    if isinstance(max_workspace_gib, str) and max_workspace_gib in ("auto", "lean"):
        return max_workspace_gib
    if isinstance(max_workspace_gib, bool) or not isinstance(max_workspace_gib, (int, float)) \
            or not max_workspace_gib > 0:
        raise ValueError(f"max_workspace_gib: expected 'auto', 'lean' or a number of GiB > 0, got "
                         f"{max_workspace_gib!r}")
    return float(max_workspace_gib)


def _bounded_bytes(max_workspace_gib, n_tok: int, V: int, dtype: str):
    """The bounded path's bound in bytes, or None for the lean path (module docstring). A number that
    holds no token's logits raises the same error on every backend, also where the bound goes unused."""
    bound = check_workspace_bound(max_workspace_gib)
    if bound == "lean":
        return None
    nbytes = int((DEFAULT_MAX_WORKSPACE_GIB if bound == "auto" else bound) * 2**30)
    per_token = 32 * max(n_tok, 1)  # the bound also holds the per-token buffers (loss, stats, flags)
    if bound == "auto":
        return nbytes if kernels.bounded_tokens(V, dtype, nbytes - per_token) >= 1 else None
    kernels.bounded_plan(n_tok, V, dtype, nbytes - per_token)
    return nbytes


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


def _shifted(labels, steps: int, ignore_index: int):
    """Labels of position t + steps at position t; the last ``steps`` positions are ignored."""
    if not steps:
        return labels
    pad = paddle.full(list(labels.shape[:-1]) + [steps], ignore_index, dtype=labels.dtype)
    return paddle.concat([labels[..., steps:], pad], axis=-1)


def _cuda_unsupported(filter_eps):
    def why(name):
        if name != "cuda":
            return None
        if filter_eps is not None:
            return "the gradient filter (filter_eps) runs in the Triton kernels"
        from ..kernels.cuda import gemm as cuda_gemm

        ok, reason = cuda_gemm.available()
        return None if ok else reason
    return why


def _choose_backend(backend, hidden, filter_eps):
    return resolve_backend("linear_cross_entropy", backend, device_of(hidden),
                           implemented=("cuda", "triton", "reference"), unsupported=_cuda_unsupported(filter_eps))


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, shift=False, transpose_y=None,
                         return_lse=False, tp_group=None, backend="auto", *, sequence_parallel=False,
                         max_workspace_gib="auto", filter_eps=None, filter_e_grad=True, filter_c_grad=True,
                         accum_c_fp32=False, vocab_chunk=None, deterministic=None):
    """Cross-entropy of ``logits = hidden @ weight^T (+ bias)`` without holding the logits.

    hidden ``[..., D]`` (float32/float16/bfloat16; a float32 weight and bias follow a 16-bit hidden, and
    auto_cast casts as for matmul: module docstring); weight ``[V, D]`` with ``transpose_y=True`` (tied
    embedding, GPT) or ``[D, V]`` with ``transpose_y=False`` (PaddleNLP LLaMA LM head); ``None`` (the
    default) reads the layout off the weight's shape and requires the argument when the weight is
    square. labels ``[...]`` int. ``shift`` (True or n) predicts token t+n from position t (the last n
    positions drop out). ``reduction``: mean over non-ignored tokens (0 when all are ignored), sum, or
    none (per token, float32). ``label_smoothing`` eps mixes eps/V uniform targets in; ``z_loss`` adds
    ``z * lse^2``; ``softcap`` c applies ``c * tanh(logit / c)``. ``return_lse``: also the float32
    log-sum-exp per token (differentiable). ``tp_group`` (a group, ``"fleet"`` for fleet's
    model-parallel group, or None): vocabulary parallel, each rank holding ``V/n`` rows;
    ``sequence_parallel``: hidden and labels are this rank's sequence chunk and are all-gathered.

    ``max_workspace_gib`` (the ``cuda`` backend's paths, module docstring): ``"auto"`` (default) the
    bounded path (gradients in the forward pass, logits blocks within ``DEFAULT_MAX_WORKSPACE_GIB`` =
    1 GiB, the faster path) where the call allows it and the bound holds a token's logits, else the
    lean path; a number of GiB: the bounded path within that bound (ValueError where it holds no
    token's logits); ``"lean"``: the lean path (about 0.1 GiB of workspace, logits recomputed).
    ``filter_eps`` (None = exact, ``"auto"`` = the input dtype's epsilon / 32, or a float): approximate;
    the Triton backward skips gradient tiles whose entries are all below it, in the hidden's
    (``filter_e_grad``) and the weight's (``filter_c_grad``) gradient GEMMs; a call with a filter runs
    on the ``triton`` backend.
    ``accum_c_fp32``: the cuda paths accumulate dW over token blocks in an fp32 buffer of the weight's
    size (else in the weight's dtype). ``vocab_chunk``: vocabulary rows per chunk (triton backward,
    cuda lean path). ``deterministic``: None follows ``FLAGS_cudnn_deterministic``; True sums the
    bias gradient in a fixed order (the others accumulate in a fixed order already).
    """
    hidden, (weight, bias) = amp_cast(hidden, [weight, bias])
    V, steps, transpose_y = _check_args(hidden, weight, labels, bias, reduction, label_smoothing, z_loss, softcap,
                                        shift, transpose_y)
    n_tok = 1
    for size in hidden.shape[:-1]:
        n_tok *= size
    workspace_bytes = _bounded_bytes(max_workspace_gib, n_tok, V, T.dtype_name(hidden))
    filter_e_grad, filter_c_grad = _check_flag("filter_e_grad", filter_e_grad), _check_flag("filter_c_grad",
                                                                                            filter_c_grad)
    accum_c_fp32 = _check_flag("accum_c_fp32", accum_c_fp32)
    deterministic = deterministic_requested(deterministic)
    pg = vocab_parallel.resolve_group(tp_group)
    if sequence_parallel and steps and pg is not None:
        raise ValueError("shift: not supported with sequence_parallel (shift the labels before scattering them)")
    eps = _filter_eps(filter_eps, T.dtype_name(hidden))
    chosen = _choose_backend(backend, hidden, eps)
    D = hidden.shape[-1]
    labels_eff = _shifted(labels, steps, ignore_index)
    hidden2d = contiguous(hidden).reshape([-1, D])
    bias = contiguous(bias)  # the kernels read it at unit stride (a strided view's copy passes its gradient back)
    labels1d = labels_eff.reshape([-1])
    hidden2d, labels1d = vocab_parallel.gather_inputs(hidden2d, labels1d, pg, sequence_parallel)
    shard = vocab_parallel.shard(pg, V)
    # the reference reads the labels on the host anyway: it counts the labelled tokens there
    n_labelled = ref.check_labels(labels1d, shard.total, ignore_index) if chosen == "reference" else None
    if chosen == "cuda":
        weight = contiguous(weight)
    opts = _Options(chosen, transpose_y, int(ignore_index), float(label_smoothing), float(z_loss),
                    None if softcap is None else float(softcap), eps, filter_e_grad, filter_c_grad, accum_c_fp32,
                    vocab_chunk, workspace_bytes, pg, shard, deterministic)
    if chosen == "cuda" and workspace_bytes is not None and hidden2d.shape[0]:
        wants_grad = paddle.is_grad_enabled() and any(_needs(hidden2d, weight, bias))
        if reduction != "none" and not return_lse and wants_grad:
            return BoundedLinearCrossEntropyFunction.apply(hidden2d, weight, bias, labels1d, opts, reduction)
        if max_workspace_gib != "auto":  # a bound asked for by number: say it went unused
            _warn_once("paddlenlp_fused.linear_cross_entropy: max_workspace_gib is ignored (lean path) for "
                       "reduction='none', return_lse=True or a call without gradients")
    if chosen == "reference" and pg is None and hidden2d.shape[0] and ref.fits_one_block(hidden2d.shape[0], V):
        loss_tok, lse = ref.loss_and_lse_ref(hidden2d, weight, labels1d, bias, transpose_y=transpose_y,
                                             ignore_index=opts.ignore_index, label_smoothing=opts.label_smoothing,
                                             z_loss=opts.z_loss, softcap=opts.softcap)
    else:
        loss_tok, lse = LinearCrossEntropyFunction.apply(hidden2d, weight, bias, labels1d, opts)
    if reduction == "mean":
        total = loss_tok.sum()
        if n_labelled is None:
            n_valid = paddle.clip((labels1d != ignore_index).astype("float32").sum(), min=1.0)
        else:
            n_valid = paddle.full_like(total, max(n_labelled, 1))
        loss = total / n_valid
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
                             shift=False, filter_eps=None, accum_e_fp32=False, accum_c_fp32=False,
                             filter_e_grad=True, filter_c_grad=True, **kwargs):
    """``linear_cross_entropy`` in the signature of Apple's ``cut_cross_entropy.linear_cross_entropy``:
    embeddings ``e [..., D]``, classifier ``c [V, D]``, ``targets [...]``, then ``bias, ignore_index,
    softcap, reduction, shift, filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad``.
    Differences from that package: ``filter_eps`` defaults to None (exact) rather than 'auto' ('auto'
    is the same rule: the input dtype's epsilon / 32); ``accum_e_fp32`` changes nothing (the hidden's
    gradient is accumulated in fp32, or compensated, on every path). Further keywords
    (``label_smoothing``, ``z_loss``, ``return_lse``, ``tp_group``, ``backend``, ``max_workspace_gib``, ...)
    pass through."""
    _check_flag("accum_e_fp32", accum_e_fp32)
    return linear_cross_entropy(e, c, targets, bias=bias, ignore_index=ignore_index, reduction=reduction,
                                softcap=softcap, shift=shift, transpose_y=True, filter_eps=filter_eps,
                                filter_e_grad=filter_e_grad, filter_c_grad=filter_c_grad, accum_c_fp32=accum_c_fp32,
                                **kwargs)
