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

Model parallelism (``process_group``, default fleet's model-parallel group; none without
``fleet.init`` or with one rank): the heads are sharded over the ranks, ``nheads / world`` each.
Every parameter holds this rank's shard and is marked ``is_distributed`` / ``split_axis`` as fleet's
layers mark theirs:

* ``in_proj`` column-parallel, ``split_axis`` 1, each segment split on its own: the local weight is
  ``[z_r | x_r | B_r | C_r | dt_r]``. B and C are sharded by groups when ``ngroups`` divides by the
  world size; with ``ngroups == 1`` they are replicated, and then held apart: ``in_proj.weight`` is
  ``[z_r | x_r | dt_r]`` and the B/C columns are ``in_proj.weight_bc`` (``in_proj.bias_bc``), not
  marked ``is_distributed``, the same on every rank, their gradients all-reduced (each rank's heads
  contribute a part), so fleet's global-norm clip counts them once, as it counts every parameter
  marked ``is_distributed`` as all shards; other group counts raise.
* ``conv1d`` (``[x_r | B_r | C_r]`` channels; with replicated B/C, ``[x_r]`` and the replicated
  ``conv1d.weight_bc`` / ``conv1d.bias_bc``), ``dt_bias``, ``A_log``, ``D``, ``norm.weight``:
  ``split_axis`` 0, sharded with their heads.
* the gated norm per shard when its groups (``d_inner / ngroups`` columns) lie inside a shard;
  with ``ngroups == 1`` the mean square is all-reduced over the ranks (``norm_before_gate=False``,
  ``mamba_ssm``'s default; ``True`` raises), so the block equals the dense one either way.
* ``out_proj`` row-parallel (``split_axis`` 0): the partial outputs are all-reduced, or with
  ``sequence_parallel=True`` reduce-scattered along the sequence. Its bias is replicated (marked
  ``sequence_parallel`` then: all-reduce its gradient as for PaddleNLP's sequence-parallel
  parameters, ``allreduce_sequence_parallel_grads``).

With ``sequence_parallel=True`` the block's input and output are this rank's slice of the sequence
in sequence-first layout ``[seqlen / world, batch, d_model]`` (PaddleNLP's sequence-parallel axis 0);
the input is all-gathered along the sequence before ``in_proj`` (``seq_idx`` / ``cu_seqlens`` then
describe the whole gathered sequence). Without it they are the replicated ``[batch, seqlen, d_model]``.
``set_dense_state_dict`` loads a dense block's weights into the shards (and the ``_bc`` parameters).
Decoding (``inference_params`` / ``step``) works under model parallelism on this rank's heads, not
with sequence parallel.
``checkpoint_lvl`` goes to ``mamba_split_conv1d_scan_combined``.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..distributed import comm
from ..ops.causal_conv1d import causal_conv1d_update
from ..ops._pylayer import add, mm
from ..ops.mamba2 import IMPLEMENTED, mamba2_state_update, mamba_split_conv1d_scan_combined
from ..ops.ssd import cu_seqlens_to_seq_idx
from ..runtime.backend import BACKENDS, BackendUnavailableError
from . import _args
from .mamba import linear, mark_sharded, take_shards
from .norm import GatedRMSNorm
from .tensor_parallel import _check_divisible, _model_parallel, _sharded_init


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
                 process_group=None, sequence_parallel: bool = False, checkpoint_lvl: int = 1):
        super().__init__()
        for name, size in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv), ("expand", expand),
                           ("headdim", headdim), ("ngroups", ngroups), ("chunk_size", chunk_size)):
            _args.positive_int(name, size)
        low_dt = _args.real("dt_min", dt_min, low=0.0, low_open=True)
        _args.real("dt_max", dt_max, low=low_dt)
        _args.real("dt_init_floor", dt_init_floor, low=0.0)
        if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2 or isinstance(dt_limit[0], bool) \
                or not all(isinstance(v, (int, float)) for v in dt_limit) or not 0.0 <= dt_limit[0] <= dt_limit[1]:
            raise ValueError(f"dt_limit: expected (low, high) with 0 <= low <= high, got {dt_limit!r}")
        if layer_idx is not None:
            _args.nonnegative_int("layer_idx", layer_idx)
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(f"headdim: expected a divisor of expand * d_model = {d_inner}, got {headdim}")
        nheads = d_inner // headdim
        if ngroups < 1 or nheads % ngroups:
            raise ValueError(f"ngroups: expected a positive divisor of nheads = {nheads}, got {ngroups}")
        if not 0 < A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"A_init_range: expected 0 < low <= high, got {A_init_range}")
        if isinstance(checkpoint_lvl, bool) or checkpoint_lvl not in (0, 1):
            raise ValueError(f"checkpoint_lvl: expected 0 or 1, got {checkpoint_lvl!r}")
        if backend not in ("auto",) + BACKENDS:
            raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {backend!r}")
        if backend != "auto" and backend not in IMPLEMENTED:  # the ops' own error, at construction not forward
            raise BackendUnavailableError(f"Mamba2Block: no {backend!r} implementation; its ops have {list(IMPLEMENTED)}")
        self.pg = pg = _model_parallel(process_group)
        world, rank = (pg.world_size, pg.rank) if pg is not None else (1, 0)
        if sequence_parallel and pg is None:
            sequence_parallel = False  # one rank: the whole sequence is local
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner, self.headdim, self.nheads, self.ngroups = d_inner, headdim, nheads, ngroups
        self.chunk_size, self.dt_limit, self.layer_idx = chunk_size, tuple(dt_limit), layer_idx
        self.sequence_parallel, self.checkpoint_lvl = sequence_parallel, checkpoint_lvl
        self.activation = "silu"
        self._backend = backend
        # this rank's sizes (all of them with one rank)
        self.nheads_local = _check_divisible("nheads", nheads, pg)
        self.d_inner_local = self.nheads_local * headdim
        self.bc_replicated = world > 1 and ngroups % world != 0
        if self.bc_replicated and ngroups != 1:
            raise ValueError(f"ngroups: under model parallelism expected 1 or a multiple of the world size {world}, "
                             f"got {ngroups}")
        self.ngroups_local = ngroups if self.bc_replicated else ngroups // world
        # the norm's groups span the shards exactly when B/C are replicated (ngroups 1, world > 1)
        self.norm_spans_ranks = self.bc_replicated
        if self.norm_spans_ranks and norm_before_gate:
            raise NotImplementedError("Mamba2Block: norm_before_gate=True with ngroups=1 under model parallelism "
                                      "(a norm group spanning the ranks) is not implemented; use "
                                      "norm_before_gate=False or ngroups divisible by the world size")
        bc_width = 2 * self.ngroups_local * d_state
        self.conv_dim = self.d_inner_local + bc_width
        # replicated B/C live in parameters of their own (below), so every is_distributed one is all shards
        own_bc = 0 if self.bc_replicated else bc_width
        d_in_proj = 2 * self.d_inner_local + own_bc + self.nheads_local

        with _sharded_init(pg):
            self.in_proj = nn.Linear(d_model, d_in_proj, weight_attr=_torch_default_uniform(d_model),
                                     bias_attr=_torch_default_uniform(d_model) if bias else False)
            conv_channels = self.d_inner_local + own_bc
            self.conv1d = nn.Conv1D(conv_channels, conv_channels, d_conv, groups=conv_channels, padding=d_conv - 1,
                                    weight_attr=_torch_default_uniform(d_conv),
                                    bias_attr=_torch_default_uniform(d_conv) if conv_bias else False)
            self.out_proj = nn.Linear(self.d_inner_local, d_model, weight_attr=_torch_default_uniform(d_inner),
                                      bias_attr=False)
        if self.bc_replicated:  # drawn outside the model-parallel RNG, made the source rank's below
            self.in_proj.weight_bc = self.in_proj.create_parameter(
                [d_model, bc_width], attr=_torch_default_uniform(d_model), dtype=self.in_proj.weight.dtype)
            self.in_proj.bias_bc = self.in_proj.create_parameter(
                [bc_width], attr=_torch_default_uniform(d_model), dtype=self.in_proj.weight.dtype,
                is_bias=True) if bias else None
            self.conv1d.weight_bc = self.conv1d.create_parameter(
                [bc_width, 1, d_conv], attr=_torch_default_uniform(d_conv), dtype=self.conv1d.weight.dtype)
            self.conv1d.bias_bc = self.conv1d.create_parameter(
                [bc_width], attr=_torch_default_uniform(d_conv), dtype=self.conv1d.weight.dtype,
                is_bias=True) if conv_bias else None
        # the replicated out_proj bias: drawn outside the model-parallel RNG, made the source rank's below
        if bias:
            self.out_proj.bias = self.out_proj.create_parameter(
                [d_model], attr=_torch_default_uniform(d_inner), dtype=self.out_proj.weight.dtype, is_bias=True)
        # dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (floored); drawn for all heads
        # from the global RNG (the same on every rank), each rank keeping its heads
        heads = slice(rank * self.nheads_local, (rank + 1) * self.nheads_local)
        dt = np.exp(np.random.rand(nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = np.maximum(dt, dt_init_floor)
        inv_dt = dt + np.log(-np.expm1(-dt))
        self.dt_bias = self._no_decay_param(inv_dt[heads])
        self.A_log = self._no_decay_param(np.log(np.random.uniform(*A_init_range, size=nheads))[heads])
        self.D = self._no_decay_param(np.ones(nheads)[heads])
        group_size = d_inner // ngroups
        self.norm = GatedRMSNorm(self.d_inner_local, epsilon=1e-5,
                                 group_size=self.d_inner_local if self.norm_spans_ranks else group_size,
                                 norm_before_gate=norm_before_gate, backend=backend)
        if pg is not None:
            mark_sharded(self.in_proj.weight, 1)
            for param in (self.in_proj.bias, self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D,
                          self.norm.weight, self.out_proj.weight):
                mark_sharded(param, 0)
            if self.out_proj.bias is not None:
                with paddle.no_grad():
                    comm.broadcast_from_src(self.out_proj.bias, pg)
                self.out_proj.bias.sequence_parallel = sequence_parallel
            for param in self._replicated_bc_params():
                param.is_distributed = False
                with paddle.no_grad():
                    comm.broadcast_from_src(param, pg)

    # ------------------------------------------------------------------------------------------
    # model-parallel bookkeeping

    def _replicated_bc_params(self):
        """The parameters of the replicated B/C columns of in_proj and channels of conv1d (ngroups not
        sharded over the ranks): not ``is_distributed``, the same on every rank, their gradients
        all-reduced (each rank's heads add a part). Empty otherwise."""
        if not self.bc_replicated:
            return []
        return [p for p in (self.in_proj.weight_bc, self.in_proj.bias_bc, self.conv1d.weight_bc, self.conv1d.bias_bc)
                if p is not None]

    def _local_weights(self):
        """(in_proj weight ``[d_model, z | x | B | C | dt]``, its bias, conv weight ``[x | B | C, 1, d_conv]``,
        its bias) as this rank's forward uses them: with replicated B/C, the sharded parameters with the
        replicated ones spliced in through copy_to_parallel (identity forward, all-reduce backward)."""
        w_in, b_in, conv_w, conv_b = self.in_proj.weight, self.in_proj.bias, self.conv1d.weight, self.conv1d.bias
        if not self.bc_replicated:
            return w_in, b_in, conv_w, conv_b
        cut = 2 * self.d_inner_local  # z and x before B/C, dt after

        def splice(sharded, replicated, axis, at):
            if sharded is None:
                return None
            shared = comm.copy_to_parallel(replicated, self.pg)
            if at is None:
                return paddle.concat([sharded, shared], axis=axis)
            head, tail = paddle.split(sharded, [at, sharded.shape[axis] - at], axis=axis)
            return paddle.concat([head, shared, tail], axis=axis)

        return (splice(w_in, self.in_proj.weight_bc, 1, cut), splice(b_in, self.in_proj.bias_bc, 0, cut),
                splice(conv_w, self.conv1d.weight_bc, 0, None), splice(conv_b, self.conv1d.bias_bc, 0, None))

    def set_dense_state_dict(self, state_dict):
        """Load a dense (one-rank) block's parameters, keeping this rank's shards. ``state_dict``
        maps the dense names to tensors or arrays; the dense block must have this block's options."""
        self.set_state_dict(self.dense_to_local(state_dict))

    def dense_to_local(self, state_dict):
        """This rank's part of a dense block's state dict (or of its gradients), as numpy arrays."""
        if self.pg is None:
            return take_shards(state_dict, {name: (0, None) for name in state_dict})
        rank, h_l, n = self.pg.rank, self.nheads_local, self.d_state
        di, di_l, g_l = self.d_inner, self.d_inner_local, self.ngroups_local
        heads = np.arange(rank * h_l, (rank + 1) * h_l)
        chans = np.arange(rank * di_l, (rank + 1) * di_l)
        groups = np.arange(self.ngroups) if self.bc_replicated else np.arange(rank * g_l, (rank + 1) * g_l)
        bc = (groups[:, None] * n + np.arange(n)[None, :]).reshape(-1)
        gdim = self.ngroups * n
        bc_cols = np.concatenate([2 * di + bc, 2 * di + gdim + bc])
        bc_rows = np.concatenate([di + bc, di + gdim + bc])
        if self.bc_replicated:  # B/C in their own parameters: the sharded ones hold z, x, dt and x's channels
            in_cols = np.concatenate([chans, di + chans, 2 * di + 2 * gdim + heads])
            conv_rows = chans
        else:
            in_cols = np.concatenate([chans, di + chans, bc_cols, 2 * di + 2 * gdim + heads])
            conv_rows = np.concatenate([chans, bc_rows])
        local = take_shards(state_dict, {
            "in_proj.weight": (1, in_cols), "in_proj.bias": (0, in_cols), "conv1d.weight": (0, conv_rows),
            "conv1d.bias": (0, conv_rows), "dt_bias": (0, heads), "A_log": (0, heads), "D": (0, heads),
            "norm.weight": (0, chans), "out_proj.weight": (0, chans), "out_proj.bias": (0, None)})
        if self.bc_replicated:
            for name, axis, index in (("in_proj.weight", 1, bc_cols), ("in_proj.bias", 0, bc_cols),
                                      ("conv1d.weight", 0, bc_rows), ("conv1d.bias", 0, bc_rows)):
                if name in state_dict:
                    local[name + "_bc"] = take_shards({name: state_dict[name]}, {name: (axis, index)})[name]
        return local

    # ------------------------------------------------------------------------------------------

    def _no_decay_param(self, values):
        param = self.create_parameter([len(values)], dtype="float32",
                                      default_initializer=nn.initializer.Assign(values.astype(np.float32)))
        # excluded from weight decay by filters that read mamba_ssm's mark (as MambaMixer's A_log, D), and
        # by ours that read the older no_weight_decay (examples/train_mamba2.py)
        param._no_weight_decay = True
        param.no_weight_decay = True
        return param

    def _A(self):
        return -paddle.exp(self.A_log.astype("float32"))

    def _conv_weight(self, weight):
        return weight.reshape([self.conv_dim, self.d_conv])

    def _norm_across_ranks(self, y):
        """``rmsnorm(y) * weight`` over all d_inner columns of the ranks (y already gated): the sum of
        squares is all-reduced forward and backward (every rank's columns depend on it)."""
        yf = y.astype("float32")
        sq = comm.reduce_from_parallel((yf * yf).sum(axis=-1, keepdim=True), self.pg)
        sq = comm.copy_to_parallel(sq, self.pg)
        normed = yf * paddle.rsqrt(sq / self.d_inner + self.norm.eps) * self.norm.weight.astype("float32")
        return normed.astype(y.dtype)

    def _sequence(self, u, seq_idx=None, return_final_states=False):
        """The block on a whole sequence: u ``[batch, seqlen, d_model]`` (replicated; with sequence
        parallel the gathered, transposed input). Returns (out before the reduction and out_proj's
        bias, zxbcdt, final states or None)."""
        w_in, b_in, conv_w, conv_b = self._local_weights()
        zxbcdt = linear(u, w_in, b_in)
        common = dict(seq_idx=seq_idx, dt_limit=self.dt_limit, return_final_states=return_final_states,
                      activation=self.activation, headdim=self.headdim, ngroups=self.ngroups_local,
                      checkpoint_lvl=self.checkpoint_lvl, backend=self._backend)
        if self.norm_spans_ranks:  # the gated y from the op, the norm and projection here
            res = mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, self.dt_bias, self._A(), self.D,
                                                   self.chunk_size, **common)
            y, final_states = res if return_final_states else (res, None)
            out = mm(self._norm_across_ranks(y), self.out_proj.weight)
        else:
            res = mamba_split_conv1d_scan_combined(
                zxbcdt, conv_w, conv_b, self.dt_bias, self._A(), self.D, self.chunk_size,
                rmsnorm_weight=self.norm.weight, rmsnorm_eps=self.norm.eps, outproj_weight=self.out_proj.weight,
                norm_before_gate=self.norm.norm_before_gate, **common)
            out, final_states = res if return_final_states else (res, None)
        return out, zxbcdt, final_states

    def _finish(self, partial, sequence_parallel=False):
        """Sum the ranks' partial outputs (all-reduce, or reduce-scatter along axis 0) and add the bias."""
        if self.pg is not None:
            partial = comm.reduce_scatter_sequence(partial, self.pg) if sequence_parallel else \
                comm.reduce_from_parallel(partial, self.pg)
        return add(partial, self.out_proj.bias) if self.out_proj.bias is not None else partial

    def forward(self, u, seq_idx=None, cu_seqlens=None, inference_params=None):
        if u.ndim != 3 or u.shape[-1] != self.d_model:
            layout = "[seqlen / world, batch" if self.sequence_parallel else "[batch, seqlen"
            raise ValueError(f"u: expected {layout}, d_model={self.d_model}], got {list(u.shape)}")
        if self.sequence_parallel:
            if inference_params is not None:
                raise NotImplementedError("Mamba2Block: decoding (inference_params) with sequence_parallel=True is "
                                          "not implemented; build the block without sequence parallel to decode")
            u = comm.all_gather_sequence(u, self.pg).transpose([1, 0, 2])  # [batch, seqlen, d_model]
        elif self.pg is not None:
            u = comm.copy_to_parallel(u, self.pg)
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
        out, _, _ = self._sequence(u, seq_idx)
        if self.sequence_parallel:
            return self._finish(out.transpose([1, 0, 2]), sequence_parallel=True)
        return self._finish(out)

    def _prefill(self, u, conv_state, ssm_state):
        """The full forward that also fills this layer's cache (no packed sequences)."""
        out, zxbcdt, final_states = self._sequence(u, return_final_states=True)
        xBC = zxbcdt[:, :, self.d_inner_local:self.d_inner_local + self.conv_dim].transpose([0, 2, 1])
        seqlen = xBC.shape[-1]
        last = xBC[:, :, max(0, seqlen - self.d_conv):]  # mamba_ssm keeps the last d_conv conv inputs
        if last.shape[-1] < self.d_conv:
            last = paddle.concat([paddle.zeros([last.shape[0], self.conv_dim, self.d_conv - last.shape[-1]],
                                               dtype=last.dtype), last], axis=-1)
        paddle.assign(last.detach().astype(conv_state.dtype), output=conv_state)
        paddle.assign(final_states.detach().astype(ssm_state.dtype), output=ssm_state)
        return self._finish(out)

    def step(self, u, conv_state, ssm_state):
        """One decoding token: u ``[batch, d_model]`` (or ``[batch, 1, d_model]``), replicated over the
        ranks; conv_state ``[batch, conv_dim, d_conv]`` and ssm_state ``[batch, nheads, headdim,
        d_state]`` (this rank's channels and heads) updated in place. Returns ``[batch, d_model]``
        (``[batch, 1, d_model]`` for a 3-axis u)."""
        squeeze = u.ndim == 3
        if squeeze:
            if u.shape[1] != 1:
                raise ValueError(f"u: step takes one token, got shape {list(u.shape)}")
            u = u[:, 0]
        if u.ndim != 2 or u.shape[-1] != self.d_model:
            raise ValueError(f"u: expected [batch, d_model={self.d_model}], got {list(u.shape)}")
        batch = u.shape[0]
        gdim = self.ngroups_local * self.d_state
        w_in, b_in, conv_w, conv_b = self._local_weights()
        z, xBC, dt = paddle.split(linear(u, w_in, b_in), [self.d_inner_local, self.conv_dim, self.nheads_local],
                                  axis=-1)
        xBC = causal_conv1d_update(xBC, conv_state, self._conv_weight(conv_w), conv_b, self.activation,
                                   backend=self._backend)
        x, B, C = paddle.split(xBC, [self.d_inner_local, gdim, gdim], axis=-1)
        y = mamba2_state_update(ssm_state, x.reshape([batch, self.nheads_local, self.headdim]), dt, self._A(),
                                B.reshape([batch, self.ngroups_local, self.d_state]),
                                C.reshape([batch, self.ngroups_local, self.d_state]), D=self.D, dt_bias=self.dt_bias,
                                dt_softplus=True, dt_limit=self.dt_limit, backend=self._backend)
        y = y.reshape([batch, self.d_inner_local])
        if self.norm_spans_ranks:
            y = self._norm_across_ranks(y * F.silu(z.astype("float32")).astype(y.dtype))
        else:
            y = self.norm(y, z)
        out = self._finish(mm(y, self.out_proj.weight))
        return out[:, None] if squeeze else out

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int = None, dtype=None):
        """Zeroed ``(conv_state [batch, conv_dim, d_conv], ssm_state [batch, nheads, headdim, d_state])``
        (this rank's channels and heads) in ``dtype`` (default: the conv weight's / in_proj weight's
        dtype). ``max_seqlen`` is unused: the states do not grow with the sequence."""
        conv_state = paddle.zeros([batch_size, self.conv_dim, self.d_conv],
                                  dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = paddle.zeros([batch_size, self.nheads_local, self.headdim, self.d_state],
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
                f"backend={self._backend}, model_parallel={self.pg.world_size if self.pg else 1}, "
                f"sequence_parallel={self.sequence_parallel}")
