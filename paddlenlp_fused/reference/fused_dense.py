"""Pure-Paddle dense layers and MLP: the ground truth and the CPU fallback.

Computed in float32 and cast back (Paddle's CPU build lacks bfloat16 kernels for several of the
ops); autograd goes through the casts. Weights in Paddle's ``[in, out]`` layout.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from ._common import float32

from .gated_activation import GATE_ACTIVATIONS, gelu_tanh

GATED = {"swiglu": "silu", "geglu": "gelu_tanh"}  # the MLP's gated activations -> gated_activation's names
ELEMENTWISE = {
    "gelu_approx": gelu_tanh,
    "gelu": lambda h: F.gelu(h, approximate=False),
    "relu": F.relu,
    "sqrelu": lambda h: F.relu(h) ** 2,
}


def activation_ref(h: paddle.Tensor, activation: str) -> paddle.Tensor:
    """The MLP's activation of h [..., H] (gated: h [..., 2H] = [gate | up] -> [..., H]), float32."""
    if activation in GATED:
        gate, up = paddle.chunk(h, 2, axis=-1)
        return GATE_ACTIVATIONS[GATED[activation]](gate) * up
    return ELEMENTWISE[activation](h)


def fused_dense_ref(x: paddle.Tensor, weight: paddle.Tensor, bias=None) -> paddle.Tensor:
    """x [..., in] @ weight [in, out] + bias [out]."""
    return F.linear(float32(x), float32(weight), None if bias is None else float32(bias)).astype(x.dtype)


def fused_mlp_ref(x: paddle.Tensor, weight1: paddle.Tensor, weight2: paddle.Tensor, bias1=None, bias2=None,
                  activation: str = "gelu_approx") -> paddle.Tensor:
    """act(x @ weight1 + bias1) @ weight2 + bias2, all in float32, cast back to x's dtype."""
    h = F.linear(float32(x), float32(weight1), None if bias1 is None else float32(bias1))
    out = F.linear(activation_ref(h, activation), float32(weight2), None if bias2 is None else float32(bias2))
    return out.astype(x.dtype)
