"""Pure-Paddle LayerNorm, RMSNorm and gated RMSNorm: the ground truth and the CPU fallback.

Computed in float32 (Paddle's CPU build lacks bfloat16 kernels for most of these ops) and cast back;
autograd goes through the casts. The residual stream ``h = x + residual`` is rounded to
``residual_dtype`` before it is normalised, as the plain composition in that dtype does.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from ._common import float32


def _normalize(h32, eps: float, is_rms_norm: bool):
    """(h - mean) / sqrt(var + eps) over the last axis, or h / sqrt(mean(h^2) + eps) (RMSNorm)."""
    if is_rms_norm:
        return h32 * paddle.rsqrt((h32 * h32).mean(axis=-1, keepdim=True) + eps)
    centred = h32 - h32.mean(axis=-1, keepdim=True)
    return centred * paddle.rsqrt((centred * centred).mean(axis=-1, keepdim=True) + eps)


def dropout_mask(shape, p: float, seed: int, place=None):
    """Keep-mask (bool) of ``dropout_p`` p for a tensor of ``shape``, a function of the seed alone:
    drawn by numpy on the host, so it is the same on every device and backend."""
    keep = np.random.RandomState(seed % 2**32).random_sample(list(shape)) >= p
    return paddle.to_tensor(keep, place=place)


def _dropped(x32, mask, p: float):
    return x32 if mask is None else paddle.where(mask, x32 / (1.0 - p), paddle.zeros_like(x32))


def layer_norm_ref(x, weight, bias=None, residual=None, eps: float = 1e-5, prenorm: bool = False,
                   residual_dtype=None, is_rms_norm: bool = False, weight_offset: float = 0.0, *, x1=None,
                   weight1=None, bias1=None, rowscale=None, dropout_p: float = 0.0, dropout_mask=None,
                   dropout_mask1=None, out_dtype=None):
    """y = norm(h) * (weight + weight_offset) + bias over the last axis, h = x (+ residual) in
    ``residual_dtype`` (default: residual's dtype, else x's). Returns y, or (y, h) with prenorm.

    flash-attn's extras: h = dropout(x * rowscale) + dropout(x1) + residual with the keep-masks
    ``dropout_mask`` / ``dropout_mask1`` (kept values scaled by 1 / (1 - dropout_p)); ``weight1``
    (and ``bias1``) give a second output y1 = norm(h) * (weight1 + weight_offset) + bias1, returned
    after y: (y, y1[, h]). y (and y1) in ``out_dtype`` (default x's dtype)."""
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    out_dtype = out_dtype or x.dtype
    plain = rowscale is None and dropout_mask is None and x1 is None
    if residual is None and residual_dtype == x.dtype and plain:
        h = x
    else:
        h32 = float32(x)
        if rowscale is not None:
            h32 = h32 * float32(rowscale).unsqueeze(-1)
        h32 = _dropped(h32, dropout_mask, dropout_p)
        if x1 is not None:
            h32 = h32 + _dropped(float32(x1), dropout_mask1, dropout_p)
        if residual is not None:
            h32 = h32 + float32(residual)
        h = h32.astype(residual_dtype)
    h32 = float32(h)
    # LayerNorm's statistics in Paddle's kernel, one op forward and backward; weight and bias outside
    # it (Paddle 3.3's CPU layer_norm_grad leaves the weight out of x's gradient whenever the weight's
    # own gradient is not asked for: a frozen weight, paddle.grad of x alone)
    normed = _normalize(h32, eps, True) if is_rms_norm else F.layer_norm(h32, h32.shape[-1], epsilon=eps)
    outs = []
    for w, b in ((weight, bias), (weight1, bias1)):
        if w is None:
            continue
        y = normed * (float32(w) + weight_offset if weight_offset else float32(w))
        if b is not None:
            y = y + float32(b)
        outs.append(y.astype(out_dtype))
    if prenorm:
        outs.append(h)
    return outs[0] if len(outs) == 1 else tuple(outs)


def rmsnorm_gated_ref(x, weight, z=None, eps: float = 1e-6, group_size=None, norm_before_gate: bool = True,
                      bias=None, is_rms_norm: bool = True):
    """Mamba-2's gated RMSNorm (or LayerNorm, ``is_rms_norm=False``) over groups of ``group_size``
    columns (default: the whole last axis): ``(norm(x) * weight + bias) * silu(z)``
    (norm_before_gate) or ``norm(x * silu(z)) * weight + bias``."""
    N = x.shape[-1]
    group_size = group_size or N
    h = float32(x)
    if z is not None and not norm_before_gate:
        h = h * F.silu(float32(z))
    grouped = h.reshape(list(x.shape[:-1]) + [N // group_size, group_size])
    y = _normalize(grouped, eps, is_rms_norm).reshape(h.shape) * float32(weight)
    if bias is not None:
        y = y + float32(bias)
    if z is not None and norm_before_gate:
        y = y * F.silu(float32(z))
    return y.astype(x.dtype)
