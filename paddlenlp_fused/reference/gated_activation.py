"""Pure-Paddle SwiGLU / GeGLU: the ground truth and the CPU fallback.

Paddle's CPU build lacks bfloat16 (and some float16) kernels for ``silu``/``gelu``, so the
computation runs in float32 and casts back; autograd goes through the casts.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def gelu_tanh(a: paddle.Tensor) -> paddle.Tensor:
    """Tanh-approximate GELU, Paddle's ``gelu(approximate=True)`` kernel (one op forward and backward):
    0.5 a (1 + tanh u), u = sqrt(2/pi) (a + 0.044715 a^3). That form cancels for a < -3, where the
    output is tiny: its relative precision there is lost (the absolute error stays below 1e-7 of the
    largest output over [-10, 10]), as in the plain composition that calls the same kernel."""
    return F.gelu(a, approximate=True)


GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def gated_activation_ref(x: paddle.Tensor, activation: str = "silu") -> paddle.Tensor:
    """x [..., 2H] -> act(x[..., :H]) * x[..., H:], act = silu or tanh-approximate gelu."""
    x32 = x.astype("float32")
    gate, up = paddle.chunk(x32, 2, axis=-1)
    return (GATE_ACTIVATIONS[activation](gate) * up).astype(x.dtype)
