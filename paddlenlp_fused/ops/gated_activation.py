"""SwiGLU and GeGLU: ``act(x[..., :H]) * x[..., H:]`` for x ``[..., 2H]``.

``swiglu(x)`` equals ``paddle.nn.functional.swiglu(x)``; ``geglu(x)`` uses tanh-approximate gelu.
Backends: ``triton`` (forward and backward kernels in one PyLayer; backward recomputes the
activation from x) and ``reference`` (pure Paddle, computed in float32).
"""

from __future__ import annotations

import paddle

from ..kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd
from ..reference.gated_activation import gated_activation_ref
from ..runtime.backend import resolve_backend
from ..runtime.triton_paddle import triton_args
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer


class GatedActivationFunction(TritonPyLayer):
    op = "swiglu / geglu"

    @staticmethod
    def forward(ctx, x, activation):
        x = contiguous(x)
        two_h = x.shape[-1]
        x2d = x.reshape([-1, two_h])
        out = paddle.empty([x2d.shape[0], two_h // 2], dtype=x.dtype, device=x.place)
        gated_activation_fwd(*triton_args(x2d, out), activation=activation)
        ctx.save_for_backward(x2d)
        ctx.activation = activation
        return out.reshape(list(x.shape[:-1]) + [two_h // 2])

    @staticmethod
    def backward(ctx, dout):
        (x2d,) = ctx.saved_tensor()
        dout2d = contiguous(dout).reshape([x2d.shape[0], x2d.shape[1] // 2])
        dx = paddle.empty(x2d.shape, dtype=x2d.dtype, device=x2d.place)
        gated_activation_bwd(*triton_args(x2d, dout2d, dx), activation=ctx.activation)
        return dx.reshape(list(dout.shape[:-1]) + [x2d.shape[1]])


def gated_activation(x: paddle.Tensor, activation: str = "silu", backend: str = "auto") -> paddle.Tensor:
    """x ``[..., 2H]`` -> ``act(x[..., :H]) * x[..., H:]``; activation 'silu' or 'gelu_tanh'."""
    op = "swiglu" if activation == "silu" else "geglu"
    check_tensor("x", x)
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation: expected 'silu' or 'gelu_tanh', got {activation!r}")
    if x.shape[-1] % 2:
        raise ValueError(f"x: last axis must be even (gate and up halves), got shape {list(x.shape)}")
    chosen = resolve_backend(op, backend, device_of(x), implemented=("triton", "reference"))
    if chosen == "reference":
        return gated_activation_ref(x, activation)
    return GatedActivationFunction.apply(x, activation)


def swiglu(x: paddle.Tensor, backend: str = "auto") -> paddle.Tensor:
    """``silu(x[..., :H]) * x[..., H:]`` for x ``[..., 2H]`` (as ``paddle.nn.functional.swiglu(x)``)."""
    return gated_activation(x, "silu", backend)


def geglu(x: paddle.Tensor, backend: str = "auto") -> paddle.Tensor:
    """``gelu_tanh(x[..., :H]) * x[..., H:]`` for x ``[..., 2H]``."""
    return gated_activation(x, "gelu_tanh", backend)
