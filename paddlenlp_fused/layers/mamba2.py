"""Mamba-2 block (``mamba_ssm``'s ``Mamba2``) on paddlenlp_fused's ops.

Sublayers and parameters carry ``mamba_ssm``'s names and initialisation: ``in_proj`` (Linear
``[d_model, 2 * d_inner + 2 * ngroups * d_state + nheads]``), ``conv1d`` (depthwise Conv1D, weight
``[conv_dim, 1, d_conv]``), ``dt_bias``, ``A_log``, ``D`` ``[nheads]``, ``norm`` (gated RMSNorm over
groups of ``d_inner / ngroups``) and ``out_proj`` (Linear ``[d_inner, d_model]``). Linear weights use
Paddle's ``[in, out]`` layout (transpose torch checkpoints).

``forward(u [batch, seqlen, d_model], seq_idx=None, cu_seqlens=None, inference_params=None)``:

* without a cache: ``mamba_split_conv1d_scan_combined`` (training and plain inference); ``seq_idx``
  ``[batch, seqlen]`` or ``cu_seqlens`` ``[num_seqs + 1]`` (batch 1, packed) restart conv and scan;
* with ``inference_params`` (``Mamba2InferenceParams``, ``mamba_ssm``'s ``InferenceParams``) at
  ``seqlen_offset == 0``: the same output, and the layer's conv state (last ``d_conv`` inputs of the
  conv) and SSM state are written into the cache; at ``seqlen_offset > 0``: ``step`` token by token.
  The caller advances ``seqlen_offset`` (as ``mamba_ssm``'s generation loop does).

Model parallelism (heads sharded over fleet's model-parallel group) is not implemented yet.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle import nn

from ..ops.causal_conv1d import causal_conv1d_update
from ..ops.mamba2 import mamba2_state_update, mamba_split_conv1d_scan_combined
from ..ops.ssd import cu_seqlens_to_seq_idx
from .norm import GatedRMSNorm


class Mamba2InferenceParams:
    """The decoding cache of a stack: ``key_value_memory_dict[layer_idx] = (conv_state, ssm_state)``
    (``[batch, conv_dim, d_conv]`` and ``[batch, nheads, headdim, d_state]``) and the number of tokens
    already processed, ``seqlen_offset``."""

    def __init__(self, max_seqlen: int, max_batch_size: int):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        self.key_value_memory_dict = {}

    def reset(self, max_seqlen: int, max_batch_size: int):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        for conv_state, ssm_state in self.key_value_memory_dict.values():
            conv_state.zero_()
            ssm_state.zero_()


def _torch_default_uniform(fan_in):
    """torch's default Linear/Conv initialiser (kaiming uniform, a = sqrt(5)): U(-1/sqrt(fan_in), +)."""
    bound = 1.0 / math.sqrt(fan_in)
    return nn.initializer.Uniform(-bound, bound)


class Mamba2Block(nn.Layer):
    def __init__(self, d_model: int, d_state: int = 128, d_conv: int = 4, expand: int = 2, headdim: int = 64,
                 ngroups: int = 1, chunk_size: int = 256, A_init_range=(1, 16), dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4, dt_limit=(0.0, float("inf")), bias: bool = False,
                 conv_bias: bool = True, norm_before_gate: bool = False, layer_idx=None, backend: str = "auto",
                 process_group=None, sequence_parallel: bool = False):
        super().__init__()
        if process_group is not None or sequence_parallel:
            raise NotImplementedError("Mamba2Block: model/sequence parallelism (heads sharded over a process "
                                      "group) is not implemented yet; use process_group=None, "
                                      "sequence_parallel=False")
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(f"headdim: expected a divisor of expand * d_model = {d_inner}, got {headdim}")
        nheads = d_inner // headdim
        if ngroups < 1 or nheads % ngroups:
            raise ValueError(f"ngroups: expected a positive divisor of nheads = {nheads}, got {ngroups}")
        if not 0 < A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"A_init_range: expected 0 < low <= high, got {A_init_range}")
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner, self.headdim, self.nheads, self.ngroups = d_inner, headdim, nheads, ngroups
        self.chunk_size, self.dt_limit, self.layer_idx = chunk_size, tuple(dt_limit), layer_idx
        self.activation = "silu"
        self._backend = backend
        self.conv_dim = d_inner + 2 * ngroups * d_state
        d_in_proj = 2 * d_inner + 2 * ngroups * d_state + nheads

        self.in_proj = nn.Linear(d_model, d_in_proj, weight_attr=_torch_default_uniform(d_model),
                                 bias_attr=_torch_default_uniform(d_model) if bias else False)
        self.conv1d = nn.Conv1D(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1,
                                weight_attr=_torch_default_uniform(d_conv),
                                bias_attr=_torch_default_uniform(d_conv) if conv_bias else False)
        # dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (floored)
        dt = np.exp(np.random.rand(nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = np.maximum(dt, dt_init_floor)
        inv_dt = dt + np.log(-np.expm1(-dt))
        self.dt_bias = self._no_decay_param(inv_dt)
        self.A_log = self._no_decay_param(np.log(np.random.uniform(*A_init_range, size=nheads)))
        self.D = self._no_decay_param(np.ones(nheads))
        self.norm = GatedRMSNorm(d_inner, epsilon=1e-5, group_size=d_inner // ngroups,
                                 norm_before_gate=norm_before_gate, backend=backend)
        self.out_proj = nn.Linear(d_inner, d_model, weight_attr=_torch_default_uniform(d_inner),
                                  bias_attr=_torch_default_uniform(d_inner) if bias else False)

    def _no_decay_param(self, values):
        param = self.create_parameter([len(values)], dtype="float32",
                                      default_initializer=nn.initializer.Assign(values.astype(np.float32)))
        param.no_weight_decay = True  # mamba_ssm's _no_weight_decay: excluded by decay filters that read it
        return param

    def _A(self):
        return -paddle.exp(self.A_log.astype("float32"))

    def _conv_weight(self):
        return self.conv1d.weight.reshape([self.conv_dim, self.d_conv])

    def forward(self, u, seq_idx=None, cu_seqlens=None, inference_params=None):
        if u.ndim != 3 or u.shape[-1] != self.d_model:
            raise ValueError(f"u: expected [batch, seqlen, d_model={self.d_model}], got {list(u.shape)}")
        batch, seqlen, _ = u.shape
        if cu_seqlens is not None:
            if seq_idx is not None:
                raise ValueError("cu_seqlens: give either cu_seqlens or seq_idx, not both")
            bounds = cu_seqlens.numpy().astype(np.int64) if isinstance(cu_seqlens, paddle.Tensor) else None
            if batch != 1 or bounds is None or bounds.ndim != 1 or bounds.size < 2 or bounds[0] != 0 \
                    or bounds[-1] != seqlen or np.any(np.diff(bounds) < 1):
                raise ValueError(f"cu_seqlens: expected an int tensor of increasing offsets from 0 to seqlen={seqlen} "
                                 f"with u of batch 1, got {cu_seqlens!r} for u of shape {list(u.shape)}")
            seq_idx = cu_seqlens_to_seq_idx(bounds, seqlen)
        if inference_params is not None:
            if seq_idx is not None:
                raise NotImplementedError("Mamba2Block: an inference cache with packed sequences "
                                          "(seq_idx/cu_seqlens) is not implemented yet")
            conv_state, ssm_state = self._states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                return paddle.stack([self.step(u[:, t], conv_state, ssm_state) for t in range(seqlen)], axis=1)
            return self._prefill(u, conv_state, ssm_state)
        return mamba_split_conv1d_scan_combined(
            self.in_proj(u), self.conv1d.weight, self.conv1d.bias, self.dt_bias, self._A(), self.D,
            self.chunk_size, seq_idx=seq_idx, dt_limit=self.dt_limit, activation=self.activation,
            rmsnorm_weight=self.norm.weight, rmsnorm_eps=self.norm.eps, outproj_weight=self.out_proj.weight,
            outproj_bias=self.out_proj.bias, headdim=self.headdim, ngroups=self.ngroups,
            norm_before_gate=self.norm.norm_before_gate, backend=self._backend)

    def _prefill(self, u, conv_state, ssm_state):
        """The full forward that also fills this layer's cache (no packed sequences)."""
        zxbcdt = self.in_proj(u)
        xBC = zxbcdt[:, :, self.d_inner:self.d_inner + self.conv_dim].transpose([0, 2, 1])  # [b, conv_dim, l]
        seqlen = xBC.shape[-1]
        last = xBC[:, :, max(0, seqlen - self.d_conv):]  # mamba_ssm keeps the last d_conv conv inputs
        if last.shape[-1] < self.d_conv:
            last = paddle.concat([paddle.zeros([last.shape[0], self.conv_dim, self.d_conv - last.shape[-1]],
                                               dtype=last.dtype), last], axis=-1)
        out, final_states = mamba_split_conv1d_scan_combined(
            zxbcdt, self.conv1d.weight, self.conv1d.bias, self.dt_bias, self._A(), self.D, self.chunk_size,
            dt_limit=self.dt_limit, return_final_states=True, activation=self.activation,
            rmsnorm_weight=self.norm.weight, rmsnorm_eps=self.norm.eps, outproj_weight=self.out_proj.weight,
            outproj_bias=self.out_proj.bias, headdim=self.headdim, ngroups=self.ngroups,
            norm_before_gate=self.norm.norm_before_gate, backend=self._backend)
        paddle.assign(last.detach().astype(conv_state.dtype), output=conv_state)
        paddle.assign(final_states.detach().astype(ssm_state.dtype), output=ssm_state)
        return out

    def step(self, u, conv_state, ssm_state):
        """One decoding token: u ``[batch, d_model]`` (or ``[batch, 1, d_model]``); conv_state
        ``[batch, conv_dim, d_conv]`` and ssm_state ``[batch, nheads, headdim, d_state]`` updated in
        place. Returns ``[batch, d_model]`` (``[batch, 1, d_model]`` for a 3-axis u)."""
        squeeze = u.ndim == 3
        if squeeze:
            if u.shape[1] != 1:
                raise ValueError(f"u: step takes one token, got shape {list(u.shape)}")
            u = u[:, 0]
        if u.ndim != 2 or u.shape[-1] != self.d_model:
            raise ValueError(f"u: expected [batch, d_model={self.d_model}], got {list(u.shape)}")
        batch = u.shape[0]
        gdim = self.ngroups * self.d_state
        z, xBC, dt = paddle.split(self.in_proj(u), [self.d_inner, self.conv_dim, self.nheads], axis=-1)
        xBC = causal_conv1d_update(xBC, conv_state, self._conv_weight(), self.conv1d.bias, self.activation,
                                   backend=self._backend)
        x, B, C = paddle.split(xBC, [self.d_inner, gdim, gdim], axis=-1)
        y = mamba2_state_update(ssm_state, x.reshape([batch, self.nheads, self.headdim]), dt, self._A(),
                                B.reshape([batch, self.ngroups, self.d_state]),
                                C.reshape([batch, self.ngroups, self.d_state]), D=self.D, dt_bias=self.dt_bias,
                                dt_softplus=True, dt_limit=self.dt_limit)
        out = self.out_proj(self.norm(y.reshape([batch, self.d_inner]), z))
        return out[:, None] if squeeze else out

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int = None, dtype=None):
        """Zeroed ``(conv_state [batch, conv_dim, d_conv], ssm_state [batch, nheads, headdim, d_state])``
        in ``dtype`` (default: the conv weight's / in_proj weight's dtype). ``max_seqlen`` is unused:
        the states do not grow with the sequence."""
        conv_state = paddle.zeros([batch_size, self.conv_dim, self.d_conv],
                                  dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = paddle.zeros([batch_size, self.nheads, self.headdim, self.d_state],
                                 dtype=dtype or self.in_proj.weight.dtype)
        return conv_state, ssm_state

    def _states_from_cache(self, inference_params, batch):
        if self.layer_idx is None:
            raise ValueError("layer_idx: needed to use an inference cache (give each block its index)")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch, inference_params.max_seqlen)
        conv_state, ssm_state = cache[self.layer_idx]
        if conv_state.shape[0] != batch:
            raise ValueError(f"inference_params: cached states have batch {conv_state.shape[0]}, u has {batch}")
        return conv_state, ssm_state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_state={self.d_state}, d_conv={self.d_conv}, expand={self.expand}, "
                f"headdim={self.headdim}, ngroups={self.ngroups}, chunk_size={self.chunk_size}, "
                f"backend={self._backend}")
