"""Mamba-1 mixer layer with PaddleNLP's parameter names and shapes, on the fused ops.

``MambaMixer`` holds exactly the parameters of ``paddlenlp.transformers.mamba.MambaMixer`` (so its
state dict loads as is):

    in_proj   Linear(hidden, 2 * inner, bias=use_bias)     weight [hidden, 2 * inner]
    conv1d    Conv1D(inner, inner, conv_kernel, groups=inner, padding=conv_kernel - 1,
              bias=use_conv_bias)                           weight [inner, 1, conv_kernel]
    x_proj    Linear(inner, dt_rank + 2 * state, bias=False)
    dt_proj   Linear(dt_rank, inner)                        (bias = delta_bias, inverse-softplus init)
    A_log     [inner, state]     A = -exp(A_log)
    D         [inner]
    out_proj  Linear(inner, hidden, bias=use_bias)

``forward(hidden_states, cache_params=None)`` (``cache=`` as PaddleNLP's ``MambaBlock`` passes it):
without a cache it runs ``mamba_inner_fn`` (training and plain inference); with a cache whose
``seqlen_offset`` is 0 it prefills (``causal_conv1d_fn`` + ``selective_scan_fn``, writing the conv
and ssm states); with ``seqlen_offset > 0`` it decodes token by token with ``causal_conv1d_update``
and ``selective_state_update``. The cache is PaddleNLP's ``MambaCache`` or ``MambaInferenceCache``
below (``conv_states[layer_idx]`` [batch, inner, conv_kernel], ``ssm_states[layer_idx]``
[batch, inner, state], ``seqlen_offset``, advanced by the model, not by the mixer).
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ..ops.mamba import mamba_inner_fn, selective_scan_fn, selective_state_update


class MambaInferenceCache:
    """Per-layer conv and ssm states for decoding, laid out as PaddleNLP's ``MambaCache``."""

    def __init__(self, num_layers: int, batch_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 dtype="float32"):
        self.seqlen_offset = 0
        self.dtype = dtype
        self.conv_states = {i: paddle.zeros([batch_size, intermediate_size, conv_kernel], dtype=dtype)
                            for i in range(num_layers)}
        self.ssm_states = {i: paddle.zeros([batch_size, intermediate_size, state_size], dtype=dtype)
                           for i in range(num_layers)}

    def reset(self):
        for i in self.conv_states:
            self.conv_states[i].zero_()
            self.ssm_states[i].zero_()
        self.seqlen_offset = 0


def _config_value(config, name, default):
    return getattr(config, name, default) if config is not None else default


class MambaMixer(nn.Layer):
    """Mamba-1 mixer: ``MambaMixer(config, layer_idx)`` with a PaddleNLP ``MambaConfig`` (or any
    object with its attribute names), or ``MambaMixer(d_model=..., d_state=16, d_conv=4, expand=2,
    dt_rank="auto", layer_idx=...)`` as mamba_ssm's ``Mamba``. ``checkpoint_lvl`` and ``backend`` go
    to ``mamba_inner_fn``."""

    def __init__(self, config=None, layer_idx: int = 0, *, d_model=None, d_state=16, d_conv=4, expand=2,
                 dt_rank="auto", use_bias=False, use_conv_bias=True, hidden_act="silu", dt_min=0.001, dt_max=0.1,
                 dt_init_floor=1e-4, dt_scale=1.0, dt_init="random", checkpoint_lvl: int = 1, backend: str = "auto"):
        super().__init__()
        hidden = _config_value(config, "hidden_size", d_model)
        if hidden is None:
            raise ValueError("d_model: expected the hidden size (or a config with hidden_size), got None")
        self.hidden_size = int(hidden)
        self.ssm_state_size = int(_config_value(config, "state_size", d_state))
        self.conv_kernel_size = int(_config_value(config, "conv_kernel", d_conv))
        self.intermediate_size = int(_config_value(config, "intermediate_size", int(expand * self.hidden_size)))
        rank = _config_value(config, "time_step_rank", dt_rank)
        self.time_step_rank = math.ceil(self.hidden_size / 16) if rank == "auto" else int(rank)
        self.use_bias = bool(_config_value(config, "use_bias", use_bias))
        self.use_conv_bias = bool(_config_value(config, "use_conv_bias", use_conv_bias))
        self.activation = _config_value(config, "hidden_act", hidden_act)
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act: the fused Mamba mixer supports 'silu', got {self.activation!r}")
        self.layer_idx = layer_idx
        self.checkpoint_lvl, self.backend = checkpoint_lvl, backend
        inner, state, rank = self.intermediate_size, self.ssm_state_size, self.time_step_rank

        self.conv1d = nn.Conv1D(inner, inner, self.conv_kernel_size, padding=self.conv_kernel_size - 1, groups=inner,
                                bias_attr=self.use_conv_bias)
        self.in_proj = nn.Linear(self.hidden_size, 2 * inner, bias_attr=self.use_bias)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias_attr=False)
        self.dt_proj = nn.Linear(rank, inner, bias_attr=True)
        A = paddle.arange(1, state + 1, dtype="float32")[None, :].expand([inner, state])
        self.A_log = self.create_parameter(shape=[inner, state], dtype="float32",
                                           default_initializer=nn.initializer.Assign(paddle.log(A)))
        self.D = self.create_parameter(shape=[inner], dtype="float32", default_initializer=nn.initializer.Constant(1.0))
        self.out_proj = nn.Linear(inner, self.hidden_size, bias_attr=self.use_bias)
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True
        self._init_dt_proj(_config_value(config, "time_step_scale", dt_scale),
                           _config_value(config, "time_step_init_scheme", dt_init),
                           _config_value(config, "time_step_min", dt_min),
                           _config_value(config, "time_step_max", dt_max),
                           _config_value(config, "time_step_floor", dt_init_floor))

    @paddle.no_grad()
    def _init_dt_proj(self, scale, scheme, dt_min, dt_max, floor):
        """mamba_ssm's init: dt_proj.weight uniform (or constant) at dt_rank^-0.5 * scale; its bias the
        inverse softplus of dt, log-uniform in [dt_min, dt_max] and at least ``floor``."""
        std = self.time_step_rank ** -0.5 * scale
        weight = self.dt_proj.weight
        if scheme == "constant":
            weight.set_value(paddle.full(weight.shape, std, dtype=weight.dtype))
        else:
            weight.set_value(paddle.uniform(weight.shape, dtype=weight.dtype, min=-std, max=std))
        dt = paddle.exp(paddle.rand([self.intermediate_size], dtype="float32") *
                        (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clip(min=floor)
        self.dt_proj.bias.set_value((dt + paddle.log(-paddle.expm1(-dt))).astype(self.dt_proj.bias.dtype))

    def _A(self):
        return -paddle.exp(self.A_log.astype("float32"))

    def _conv_weight(self):
        return self.conv1d.weight.reshape([self.intermediate_size, self.conv_kernel_size])

    def forward(self, hidden_states, cache_params=None, cache=None):
        """hidden_states [batch, seqlen, hidden] -> [batch, seqlen, hidden]."""
        cache = cache_params if cache_params is not None else cache
        xz = self.in_proj(hidden_states).transpose([0, 2, 1])  # [batch, 2 * inner, seqlen]
        if cache is None:
            return mamba_inner_fn(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                                  self.out_proj.weight, self.out_proj.bias, self._A(), None, None,
                                  self.D.astype("float32"), delta_bias=self.dt_proj.bias.astype("float32"),
                                  delta_softplus=True, checkpoint_lvl=self.checkpoint_lvl, is_paddle_linear=True,
                                  backend=self.backend)
        x, z = xz.chunk(2, axis=1)
        if cache.seqlen_offset > 0:
            y = self._decode(x, z, cache)
        else:
            y = self._prefill(x, z, cache)
        return self.out_proj(y.transpose([0, 2, 1]))

    def _ssm_inputs(self, x_tokens):
        """x_tokens [..., inner] -> dt [..., inner] (before bias and softplus), B, C [..., state]."""
        x_dbl = self.x_proj(x_tokens)
        rank, state = self.time_step_rank, self.ssm_state_size
        dt, B, C = paddle.split(x_dbl, [rank, state, state], axis=-1)
        return paddle.matmul(dt, self.dt_proj.weight), B, C

    def _prefill(self, x, z, cache):
        width = self.conv_kernel_size
        conv_state = cache.conv_states[self.layer_idx]
        history = F.pad(x, [width - x.shape[-1], 0], data_format="NCL") if x.shape[-1] < width else \
            x[:, :, x.shape[-1] - width:]
        paddle.assign(history.astype(conv_state.dtype), output=conv_state)
        x = causal_conv1d_fn(x, self._conv_weight(), self.conv1d.bias, activation=self.activation,
                             backend=self.backend)
        dt, B, C = self._ssm_inputs(x.transpose([0, 2, 1]))
        y, last = selective_scan_fn(x, dt.transpose([0, 2, 1]), self._A(), B.transpose([0, 2, 1]),
                                    C.transpose([0, 2, 1]), self.D.astype("float32"), z,
                                    self.dt_proj.bias.astype("float32"), delta_softplus=True, return_last_state=True,
                                    backend=self.backend)
        ssm_state = cache.ssm_states[self.layer_idx]
        paddle.assign(last.astype(ssm_state.dtype), output=ssm_state)
        return y

    def _decode(self, x, z, cache):
        conv_state, ssm_state = cache.conv_states[self.layer_idx], cache.ssm_states[self.layer_idx]
        A, D, dt_bias = self._A(), self.D.astype("float32"), self.dt_proj.bias.astype("float32")
        ys = []
        for t in range(x.shape[-1]):
            x_t = causal_conv1d_update(x[:, :, t], conv_state, self._conv_weight(), self.conv1d.bias,
                                       self.activation, backend=self.backend)
            dt, B, C = self._ssm_inputs(x_t)
            ys.append(selective_state_update(ssm_state, x_t, dt, A, B, C, D, z[:, :, t], dt_bias, dt_softplus=True,
                                             backend=self.backend))
        return paddle.stack(ys, axis=-1)
