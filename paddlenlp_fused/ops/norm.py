"""LayerNorm, RMSNorm (with fused residual add) and Mamba-2's gated RMSNorm.

``layer_norm_fn`` / ``rms_norm_fn`` follow flash-attn's ``layer_norm_fn`` / ``rms_norm_fn``: with
``residual`` they compute ``h = x + residual`` first (rounded to the residual stream's dtype:
float32 with ``residual_in_fp32``, else the residual's) and normalise h; ``prenorm=True`` also
returns h, whose gradient flows back into x and residual. ``weight_offset`` scales by
``weight + weight_offset`` (Gemma's ``1 + w``). ``rmsnorm_gated_fn`` follows mamba_ssm's gated
RMSNorm. Backends: ``cuda`` (csrc/norm.cu, not the gated norm), ``triton`` and ``reference``.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..kernels.cuda import norm as cuda_norm
from ..kernels.triton import norm as triton_norm
from ..reference.norm import layer_norm_ref, rmsnorm_gated_ref
from ..runtime import tensor as T
from ..runtime.backend import gpu_order, resolve_backend
from ..runtime.triton_paddle import triton_args
from ._checks import check_eps, check_tensor, contiguous, device_of
from ._pylayer import grads_for, needs_grad

def auto_order(N: int) -> tuple:
    """GPU backends in the order ``auto`` tries them for rows of N elements (runtime.backend.AUTO_ORDER)."""
    return gpu_order("layer_norm", N=N)


_KERNELS = {"triton": triton_norm, "cuda": cuda_norm}


def _launch(backend: str, name: str, tensors: dict, **options) -> None:
    """Call launcher ``name`` of ``backend`` with tensor keyword arguments (wrapped for Triton)."""
    if backend == "triton":
        tensors = dict(zip(tensors, triton_args(*tensors.values())))
    getattr(_KERNELS[backend], name)(**tensors, **options)


def _bwd_workspace(backend: str, M: int, N: int, dtype: str, has_bias: bool, group_size=None, place=None) -> dict:
    """The backward launcher's workspaces as keyword arguments: partial sums, row statistics
    (sliced rows) and, for Triton, the zeroed counters of the fused partial sums."""
    if backend == "cuda":
        partials, rowstats = cuda_norm.bwd_workspace_shapes(M, N, dtype, has_bias)
    else:
        partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, has_bias, group_size)
    workspace = dict(partials=paddle.empty(list(partials), dtype="float32", device=place),
                     rowstats=None if rowstats is None else paddle.empty(list(rowstats), dtype="float32", device=place))
    if backend == "triton":
        workspace["counters"] = paddle.zeros([triton_norm.COUNTERS], dtype="int32", device=place)
    return workspace


class NormFunction(PyLayer):
    """LayerNorm / RMSNorm over the last axis with optional residual add, on one GPU backend."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms_norm, prenorm, residual_dtype, weight_offset, backend):
        N = x.shape[-1]
        x2d = contiguous(x).reshape([-1, N])
        weight, bias = contiguous(weight), contiguous(bias)
        M = x2d.shape[0]
        res2d = None if residual is None else contiguous(residual).reshape([M, N])
        y = paddle.empty([M, N], dtype=x.dtype, device=x.place)
        res_out = None
        if residual is not None or residual_dtype != x.dtype:
            res_out = paddle.empty([M, N], dtype=residual_dtype, device=x.place)
        mean = None if is_rms_norm else paddle.empty([M], dtype="float32", device=x.place)
        rstd = paddle.empty([M], dtype="float32", device=x.place)
        _launch(backend, "norm_fwd", dict(x=x2d, weight=weight, bias=bias, y=y, mean=mean, rstd=rstd,
                                          residual=res2d, residual_out=res_out),
                eps=eps, is_rms_norm=is_rms_norm, weight_offset=weight_offset)
        ctx.save_for_backward(x2d if res_out is None else res_out, weight, mean, rstd)
        ctx.options = dict(is_rms_norm=is_rms_norm, weight_offset=weight_offset)
        ctx.backend, ctx.shape, ctx.has_bias = backend, x.shape, bias is not None
        ctx.returns_res_out = prenorm and res_out is not None
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.needs_grad = needs_grad(x, weight, bias, residual)
        y = y.reshape(x.shape)
        return (y, res_out.reshape(x.shape)) if ctx.returns_res_out else y

    @staticmethod
    def backward(ctx, dy, dres_out=None):
        h, weight, mean, rstd = ctx.saved_tensor()
        M, N = h.shape
        dy2d = contiguous(dy).reshape([M, N])
        dres_out2d = contiguous(dres_out).reshape([M, N]) if ctx.returns_res_out else None
        dx = paddle.empty([M, N], dtype=dy.dtype, device=dy.place)
        # the kernel writes the residual's gradient (dh, as dx) into its own tensor: Paddle adds the
        # gradients of an input's other consumers into the returned tensor in place, so x and the
        # residual must not share one
        dres = None
        if ctx.residual_dtype is not None and ctx.needs_grad[-1]:
            dres = paddle.empty([M, N], dtype=ctx.residual_dtype, device=dy.place)
        dweight = paddle.empty(weight.shape, dtype=weight.dtype, device=dy.place)
        dbias = paddle.empty(weight.shape, dtype=weight.dtype, device=dy.place) if ctx.has_bias else None
        workspace = _bwd_workspace(ctx.backend, M, N, T.dtype_name(dy), ctx.has_bias, place=dy.place)
        _launch(ctx.backend, "norm_bwd", dict(h=h, weight=weight, mean=mean, rstd=rstd, dy=dy2d, dx=dx,
                                              dweight=dweight, dbias=dbias, dresidual_out=dres_out2d, dresidual=dres,
                                              **workspace), **ctx.options)
        dx = dx.reshape(ctx.shape)
        grads = [dx, dweight] + ([dbias] if ctx.has_bias else [])
        if ctx.residual_dtype is not None:
            grads.append(None if dres is None else dres.reshape(ctx.shape))
        return grads_for(ctx, grads)


def _check_norm_args(x, weight, bias=None, residual=None) -> int:
    check_tensor("x", x)
    N = x.shape[-1]
    check_tensor("weight", weight)
    if list(weight.shape) != [N]:
        raise ValueError(f"weight: expected shape [{N}] (the last axis of x), got {list(weight.shape)}")
    if T.dtype_name(weight) not in ("float32", T.dtype_name(x)):
        raise TypeError(f"weight: expected float32 or x's dtype {T.dtype_name(x)}, got {T.dtype_name(weight)}")
    if bias is not None:
        check_tensor("bias", bias)
        if list(bias.shape) != [N]:
            raise ValueError(f"bias: expected shape [{N}] (the last axis of x), got {list(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: expected the weight's dtype {T.dtype_name(weight)}, got {T.dtype_name(bias)}")
    if residual is not None:
        check_tensor("residual", residual)
        if list(residual.shape) != list(x.shape):
            raise ValueError(f"residual: expected x's shape {list(x.shape)}, got {list(residual.shape)}")
    return N


def layer_norm_fn(x, weight, bias, residual=None, eps: float = 1e-5, prenorm: bool = False,
                  residual_in_fp32: bool = False, is_rms_norm: bool = False, backend: str = "auto",
                  weight_offset: float = 0.0):
    """LayerNorm (or RMSNorm) over the last axis of x ``[..., N]`` with weight/bias ``[N]`` (fp32 or
    x's dtype; bias may be None), after adding ``residual`` (x's shape) when given. Returns y in
    x's dtype, or ``(y, h)`` with ``prenorm=True``, h = x + residual in float32 when
    ``residual_in_fp32`` (else the residual's dtype; x itself when there is neither)."""
    N = _check_norm_args(x, weight, bias, residual)
    eps = check_eps("eps", eps)
    residual_dtype = paddle.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype)
    op = "rms_norm" if is_rms_norm else "layer_norm"
    chosen = resolve_backend(op, backend, device_of(x), implemented=("triton", "cuda", "reference"),
                             prefer=auto_order(N))
    if chosen == "reference" or x.size == 0:  # (empty tensors: nothing to launch)
        return layer_norm_ref(x, weight, bias, residual, eps, prenorm, residual_dtype, is_rms_norm, weight_offset)
    out = NormFunction.apply(x, weight, bias, residual, eps, is_rms_norm, prenorm, residual_dtype,
                             float(weight_offset), chosen)
    if prenorm and residual is None and residual_dtype == x.dtype:
        return out, x  # h is x: its gradient reaches x through autograd
    return out


def rms_norm_fn(x, weight, residual=None, eps: float = 1e-6, prenorm: bool = False, residual_in_fp32: bool = False,
                backend: str = "auto", weight_offset: float = 0.0):
    """RMSNorm ``h / sqrt(mean(h^2) + eps) * (weight + weight_offset)`` over the last axis, h = x
    (+ residual); see ``layer_norm_fn`` for residual, prenorm and residual_in_fp32."""
    return layer_norm_fn(x, weight, None, residual, eps, prenorm, residual_in_fp32, is_rms_norm=True,
                         backend=backend, weight_offset=weight_offset)


class GatedRMSNormFunction(PyLayer):
    """Mamba-2's gated RMSNorm on the Triton kernels."""

    @staticmethod
    def forward(ctx, x, weight, z, eps, group_size, norm_before_gate):
        N = x.shape[-1]
        x2d, weight = contiguous(x).reshape([-1, N]), contiguous(weight)
        M = x2d.shape[0]
        z2d = None if z is None else contiguous(z).reshape([M, N])
        ngroups = N // (group_size or N)
        y = paddle.empty([M, N], dtype=x.dtype, device=x.place)
        rstd = paddle.empty([M * ngroups], dtype="float32", device=x.place)
        options = dict(is_rms_norm=True, group_size=group_size, norm_before_gate=norm_before_gate)
        _launch("triton", "norm_fwd", dict(x=x2d, weight=weight, bias=None, y=y, mean=None, rstd=rstd, z=z2d),
                eps=eps, **options)
        ctx.save_for_backward(x2d, weight, z2d, rstd)
        ctx.options, ctx.shape = options, x.shape
        ctx.needs_grad = needs_grad(x, weight, z)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, z2d, rstd = ctx.saved_tensor()
        M, N = x2d.shape
        dx = paddle.empty([M, N], dtype=x2d.dtype, device=x2d.place)
        dz = None if z2d is None else paddle.empty([M, N], dtype=z2d.dtype, device=x2d.place)
        dweight = paddle.empty(weight.shape, dtype=weight.dtype, device=x2d.place)
        workspace = _bwd_workspace("triton", M, N, T.dtype_name(x2d), False, ctx.options["group_size"],
                                   place=x2d.place)
        _launch("triton", "norm_bwd", dict(h=x2d, weight=weight, mean=None, rstd=rstd,
                                           dy=contiguous(dy).reshape([M, N]), dx=dx, dweight=dweight, z=z2d, dz=dz,
                                           **workspace), **ctx.options)
        grads = [dx.reshape(ctx.shape), dweight] + ([] if dz is None else [dz.reshape(ctx.shape)])
        return grads_for(ctx, grads)


def rmsnorm_gated_fn(x, weight, z=None, eps: float = 1e-6, group_size=None, norm_before_gate: bool = True,
                     backend: str = "auto"):
    """Gated RMSNorm over groups of ``group_size`` columns of x ``[..., N]`` (default: all N), weight
    ``[N]``: ``rmsnorm(x) * weight * silu(z)`` with norm_before_gate, else ``rmsnorm(x * silu(z)) *
    weight``; no gate when z is None."""
    N = _check_norm_args(x, weight)
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
        return rmsnorm_gated_ref(x, weight, z, eps, group_size, norm_before_gate)
    return GatedRMSNormFunction.apply(x, weight, z, eps, group_size, norm_before_gate)
