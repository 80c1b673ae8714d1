"""LayerNorm, RMSNorm (with fused residual add) and Mamba-2's gated RMSNorm.

``layer_norm_fn`` / ``rms_norm_fn`` follow flash-attn's ``layer_norm_fn`` / ``rms_norm_fn``: with
``residual`` they compute ``h = x + residual`` first (rounded to the residual stream's dtype:
float32 with ``residual_in_fp32``, else the residual's) and normalise h; ``prenorm=True`` also
returns h, whose gradient flows back into x and residual. ``weight_offset`` scales by
``weight + weight_offset`` (Gemma's ``1 + w``). ``rmsnorm_gated_fn`` follows mamba_ssm's gated
RMSNorm. Backends: ``cuda`` (csrc/norm.cu, not the gated norm), ``triton`` and ``reference``;
flash-attn's ``x1`` / ``weight1`` / ``rowscale`` / dropout / ``out_dtype`` not on CUDA (``auto``
routes around). ``out`` / ``residual_out`` (preallocated outputs) on every backend.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from ..kernels.cuda import norm as cuda_norm
from ..kernels.triton import norm as triton_norm
from ..reference.norm import dropout_mask, layer_norm_ref, rmsnorm_gated_ref
from ..runtime import tensor as T
from ..runtime.backend import gpu_order, resolve_backend
from ..runtime.triton_paddle import triton_args
from ._checks import check_eps, check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer, grads_for, needs_grad

def auto_order(N: int) -> tuple:
    """GPU backends in the order ``auto`` tries them for rows of N elements (runtime.backend.AUTO_ORDER)."""
    return gpu_order("layer_norm", N=N)


_KERNELS = {"triton": triton_norm, "cuda": cuda_norm}


def _launch(backend: str, name: str, tensors: dict, **options) -> None:
    """Call launcher ``name`` of ``backend`` with tensor keyword arguments (wrapped for Triton)."""
    if backend == "triton":
        tensors = dict(zip(tensors, triton_args(*tensors.values())))
    getattr(_KERNELS[backend], name)(**tensors, **options)


def _bwd_workspace(backend: str, M: int, N: int, dtype: str, has_bias: bool, group_size=None, place=None,
                   has_weight1: bool = False, has_bias1: bool = False) -> dict:
    """The backward launcher's workspaces as keyword arguments: partial sums, row statistics
    (sliced rows) and, for Triton, the zeroed counters of the fused partial sums."""
    if backend == "cuda":
        partials, rowstats = cuda_norm.bwd_workspace_shapes(M, N, dtype, has_bias)
    else:
        partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, has_bias, group_size, has_weight1=has_weight1,
                                                              has_bias1=has_bias1)
    workspace = dict(partials=paddle.empty(list(partials), dtype="float32", device=place),
                     rowstats=None if rowstats is None else paddle.empty(list(rowstats), dtype="float32", device=place))
    if backend == "triton":
        workspace["counters"] = paddle.zeros([triton_norm.COUNTERS], dtype="int32", device=place)
    return workspace


class _Masks:
    """Dropout's settings and, when asked, the keep-masks the forward writes (outside autograd)."""

    def __init__(self, p: float, seed, store: bool):
        self.p, self.seed, self.store, self.mask, self.mask1 = p, seed, store, None, None


class _Buffers:
    """The caller's preallocated ``out`` / ``residual_out`` (or None), checked by ``_check_buffers``;
    passed to the PyLayer outside its tensor arguments, so that Paddle takes them as outputs."""

    def __init__(self, out=None, residual_out=None):
        self.out, self.residual_out = out, residual_out


def _written_2d(buffer, M: int, N: int, dtype, place):
    """The [M, N] tensor a kernel writes an output into: the caller's buffer itself where it is
    contiguous (a view of it), else a new tensor (copied into the buffer after the launch)."""
    if buffer is not None and buffer.is_contiguous():
        return buffer.reshape([M, N])
    return paddle.empty([M, N], dtype=dtype, device=place)


def _returned(buffer, written, shape):
    """What the PyLayer returns for one output: the caller's buffer (filled) or the new tensor."""
    if buffer is None:
        return written.reshape(shape)
    if not buffer.is_contiguous():  # (else the kernel wrote it: ``_written_2d``)
        paddle.assign(written.reshape(shape), output=buffer)
    return buffer


class NormFunction(TritonPyLayer):
    """LayerNorm / RMSNorm over the last axis with optional residual add, on one GPU backend;
    on Triton also flash-attn's x1, rowscale, dropout and weight1. Writes y and the stream h into
    the caller's ``buffers`` where given and returns those very tensors (with this node's graph)."""
    op = "layer_norm_fn / rms_norm_fn"

    # The tensors are positional: Paddle orders an input's gradient by its place in the call, so a
    # tensor passed by keyword in another order would take another's gradient. The rest by keyword.
    @staticmethod
    def forward(ctx, x, weight, bias, residual, x1, rowscale, weight1, bias1, *, eps, is_rms_norm, prenorm,
                residual_dtype, weight_offset, out_dtype, dropout, buffers, backend):
        N = x.shape[-1]
        x2d = contiguous(x).reshape([-1, N])
        weight, bias, weight1, bias1 = (contiguous(t) for t in (weight, bias, weight1, bias1))
        M = x2d.shape[0]
        res2d = None if residual is None else contiguous(residual).reshape([M, N])
        x12d = None if x1 is None else contiguous(x1).reshape([M, N])
        rs1d = None if rowscale is None else contiguous(rowscale).reshape([M])
        extras = x1 is not None or rowscale is not None or dropout.p > 0
        y = _written_2d(buffers.out, M, N, out_dtype, x.place)
        y1 = None if weight1 is None else paddle.empty([M, N], dtype=out_dtype, device=x.place)
        res_out = None
        if residual is not None or residual_dtype != x.dtype or extras or buffers.residual_out is not None:
            res_out = _written_2d(buffers.residual_out, M, N, residual_dtype, x.place)
        mean = None if is_rms_norm else paddle.empty([M], dtype="float32", device=x.place)
        rstd = paddle.empty([M], dtype="float32", device=x.place)
        tensors = dict(x=x2d, weight=weight, bias=bias, y=y, mean=mean, rstd=rstd, residual=res2d, residual_out=res_out)
        if weight1 is not None:  # (only then: the CUDA launcher has no such arguments)
            tensors.update(weight1=weight1, bias1=bias1, y1=y1)
        options = dict(eps=eps, is_rms_norm=is_rms_norm, weight_offset=weight_offset)
        ctx.extras = {}
        if extras:  # (only then: the CUDA launcher has no such arguments)
            if dropout.store:
                dropout.mask = paddle.empty([M, N], dtype="uint8", device=x.place)
                dropout.mask1 = None if x1 is None else paddle.empty([M, N], dtype="uint8", device=x.place)
            tensors.update(x1=x12d, rowscale=rs1d, dropout_mask=dropout.mask, dropout_mask1=dropout.mask1)
            ctx.extras = dict(dropout_p=dropout.p, seed=dropout.seed)
            options.update(ctx.extras)
        _launch(backend, "norm_fwd", tensors, **options)
        needs = needs_grad(x, weight, bias, residual, x1, rowscale, weight1, bias1)
        ctx.save_for_backward(x2d if res_out is None else res_out, weight, mean, rstd, rs1d,
                              x2d if rowscale is not None and not rowscale.stop_gradient else None, weight1)
        ctx.options = dict(is_rms_norm=is_rms_norm, weight_offset=weight_offset)
        ctx.backend, ctx.shape, ctx.has_bias, ctx.x_dtype = backend, x.shape, bias is not None, x.dtype
        ctx.returns_res_out = prenorm and res_out is not None
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.x1_dtype = None if x1 is None else x1.dtype
        ctx.rowscale_dtype = None if rowscale is None else rowscale.dtype
        ctx.has_bias1 = bias1 is not None
        ctx.needs_grad = needs
        outs = [_returned(buffers.out, y, x.shape)] + ([] if y1 is None else [y1.reshape(x.shape)])
        if res_out is not None:  # (written into the caller's residual_out also when not returned)
            h = _returned(buffers.residual_out, res_out, x.shape)
            if ctx.returns_res_out:
                outs.append(h)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, dy, *rest):
        h, weight, mean, rstd, rowscale, x2d, weight1 = ctx.saved_tensor()
        M, N = h.shape
        dy2d = contiguous(dy).reshape([M, N])
        dy1 = None if weight1 is None else contiguous(rest[0]).reshape([M, N])
        dres_out2d = contiguous(rest[-1]).reshape([M, N]) if ctx.returns_res_out else None
        dx = paddle.empty([M, N], dtype=ctx.x_dtype, device=dy.place)
        # the kernel writes the residual's gradient (dh, as dx) into its own tensor: Paddle adds the
        # gradients of an input's other consumers into the returned tensor in place, so x and the
        # residual must not share one
        n_vec = 3 if ctx.has_bias else 2
        dres = None
        if ctx.residual_dtype is not None and ctx.needs_grad[n_vec]:
            dres = paddle.empty([M, N], dtype=ctx.residual_dtype, device=dy.place)
        dweight = paddle.empty(weight.shape, dtype=weight.dtype, device=dy.place)
        dbias = paddle.empty(weight.shape, dtype=weight.dtype, device=dy.place) if ctx.has_bias else None
        workspace = _bwd_workspace(ctx.backend, M, N, T.dtype_name(dx), ctx.has_bias, place=dy.place,
                                   has_weight1=weight1 is not None, has_bias1=ctx.has_bias1)
        tensors = dict(h=h, weight=weight, mean=mean, rstd=rstd, dy=dy2d, dx=dx, dweight=dweight, dbias=dbias,
                       dresidual_out=dres_out2d, dresidual=dres, **workspace)
        dweight1 = dbias1 = None
        if weight1 is not None:
            dweight1 = paddle.empty(weight1.shape, dtype=weight1.dtype, device=dy.place)
            dbias1 = paddle.empty(weight1.shape, dtype=weight1.dtype, device=dy.place) if ctx.has_bias1 else None
            tensors.update(weight1=weight1, dy1=dy1, dweight1=dweight1, dbias1=dbias1)
        dx1 = None if ctx.x1_dtype is None else paddle.empty([M, N], dtype=ctx.x1_dtype, device=dy.place)
        drs = None
        if x2d is not None:  # rowscale's gradient, per row and column slab
            drs = paddle.empty(list(triton_norm.drowscale_shape(M, N)), dtype="float32", device=dy.place)
        if ctx.extras or rowscale is not None or dx1 is not None:
            tensors.update(x=x2d, dx1=dx1, rowscale=rowscale, drowscale=drs)
        _launch(ctx.backend, "norm_bwd", tensors, **ctx.options, **ctx.extras)
        grads = [dx.reshape(ctx.shape), dweight] + ([dbias] if ctx.has_bias else [])
        if ctx.residual_dtype is not None:
            grads.append(None if dres is None else dres.reshape(ctx.shape))
        if dx1 is not None:
            grads.append(dx1.reshape(ctx.shape))
        if ctx.rowscale_dtype is not None:
            grads.append(None if drs is None else drs.sum(axis=-1).astype(ctx.rowscale_dtype).reshape(ctx.shape[:-1]))
        grads += [g for g in (dweight1, dbias1) if g is not None]
        return grads_for(ctx, grads)


_OUT_DTYPES = ("float32", "float16", "bfloat16")


def _check_vector_arg(name: str, t, N: int, like=None) -> None:
    if t is None:
        return
    check_tensor(name, t)
    if list(t.shape) != [N]:
        raise ValueError(f"{name}: expected shape [{N}] (the last axis of x), got {list(t.shape)}")
    if like is not None and t.dtype != like[1].dtype:
        raise TypeError(f"{name}: expected {like[0]}'s dtype {T.dtype_name(like[1])}, got {T.dtype_name(t)}")


def _check_norm_args(x, weight, bias=None, residual=None) -> int:
    """Shapes and dtypes of the common arguments; weight (and bias, in weight's dtype) may be in any
    float dtype: the kernels load it and compute in fp32."""
    check_tensor("x", x)
    N = x.shape[-1]
    _check_vector_arg("weight", weight, N)
    _check_vector_arg("bias", bias, N, ("weight", weight))
    if residual is not None:
        check_tensor("residual", residual)
        if list(residual.shape) != list(x.shape):
            raise ValueError(f"residual: expected x's shape {list(x.shape)}, got {list(residual.shape)}")
    return N


def _check_out_dtype(out_dtype, x, out) -> str:
    """y's dtype: ``out_dtype``, else out's (flash-attn writes y in out's dtype), else x's."""
    if out_dtype is None:
        return T.dtype_name(x if out is None else out)
    name = T.dtype_name(out_dtype) if not isinstance(out_dtype, str) else out_dtype
    if name not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected None or one of {list(_OUT_DTYPES)}, got {out_dtype!r}")
    if out is not None and T.dtype_name(out) != name:
        raise TypeError(f"out: expected out_dtype {name}, got {T.dtype_name(out)}")
    return name


def _check_buffers(x, out, residual_out, residual_dtype, inputs) -> None:
    """flash-attn's preallocated outputs: float tensors of x's shape on x's place, residual_out in
    the stream's dtype; written in place, so neither a leaf that requires a gradient nor the memory
    of an input (``inputs``: (name, tensor) pairs; the chunked kernels re-read them after writing)."""
    for name, t in (("out", out), ("residual_out", residual_out)):
        if t is None:
            continue
        check_tensor(name, t)
        if list(t.shape) != list(x.shape):
            raise ValueError(f"{name}: expected x's shape {list(x.shape)}, got {list(t.shape)}")
        if t.place != x.place:
            raise ValueError(f"{name}: expected x's place {x.place}, got {t.place}")
        if not t.stop_gradient and t.is_leaf:
            raise ValueError(f"{name}: a leaf that requires a gradient cannot be written in place")
        for other_name, other in inputs + (() if name == "out" else (("out", out),)):
            if other is not None and other.size and other.data_ptr() == t.data_ptr():
                raise ValueError(f"{name}: shares memory with {other_name}; pass a tensor of its own")
    if residual_out is not None and residual_out.dtype != residual_dtype:
        raise TypeError(f"residual_out: expected the residual stream's dtype {T.dtype_name(residual_dtype)} (float32 "
                        f"with residual_in_fp32, else residual's, else x's), got {T.dtype_name(residual_out)}")


def _weight_offset(weight_offset, zero_centered_weight) -> float:
    """flash-attn's ``zero_centered_weight=True`` is ``weight_offset=1.0`` (scale by 1 + weight)."""
    weight_offset = float(weight_offset)
    if zero_centered_weight:
        if weight_offset not in (0.0, 1.0):
            raise ValueError(f"zero_centered_weight: means weight_offset=1.0, got weight_offset={weight_offset}")
        return 1.0
    return weight_offset


def _check_extras(x, N, x1, weight, weight1, bias1, dropout_p, rowscale, seed) -> float:
    """flash-attn's parallel-residual, dropout and rowscale arguments; returns dropout_p."""
    if x1 is not None:
        check_tensor("x1", x1)
        if list(x1.shape) != list(x.shape):
            raise ValueError(f"x1: expected x's shape {list(x.shape)}, got {list(x1.shape)}")
        if rowscale is not None:
            raise ValueError("rowscale: not supported together with x1 (as in flash-attn)")
    _check_vector_arg("weight1", weight1, N, ("weight", weight))
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1: given without weight1")
    _check_vector_arg("bias1", bias1, N, ("weight1", weight1))
    if rowscale is not None:
        check_tensor("rowscale", rowscale)
        if list(rowscale.shape) != list(x.shape[:-1]):
            raise ValueError(f"rowscale: expected x's leading shape {list(x.shape[:-1])}, got {list(rowscale.shape)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected None or an int, got {type(seed).__name__}")
    if seed is not None and not 0 <= seed < 2**62:  # (the kernels also use seed + 1, as an int64)
        raise ValueError(f"seed: expected an int in [0, 2**62), got {seed}")
    return float(dropout_p)


def _draw_seed() -> int:
    """A dropout seed from Paddle's generator (``paddle.seed`` reproduces it)."""
    return int(paddle.randint(0, 2**31 - 1, [1], dtype="int64").cpu().item())


def _dropout_masks(x, x1, dropout_p: float, seed):
    """Keep-masks of x and x1 from ``seed``, or from a seed drawn from Paddle's generator (so
    ``paddle.seed`` makes them reproducible); x1's from the next seed."""
    if dropout_p == 0.0:
        return None, None
    if seed is None:
        seed = _draw_seed()
    mask = dropout_mask(x.shape, dropout_p, seed, x.place)
    return mask, None if x1 is None else dropout_mask(x1.shape, dropout_p, seed + 1, x.place)


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps: float = 1e-5,
                  dropout_p: float = 0.0, rowscale=None, prenorm: bool = False, residual_in_fp32: bool = False,
                  zero_centered_weight: bool = False, is_rms_norm: bool = False, return_dropout_mask: bool = False,
                  out_dtype=None, out=None, residual_out=None, backend: str = "auto", weight_offset: float = 0.0,
                  seed=None):
    """LayerNorm (or RMSNorm) over the last axis of x ``[..., N]`` with weight/bias ``[N]`` (any
    float dtype, bias in weight's; bias may be None), after adding ``residual`` (x's shape) when
    given; flash-attn's ``layer_norm_fn`` arguments in its order.

    h = dropout(x * rowscale) + dropout(x1) + residual (each term optional; ``rowscale`` [...]
    scales x's rows, not with x1; dropout keeps an element with probability 1 - dropout_p and
    scales it by 1 / (1 - dropout_p), its mask drawn from ``seed``, else from Paddle's generator).
    (Triton: Philox keep-masks of the seed, regenerated in the backward; reference: numpy's.)
    y = norm(h) * (weight + weight_offset) + bias in ``out_dtype`` (default x's dtype);
    ``zero_centered_weight=True`` is ``weight_offset=1.0``. Returns y; (y, y1) when ``weight1`` is
    given (y1 = norm(h) * (weight1 + weight_offset) + bias1); prenorm appends h (float32 with
    ``residual_in_fp32``, else the residual's dtype, else x's); ``return_dropout_mask`` appends the
    bool keep-masks of x and x1 (None where there is no dropout or no x1).

    ``out`` / ``residual_out`` (x's shape; as flash-attn's): y and h are written into them and they
    are what is returned (y in out's dtype unless ``out_dtype`` says it, and then out must be in
    it; residual_out in the stream's dtype, written also without prenorm, and also where h is x
    itself). The returned tensors are these very objects and carry the autograd graph, as new
    outputs would: a loss on them reaches every input. They must not be leaves that require a
    gradient nor share memory with an input. The kernels' backward reads h from residual_out (as
    flash-attn's does): it must not be overwritten before the backward."""
    N = _check_norm_args(x, weight, bias, residual)
    dropout_p = _check_extras(x, N, x1, weight, weight1, bias1, dropout_p, rowscale, seed)
    eps = check_eps("eps", eps)
    residual_dtype = paddle.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype)
    _check_buffers(x, out, residual_out, residual_dtype, (("x", x), ("residual", residual), ("x1", x1)))
    out_dtype = _check_out_dtype(out_dtype, x, out)
    weight_offset = _weight_offset(weight_offset, zero_centered_weight)
    op = "rms_norm" if is_rms_norm else "layer_norm"

    def unsupported(name):
        if name == "reference":
            return None
        extras = [arg for arg, given in (("x1", x1 is not None), ("weight1", weight1 is not None),
                                          ("rowscale", rowscale is not None), ("dropout_p", dropout_p > 0)) if given]
        if name == "cuda" and extras:
            return f"{', '.join(extras)}: not in the CUDA kernels"
        if name == "cuda" and out_dtype != T.dtype_name(x):
            return f"out_dtype {out_dtype} differs from x's dtype"
        if name == "cuda" and T.dtype_name(weight) not in ("float32", T.dtype_name(x)):
            return f"weight dtype {T.dtype_name(weight)} is neither float32 nor x's dtype"
        return None

    device = device_of(x)
    chosen = resolve_backend(op, backend, device, implemented=("triton", "cuda", "reference"),
                             unsupported=unsupported, prefer=auto_order(N) if device == "gpu" else None)
    if chosen != "reference" and x.size:  # (empty tensors: nothing to launch, the reference's path)
        if dropout_p > 0 and seed is None:  # Triton's Philox keep-mask, written by the kernel when asked
            seed = _draw_seed()
        dropout = _Masks(dropout_p, seed, return_dropout_mask and dropout_p > 0)
        result = NormFunction.apply(x, weight, bias, residual, x1, rowscale, weight1, bias1, eps=eps,
                                    is_rms_norm=is_rms_norm, prenorm=prenorm, residual_dtype=residual_dtype,
                                    weight_offset=weight_offset, out_dtype=out_dtype, dropout=dropout,
                                    buffers=_Buffers(out, residual_out), backend=chosen)
        masks = tuple(None if m is None else m.astype("bool").reshape(x.shape) for m in (dropout.mask, dropout.mask1))
        stream_is_x = residual is None and residual_dtype == x.dtype and residual_out is None and x1 is None and \
            rowscale is None and dropout_p == 0  # (then the kernels store no h)
        if prenorm and stream_is_x:
            result = (result if isinstance(result, tuple) else (result,)) + (x,)  # h is x: its gradient reaches x
    else:
        masks = _dropout_masks(x, x1, dropout_p, seed)
        result = layer_norm_ref(x, weight, bias, residual, eps, prenorm or residual_out is not None, residual_dtype,
                                is_rms_norm, weight_offset, x1=x1, weight1=weight1, bias1=bias1, rowscale=rowscale,
                                dropout_p=dropout_p, dropout_mask=masks[0], dropout_mask1=masks[1], out_dtype=out_dtype)
        result = _ref_into_buffers(result, out, residual_out, prenorm)
    if return_dropout_mask:
        result = (result if isinstance(result, tuple) else (result,)) + masks
    return result


def _ref_into_buffers(result, out, residual_out, prenorm: bool):
    """The reference's (y[, y1][, h]) with y and h copied into the caller's out / residual_out
    (``paddle.assign`` keeps the graph) and those returned; h dropped again without prenorm (the
    reference was asked for it to fill residual_out)."""
    outs = list(result) if isinstance(result, tuple) else [result]
    if out is not None:
        outs[0] = paddle.assign(outs[0], output=out)
    if residual_out is not None:
        h = paddle.assign(outs.pop(), output=residual_out)
        if prenorm:
            outs.append(h)
    return tuple(outs) if len(outs) > 1 else outs[0]


def rms_norm_fn(x, weight, bias=None, residual=None, x1=None, weight1=None, bias1=None, eps: float = 1e-6,
                dropout_p: float = 0.0, rowscale=None, prenorm: bool = False, residual_in_fp32: bool = False,
                zero_centered_weight: bool = False, return_dropout_mask: bool = False, out_dtype=None, out=None,
                residual_out=None, backend: str = "auto", weight_offset: float = 0.0, seed=None):
    """RMSNorm ``h / sqrt(mean(h^2) + eps) * (weight + weight_offset) (+ bias)`` over the last
    axis; flash-attn's ``rms_norm_fn`` (bias the third argument, as there); see ``layer_norm_fn``."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, zero_centered_weight, is_rms_norm=True,
                         return_dropout_mask=return_dropout_mask, out_dtype=out_dtype, out=out,
                         residual_out=residual_out, backend=backend, weight_offset=weight_offset, seed=seed)


class GatedRMSNormFunction(TritonPyLayer):
    """Mamba-2's gated RMSNorm (or LayerNorm) on the Triton kernels."""
    op = "rmsnorm_gated_fn"

    @staticmethod
    def forward(ctx, x, weight, bias, z, *, eps, group_size, norm_before_gate, is_rms_norm):  # (see NormFunction)
        N = x.shape[-1]
        x2d, weight, bias = contiguous(x).reshape([-1, N]), contiguous(weight), contiguous(bias)
        M = x2d.shape[0]
        z2d = None if z is None else contiguous(z).reshape([M, N])
        ngroups = N // (group_size or N)
        y = paddle.empty([M, N], dtype=x.dtype, device=x.place)
        mean = None if is_rms_norm else paddle.empty([M * ngroups], dtype="float32", device=x.place)
        rstd = paddle.empty([M * ngroups], dtype="float32", device=x.place)
        options = dict(is_rms_norm=is_rms_norm, group_size=group_size, norm_before_gate=norm_before_gate)
        _launch("triton", "norm_fwd", dict(x=x2d, weight=weight, bias=bias, y=y, mean=mean, rstd=rstd, z=z2d),
                eps=eps, **options)
        ctx.save_for_backward(x2d, weight, bias, z2d, mean, rstd)
        ctx.options, ctx.shape = options, x.shape
        ctx.needs_grad = needs_grad(x, weight, bias, z)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, bias, z2d, mean, rstd = ctx.saved_tensor()
        M, N = x2d.shape
        dy2d = contiguous(dy).reshape([M, N])
        # the kernel's dz leaves out bias * silu'(z) (gate after the norm): add it here in fp32
        bias_in_dz = bias is not None and z2d is not None and ctx.options["norm_before_gate"]
        dx = paddle.empty([M, N], dtype=x2d.dtype, device=x2d.place)
        dz = None if z2d is None else paddle.empty([M, N], dtype="float32" if bias_in_dz else z2d.dtype,
                                                   device=x2d.place)
        dweight = paddle.empty(weight.shape, dtype=weight.dtype, device=x2d.place)
        dbias = None if bias is None else paddle.empty(bias.shape, dtype=bias.dtype, device=x2d.place)
        workspace = _bwd_workspace("triton", M, N, T.dtype_name(x2d), bias is not None, ctx.options["group_size"],
                                   place=x2d.place)
        _launch("triton", "norm_bwd", dict(h=x2d, weight=weight, mean=mean, rstd=rstd, dy=dy2d, dx=dx,
                                           dweight=dweight, dbias=dbias, z=z2d, dz=dz, **workspace), **ctx.options)
        if bias_in_dz:
            z32 = z2d.astype("float32")
            sig = F.sigmoid(z32)
            dz = (dz + dy2d.astype("float32") * bias.astype("float32") * sig * (1.0 + z32 * (1.0 - sig))
                  ).astype(z2d.dtype)
        grads = [dx.reshape(ctx.shape), dweight] + ([] if dbias is None else [dbias]) + \
            ([] if dz is None else [dz.reshape(ctx.shape)])
        return grads_for(ctx, grads)


def rmsnorm_gated_fn(x, weight, z=None, eps: float = 1e-6, group_size=None, norm_before_gate: bool = True,
                     backend: str = "auto", bias=None, is_rms_norm: bool = True):
    """Gated RMSNorm over groups of ``group_size`` columns of x ``[..., N]`` (default: all N), weight
    and bias ``[N]`` (bias optional, in weight's dtype): ``(rmsnorm(x) * weight + bias) * silu(z)``
    with norm_before_gate, else ``rmsnorm(x * silu(z)) * weight + bias``; no gate when z is None.
    ``is_rms_norm=False``: LayerNorm instead (mamba_ssm's gated ``layernorm_fn``)."""
    N = _check_norm_args(x, weight, bias)
    if z is not None:
        check_tensor("z", z)
        if list(z.shape) != list(x.shape):
            raise ValueError(f"z: expected x's shape {list(x.shape)}, got {list(z.shape)}")
    if group_size is not None and (int(group_size) <= 0 or N % int(group_size)):
        raise ValueError(f"group_size: expected a positive divisor of the last axis {N}, got {group_size}")
    eps = check_eps("eps", eps)
    group_size = None if group_size is None else int(group_size)
    chosen = resolve_backend("rmsnorm_gated", backend, device_of(x), implemented=("triton", "reference"))
    if chosen == "reference" or x.size == 0:
        return rmsnorm_gated_ref(x, weight, z, eps, group_size, norm_before_gate, bias, bool(is_rms_norm))
    return GatedRMSNormFunction.apply(x, weight, bias, z, eps=eps, group_size=group_size,
                                      norm_before_gate=norm_before_gate, is_rms_norm=bool(is_rms_norm))
