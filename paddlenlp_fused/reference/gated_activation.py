"""Pure-Paddle SwiGLU / GeGLU: the ground truth and the CPU fallback.

Paddle's CPU build lacks bfloat16 (and some float16) kernels for ``silu``/``gelu``, so the
computation runs in float32 and casts back; autograd goes through the casts.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F


def gelu_tanh(a: paddle.Tensor) -> paddle.Tensor:
    """Tanh-approximate GELU as a * sigmoid(2u), u = sqrt(2/pi) (a + 0.044715 a^3).

    Equal to Paddle's 0.5 a (1 + tanh u), which cancels for negative a (fp32 relative error 3e-5
    at a small output); the sigmoid form keeps full relative precision, like the Triton kernels.
    """
    u = math.sqrt(2.0 / math.pi) * (a + 0.044715 * a * a * a)
    return a * F.sigmoid(2.0 * u)


GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def gated_activation_ref(x: paddle.Tensor, activation: str = "silu") -> paddle.Tensor:
    """x [..., 2H] -> act(x[..., :H]) * x[..., H:], act = silu or tanh-approximate gelu."""
    x32 = x.astype("float32")
    gate, up = paddle.chunk(x32, 2, axis=-1)
    return (GATE_ACTIVATIONS[activation](gate) * up).astype(x.dtype)
