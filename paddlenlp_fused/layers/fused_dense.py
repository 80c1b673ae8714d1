"""``FusedDense`` (a ``paddle.nn.Linear`` whose bias, and bias gradient, live in the GEMM) and
``FusedMLP`` (``Linear -> activation -> Linear`` as one fused op with ``checkpoint_lvl``)."""

from __future__ import annotations

import paddle
import paddle.nn as nn

from ..ops.fused_dense import GATED, check_mlp_options, fused_dense_func, fused_mlp_func
from . import _args


def check_input_width(x, width: int, what: str) -> None:
    """x's last axis is the layer's input width (the error names x, not the weight)."""
    if isinstance(x, paddle.Tensor) and (x.ndim < 1 or x.shape[-1] != width):
        raise ValueError(f"x: expected [..., {what}={width}], got shape {list(x.shape)}")


def fused_dense_options(heuristic) -> None:
    """``heuristic``: 'auto' or a cuBLASLt algorithm index >= 0."""
    if heuristic != "auto":
        _args.nonnegative_int("heuristic", heuristic)


class FusedDense(nn.Linear):
    """``paddle.nn.Linear`` (same arguments, parameters ``weight [in, out]`` and ``bias [out]``, so
    its state dict loads) computed by ``fused_dense_func``; ``return_residual`` makes forward return
    ``(out, x)``."""

    def __init__(self, in_features: int, out_features: int, weight_attr=None, bias_attr=None, name=None,
                 return_residual: bool = False, backend: str = "auto"):
        # before nn.Linear, which asserts on sizes < 1 and accepts 0
        in_features = _args.positive_int("in_features", in_features)
        out_features = _args.positive_int("out_features", out_features)
        super().__init__(in_features, out_features, weight_attr=weight_attr, bias_attr=bias_attr, name=name)
        self.return_residual = _args.flag("return_residual", return_residual)
        self.backend = _args.backend(backend)

    def forward(self, x):
        check_input_width(x, self.weight.shape[0], "in_features")
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual, backend=self.backend)


class FusedMLP(nn.Layer):
    """``fc2(act(fc1(x)))`` as one ``fused_mlp_func`` call.

    ``fc1``/``fc2`` are ``FusedDense`` sublayers (state-dict keys ``fc1.weight``, ``fc1.bias``,
    ``fc2.weight``, ``fc2.bias``). ``hidden_features`` defaults to ``4 * in_features``; for the gated
    activations (swiglu, geglu) fc1 has ``2 * hidden_features`` outputs, gate then up.
    """

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation: str = "gelu_approx", bias1: bool = True, bias2: bool = True,
                 return_residual: bool = False, checkpoint_lvl: int = 0, heuristic="auto", weight_attr=None,
                 backend: str = "auto"):
        super().__init__()
        check_mlp_options(activation, checkpoint_lvl)
        in_features = _args.positive_int("in_features", in_features)
        hidden_features = _args.positive_int("hidden_features", hidden_features, optional=True) or 4 * in_features
        out_features = _args.positive_int("out_features", out_features, optional=True) or in_features
        _args.backend(backend)
        width1 = 2 * hidden_features if activation in GATED else hidden_features
        self.fc1 = FusedDense(in_features, width1, weight_attr=weight_attr, bias_attr=None if bias1 else False)
        self.fc2 = FusedDense(hidden_features, out_features, weight_attr=weight_attr,
                              bias_attr=None if bias2 else False)
        self.activation = activation
        self.return_residual = _args.flag("return_residual", return_residual)
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic
        self.backend = backend
        fused_dense_options(heuristic)

    def forward(self, x):
        check_input_width(x, self.fc1.weight.shape[0], "in_features")
        return fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                              activation=self.activation, checkpoint_lvl=self.checkpoint_lvl,
                              heuristic=self.heuristic, return_residual=self.return_residual, backend=self.backend)
