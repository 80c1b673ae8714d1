"""Pure-Paddle LayerNorm, RMSNorm and gated RMSNorm: the ground truth and the CPU fallback.

Computed in float32 (Paddle's CPU build lacks bfloat16 kernels for most of these ops) and cast back;
autograd goes through the casts. The residual stream ``h = x + residual`` is rounded to
``residual_dtype`` before it is normalised, as the plain composition in that dtype does.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def _normalize(h32, eps: float, is_rms_norm: bool):
    """(h - mean) / sqrt(var + eps) over the last axis, or h / sqrt(mean(h^2) + eps) (RMSNorm)."""
    if is_rms_norm:
        return h32 * paddle.rsqrt((h32 * h32).mean(axis=-1, keepdim=True) + eps)
    centred = h32 - h32.mean(axis=-1, keepdim=True)
    return centred * paddle.rsqrt((centred * centred).mean(axis=-1, keepdim=True) + eps)


def layer_norm_ref(x, weight, bias=None, residual=None, eps: float = 1e-5, prenorm: bool = False,
                   residual_dtype=None, is_rms_norm: bool = False, weight_offset: float = 0.0):
    """y = norm(h) * (weight + weight_offset) + bias over the last axis, h = x (+ residual) in
    ``residual_dtype`` (default: residual's dtype, else x's). Returns y, or (y, h) with prenorm."""
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    if residual is None and residual_dtype == x.dtype:
        h = x
    else:
        h32 = x.astype("float32")
        if residual is not None:
            h32 = h32 + residual.astype("float32")
        h = h32.astype(residual_dtype)
    y = _normalize(h.astype("float32"), eps, is_rms_norm) * (weight.astype("float32") + weight_offset)
    if bias is not None:
        y = y + bias.astype("float32")
    y = y.astype(x.dtype)
    return (y, h) if prenorm else y


def rmsnorm_gated_ref(x, weight, z=None, eps: float = 1e-6, group_size=None, norm_before_gate: bool = True):
    """Mamba-2's gated RMSNorm over groups of ``group_size`` columns (default: the whole last axis):
    ``norm(x) * weight * silu(z)`` (norm_before_gate) or ``norm(x * silu(z)) * weight``."""
    N = x.shape[-1]
    group_size = group_size or N
    h = x.astype("float32")
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.astype("float32"))
    grouped = h.reshape(list(x.shape[:-1]) + [N // group_size, group_size])
    y = _normalize(grouped, eps, True).reshape(h.shape) * weight.astype("float32")
    if z is not None and norm_before_gate:
        y = y * F.silu(z.astype("float32"))
    return y.astype(x.dtype)
