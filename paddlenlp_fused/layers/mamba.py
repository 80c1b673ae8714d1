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

Model parallelism (``process_group``, default fleet's model-parallel group; none without
``fleet.init`` or with one rank), as Megatron-style Mamba-1 tensor parallelism: the inner channels
are sharded, ``inner / world`` a rank, and each parameter holds this rank's shard, marked
``is_distributed`` / ``split_axis`` as fleet marks its layers':

    sharded    in_proj (column: ``[x_r | z_r]``, split_axis 1), conv1d, x_proj (row: its input
               channels, split_axis 0), dt_proj (column, split_axis 1; bias 0), A_log, D,
               out_proj.weight (row, split_axis 0)
    replicated out_proj.bias; and the x_proj output (dt_low, B, C), the dB/dC path: every rank's
               channels read the same dt_low, B, C, so x_proj's partial products are all-reduced
               forward and their gradients all-reduced backward (each rank's channels add a part),
               which keeps dt_low, B, C and their gradients identical on every rank.

The input ``[batch, seqlen, hidden]`` is replicated (its gradient all-reduced); out_proj's partial
outputs are all-reduced. Under model parallelism the mixer runs conv, x_proj, ``selective_scan_fn``
and the projections as separate ops (``mamba_inner_fn`` computes x_proj inside, with no place for
the all-reduce); decoding works the same way on this rank's channels. ``set_dense_state_dict`` loads
a dense mixer's weights into the shards.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..distributed import comm
from ..ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ..ops._pylayer import add, mm
from ..ops.mamba import mamba_inner_fn, selective_scan_fn, selective_state_update
from . import _args
from .tensor_parallel import _check_divisible, _model_parallel, _sharded_init


def linear(x, weight, bias=None):
    """x @ weight (+ bias), as nn.Linear; in float32 on the CPU for half-precision tensors, which
    Paddle's CPU matmul does not take."""
    out = mm(x, weight)
    return out if bias is None else add(out, bias)


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


def take_shards(state_dict, pick):
    """This rank's part of a dense state dict: ``pick[name] = (axis, indices)`` (indices None: the
    whole tensor, replicated). Values may be tensors or arrays; returns numpy arrays."""
    local = {}
    for name, value in state_dict.items():
        array = value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)
        axis, index = pick[name]
        local[name] = array if index is None else np.take(array, index, axis=axis)
    return local


def mark_sharded(param, axis):
    """fleet's marks of a parameter that holds this rank's shard along ``axis``."""
    if param is not None:
        param.is_distributed = True
        param.split_axis = axis


def _config_value(config, name, default):
    return getattr(config, name, default) if config is not None else default


class MambaMixer(nn.Layer):
    """Mamba-1 mixer: ``MambaMixer(config, layer_idx)`` with a PaddleNLP ``MambaConfig`` (or any
    object with its attribute names), or ``MambaMixer(d_model=..., d_state=16, d_conv=4, expand=2,
    dt_rank="auto", layer_idx=...)`` as mamba_ssm's ``Mamba``. ``checkpoint_lvl`` and ``backend`` go
    to ``mamba_inner_fn``; ``process_group``: model parallelism (module docstring)."""

    def __init__(self, config=None, layer_idx: int = 0, *, d_model=None, d_state=16, d_conv=4, expand=2,
                 dt_rank="auto", use_bias=False, use_conv_bias=True, hidden_act="silu", dt_min=0.001, dt_max=0.1,
                 dt_init_floor=1e-4, dt_scale=1.0, dt_init="random", checkpoint_lvl: int = 1, backend: str = "auto",
                 process_group=None):
        super().__init__()

        def setting(check, attribute, keyword, value, *options, **bounds):
            """The config's ``attribute`` when the config has it, else the keyword's value, checked by
            ``check``: an error names where the value came from."""
            if config is not None and hasattr(config, attribute):
                return check(f"config.{attribute}", getattr(config, attribute), *options, **bounds)
            return check(keyword, value, *options, **bounds)

        if d_model is None and not hasattr(config, "hidden_size"):
            raise ValueError("d_model: expected the hidden size (or a config with hidden_size), got None")
        self.hidden_size = setting(_args.positive_int, "hidden_size", "d_model", d_model)
        self.ssm_state_size = setting(_args.positive_int, "state_size", "d_state", d_state)
        self.conv_kernel_size = setting(_args.positive_int, "conv_kernel", "d_conv", d_conv)
        expand = _args.real("expand", expand, low=0.0, low_open=True)
        self.intermediate_size = setting(_args.positive_int, "intermediate_size", "expand * d_model",
                                         int(expand * self.hidden_size))
        rank = _config_value(config, "time_step_rank", dt_rank)
        self.time_step_rank = math.ceil(self.hidden_size / 16) if rank == "auto" else \
            setting(_args.positive_int, "time_step_rank", "dt_rank", dt_rank)
        self.use_bias = bool(_config_value(config, "use_bias", use_bias))
        self.use_conv_bias = bool(_config_value(config, "use_conv_bias", use_conv_bias))
        self.activation = _config_value(config, "hidden_act", hidden_act)
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act: the fused Mamba mixer supports 'silu', got {self.activation!r}")
        low_dt = setting(_args.real, "time_step_min", "dt_min", dt_min, low=0.0, low_open=True)
        setting(_args.real, "time_step_max", "dt_max", dt_max, low=low_dt)
        setting(_args.real, "time_step_floor", "dt_init_floor", dt_init_floor, low=0.0)
        setting(_args.real, "time_step_scale", "dt_scale", dt_scale, low=0.0, low_open=True)
        setting(_args.choice, "time_step_init_scheme", "dt_init", dt_init, ("random", "constant"))
        self.layer_idx = _args.nonnegative_int("layer_idx", layer_idx)
        self.checkpoint_lvl = _args.checkpoint_level(checkpoint_lvl, (0, 1))
        self.backend = _args.backend(backend)
        self.pg = pg = _model_parallel(process_group)
        self.inner_local = _check_divisible("intermediate_size", self.intermediate_size, pg)
        inner, state, rank = self.inner_local, self.ssm_state_size, self.time_step_rank

        with _sharded_init(pg):
            self.conv1d = nn.Conv1D(inner, inner, self.conv_kernel_size, padding=self.conv_kernel_size - 1,
                                    groups=inner, bias_attr=self.use_conv_bias)
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
        if pg is not None:
            for param, axis in ((self.in_proj.weight, 1), (self.in_proj.bias, 0), (self.conv1d.weight, 0),
                                (self.conv1d.bias, 0), (self.x_proj.weight, 0), (self.dt_proj.weight, 1),
                                (self.dt_proj.bias, 0), (self.A_log, 0), (self.D, 0), (self.out_proj.weight, 0)):
                mark_sharded(param, axis)
            if self.out_proj.bias is not None:  # replicated: the source rank's initial value everywhere
                with paddle.no_grad():
                    comm.broadcast_from_src(self.out_proj.bias, pg)

    def set_dense_state_dict(self, state_dict):
        """Load a dense (one-rank) mixer's parameters, keeping this rank's shards."""
        self.set_state_dict(self.dense_to_local(state_dict))

    def dense_to_local(self, state_dict):
        """This rank's part of a dense mixer's state dict (or of its gradients), as numpy arrays."""
        if self.pg is None:
            return take_shards(state_dict, {name: (0, None) for name in state_dict})
        inner = self.intermediate_size
        chans = np.arange(self.pg.rank * self.inner_local, (self.pg.rank + 1) * self.inner_local)
        in_cols = np.concatenate([chans, inner + chans])
        return take_shards(state_dict, {
            "in_proj.weight": (1, in_cols), "in_proj.bias": (0, in_cols), "conv1d.weight": (0, chans),
            "conv1d.bias": (0, chans), "x_proj.weight": (0, chans), "dt_proj.weight": (1, chans),
            "dt_proj.bias": (0, chans), "A_log": (0, chans), "D": (0, chans), "out_proj.weight": (0, chans),
            "out_proj.bias": (0, None)})

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
        dt = paddle.exp(paddle.rand([self.inner_local], dtype="float32") *
                        (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clip(min=floor)
        self.dt_proj.bias.set_value((dt + paddle.log(-paddle.expm1(-dt))).astype(self.dt_proj.bias.dtype))

    def _A(self):
        return -paddle.exp(self.A_log.astype("float32"))

    def _conv_weight(self):
        return self.conv1d.weight.reshape([self.inner_local, self.conv_kernel_size])

    def forward(self, hidden_states, cache_params=None, cache=None):
        """hidden_states [batch, seqlen, hidden] -> [batch, seqlen, hidden]."""
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [batch, seqlen, hidden_size={self.hidden_size}], got "
                             f"{list(hidden_states.shape)}")
        cache = cache_params if cache_params is not None else cache
        if self.pg is not None:
            hidden_states = comm.copy_to_parallel(hidden_states, self.pg)
        # [batch, 2 * inner, seqlen]
        xz = linear(hidden_states, self.in_proj.weight, self.in_proj.bias).transpose([0, 2, 1])
        if cache is None and self.pg is None:
            return mamba_inner_fn(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                                  self.out_proj.weight, self.out_proj.bias, self._A(), None, None,
                                  self.D.astype("float32"), delta_bias=self.dt_proj.bias.astype("float32"),
                                  delta_softplus=True, checkpoint_lvl=self.checkpoint_lvl, is_paddle_linear=True,
                                  backend=self.backend)
        x, z = xz.chunk(2, axis=1)
        if cache is not None:
            channels = (cache.conv_states[self.layer_idx].shape[1], cache.ssm_states[self.layer_idx].shape[1])
            if channels != (self.inner_local, self.inner_local):
                raise ValueError(f"cache_params: expected conv and ssm states of {self.inner_local} channels (this "
                                 f"rank's share of intermediate_size), got {channels}")
        if cache is not None and cache.seqlen_offset > 0:
            y = self._decode(x, z, cache)
        else:
            y = self._sequence(x, z, cache)
        y = y.transpose([0, 2, 1])
        if self.pg is None:
            return linear(y, self.out_proj.weight, self.out_proj.bias)
        out = comm.reduce_from_parallel(mm(y, self.out_proj.weight), self.pg)
        return add(out, self.out_proj.bias) if self.out_proj.bias is not None else out

    def _ssm_inputs(self, x_tokens):
        """x_tokens [..., inner] -> dt [..., inner] (before bias and softplus), B, C [..., state].
        Under model parallelism x_proj's partial products are summed over the ranks (forward), and
        so are the gradients of dt_low, B, C (backward)."""
        x_dbl = mm(x_tokens, self.x_proj.weight)
        if self.pg is not None:
            x_dbl = comm.copy_to_parallel(comm.reduce_from_parallel(x_dbl, self.pg), self.pg)
        rank, state = self.time_step_rank, self.ssm_state_size
        dt, B, C = paddle.split(x_dbl, [rank, state, state], axis=-1)
        return mm(dt, self.dt_proj.weight), B, C

    def _sequence(self, x, z, cache=None):
        """Conv, projections and scan over the whole sequence; x, z [batch, inner, seqlen]. With a
        cache, also writes this layer's conv and ssm states (prefill)."""
        width = self.conv_kernel_size
        if cache is not None:
            conv_state = cache.conv_states[self.layer_idx]
            history = F.pad(x, [width - x.shape[-1], 0], data_format="NCL") if x.shape[-1] < width else \
                x[:, :, x.shape[-1] - width:]
            paddle.assign(history.astype(conv_state.dtype), output=conv_state)
        x = causal_conv1d_fn(x, self._conv_weight(), self.conv1d.bias, activation=self.activation,
                             backend=self.backend)
        dt, B, C = self._ssm_inputs(x.transpose([0, 2, 1]))
        out = selective_scan_fn(x, dt.transpose([0, 2, 1]), self._A(), B.transpose([0, 2, 1]),
                                C.transpose([0, 2, 1]), self.D.astype("float32"), z,
                                self.dt_proj.bias.astype("float32"), delta_softplus=True,
                                return_last_state=cache is not None, backend=self.backend)
        if cache is None:
            return out
        y, last = out
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
