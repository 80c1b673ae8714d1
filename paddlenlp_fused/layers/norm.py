"""Normalisation layers: drop-in for ``paddle.nn.LayerNorm``, PaddleNLP's ``LlamaRMSNorm`` and
mamba's gated RMSNorm, with the residual add fused in.

Parameters are named ``weight`` (and ``bias``) with the shapes of the layers they replace, so state
dicts load unchanged. ``forward(x, residual)`` with a residual returns ``(out, h)``, h = x +
residual being the residual stream for the next block (float32 with ``residual_in_fp32``).
``sequence_parallel=True`` marks the parameters ``sequence_parallel`` (fleet's hook then all-reduces
their gradients over the model-parallel group).
"""

from __future__ import annotations

import math

import paddle
from paddle import nn

from ..ops._checks import check_eps
from ..ops.norm import layer_norm_fn, rmsnorm_gated_fn
from . import _args


def _mark_sequence_parallel(*params) -> None:
    for param in params:
        if param is not None:
            param.sequence_parallel = True


def _check_width(name: str, x, hidden_size: int) -> None:
    """The input's last axis is the layer's width: the error names the user's input, not the weight
    the op would compare it with."""
    if isinstance(x, paddle.Tensor) and (x.ndim < 1 or x.shape[-1] != hidden_size):
        raise ValueError(f"{name}: expected [..., hidden_size={hidden_size}], got shape {list(x.shape)}")


class FusedLayerNorm(nn.Layer):
    """``paddle.nn.LayerNorm`` over the trailing ``normalized_shape`` axes (weight and bias flattened
    to ``[prod(normalized_shape)]`` as Paddle stores them); ``weight_attr`` / ``bias_attr`` False
    drop the parameter."""

    def __init__(self, normalized_shape, epsilon: float = 1e-5, weight_attr=None, bias_attr=None,
                 sequence_parallel: bool = False, backend: str = "auto", residual_in_fp32: bool = False,
                 name=None):
        super().__init__()
        if isinstance(normalized_shape, (list, tuple)):
            if not normalized_shape:
                raise ValueError("normalized_shape: expected an int >= 1 or a non-empty list of them, got []")
            shape = [_args.positive_int("normalized_shape", size) for size in normalized_shape]
        else:
            shape = [_args.positive_int("normalized_shape", normalized_shape)]
        self._normalized_shape = shape
        self._epsilon = check_eps("epsilon", epsilon)
        self._backend = _args.backend(backend)
        self._residual_in_fp32 = _args.flag("residual_in_fp32", residual_in_fp32)
        size = math.prod(shape)
        self.weight = None if weight_attr is False else self.create_parameter(
            [size], attr=weight_attr, default_initializer=nn.initializer.Constant(1.0))
        self.bias = None if bias_attr is False else self.create_parameter(
            [size], attr=bias_attr, is_bias=True, default_initializer=nn.initializer.Constant(0.0))
        if self.weight is None:  # the kernels always scale: a fixed unit weight, not in the state dict
            self.register_buffer("_unit_weight", paddle.ones([size]), persistable=False)
        if sequence_parallel:
            _mark_sequence_parallel(self.weight, self.bias)

    def forward(self, x, residual=None):
        trailing = self._normalized_shape
        shape = list(x.shape)
        if shape[len(shape) - len(trailing):] != trailing:
            raise ValueError(f"x: expected trailing axes {trailing}, got shape {shape}")
        folded = len(trailing) > 1  # several normalised axes: one for the op, then back
        if folded:
            flat = shape[:len(shape) - len(trailing)] + [math.prod(trailing)]
            x = x.reshape(flat)
            residual = None if residual is None else residual.reshape(flat)
        weight = self.weight if self.weight is not None else self._unit_weight
        out = layer_norm_fn(x, weight, self.bias, residual, eps=self._epsilon, prenorm=residual is not None,
                            residual_in_fp32=self._residual_in_fp32, backend=self._backend)
        if not folded:
            return out
        if residual is None:
            return out.reshape(shape)
        return out[0].reshape(shape), out[1].reshape(shape)

    def extra_repr(self) -> str:
        return f"normalized_shape={self._normalized_shape}, epsilon={self._epsilon}, backend={self._backend}"


class FusedRMSNorm(nn.Layer):
    """RMSNorm over the last axis (PaddleNLP's ``LlamaRMSNorm``: parameter ``weight [hidden_size]``).
    ``weight_offset`` scales by ``weight + weight_offset`` (Gemma: 1.0); the weight is initialised
    to ``1 - weight_offset`` so a fresh layer scales by one."""

    def __init__(self, hidden_size: int, epsilon: float = 1e-6, weight_attr=None, sequence_parallel: bool = False,
                 backend: str = "auto", residual_in_fp32: bool = False, weight_offset: float = 0.0):
        super().__init__()
        self.hidden_size = _args.positive_int("hidden_size", hidden_size)
        self.variance_epsilon = check_eps("epsilon", epsilon)
        self._backend = _args.backend(backend)
        self._residual_in_fp32 = _args.flag("residual_in_fp32", residual_in_fp32)
        self._weight_offset = _args.real("weight_offset", weight_offset)
        self.weight = self.create_parameter(
            [hidden_size], attr=weight_attr, default_initializer=nn.initializer.Constant(1.0 - weight_offset))
        if sequence_parallel:
            _mark_sequence_parallel(self.weight)

    def forward(self, x, residual=None):
        _check_width("x", x, self.hidden_size)
        return layer_norm_fn(x, self.weight, None, residual, eps=self.variance_epsilon, prenorm=residual is not None,
                             residual_in_fp32=self._residual_in_fp32, is_rms_norm=True, backend=self._backend,
                             weight_offset=self._weight_offset)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, epsilon={self.variance_epsilon}, "
                f"weight_offset={self._weight_offset}, backend={self._backend}")


class GatedRMSNorm(nn.Layer):
    """Mamba-2's gated RMSNorm: ``forward(x, z=None)`` = ``rmsnorm(x) * weight * silu(z)``
    (norm_before_gate) or ``rmsnorm(x * silu(z)) * weight``, per group of ``group_size`` columns.
    ``bias_attr`` other than False adds a ``bias [hidden_size]`` (zeros); ``is_rms_norm=False``
    normalises as LayerNorm (mamba_ssm's gated ``LayerNorm``)."""

    def __init__(self, hidden_size: int, epsilon: float = 1e-6, group_size=None, norm_before_gate: bool = True,
                 weight_attr=None, sequence_parallel: bool = False, backend: str = "auto", bias_attr=False,
                 is_rms_norm: bool = True):
        super().__init__()
        hidden_size = _args.positive_int("hidden_size", hidden_size)
        if _args.positive_int("group_size", group_size, optional=True) is not None and hidden_size % group_size:
            raise ValueError(f"group_size: expected a positive divisor of hidden_size {hidden_size}, got {group_size}")
        self.hidden_size = hidden_size
        self.eps = check_eps("epsilon", epsilon)
        self.group_size = group_size
        self.norm_before_gate = _args.flag("norm_before_gate", norm_before_gate)
        self._backend = _args.backend(backend)
        self.is_rms_norm = _args.flag("is_rms_norm", is_rms_norm)
        self.weight = self.create_parameter([hidden_size], attr=weight_attr,
                                            default_initializer=nn.initializer.Constant(1.0))
        self.bias = None if bias_attr is False else self.create_parameter(
            [hidden_size], attr=bias_attr, is_bias=True, default_initializer=nn.initializer.Constant(0.0))
        if sequence_parallel:
            _mark_sequence_parallel(self.weight, self.bias)

    def forward(self, x, z=None):
        _check_width("x", x, self.hidden_size)
        return rmsnorm_gated_fn(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate,
                                backend=self._backend, bias=self.bias, is_rms_norm=self.is_rms_norm)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, epsilon={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, is_rms_norm={self.is_rms_norm}, "
                f"bias={self.bias is not None}, backend={self._backend}")
