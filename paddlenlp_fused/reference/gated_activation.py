"""Pure-Paddle SwiGLU / GeGLU: the ground truth and the CPU fallback.

Paddle's CPU build lacks bfloat16 (and some float16) kernels for ``silu``/``gelu``, so the
computation runs in float32 and casts back; autograd goes through the casts.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def gated_activation_ref(x: paddle.Tensor, activation: str = "silu") -> paddle.Tensor:
    """x [..., 2H] -> act(x[..., :H]) * x[..., H:], act = silu or tanh-approximate gelu."""
    x32 = x.astype("float32")
    gate, up = paddle.chunk(x32, 2, axis=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate=True)
    return (act * up).astype(x.dtype)
