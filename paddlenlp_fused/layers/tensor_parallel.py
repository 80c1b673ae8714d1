"""Tensor- and sequence-parallel linear layers and MLP over fleet's model-parallel group.

``ColumnParallelLinear`` and ``RowParallelLinear`` take the constructor arguments of
``paddle.distributed.fleet.meta_parallel``'s layers (plus ``sequence_parallel``, which makes them
PaddleNLP's ``ColumnSequenceParallelLinear`` / ``RowSequenceParallelLinear``) and hold the same
parameters: ``weight`` ``[in, out / n]`` (column, ``split_axis`` 1) or ``[in / n, out]`` (row,
``split_axis`` 0), ``bias`` ``[out / n]`` (column, sharded) or ``[out]`` (row, replicated), so those
layers' state dicts load. Sharded weights are initialised under fleet's model-parallel RNG state when
the tracker has one. With no ``fleet.init`` or one model-parallel rank they are single-process
layers that issue no collective.

Sequence parallel (axis 0 of the activations is the sequence axis, split over the ranks): the column
layer all-gathers its input inside the fused GEMM call, the row layer reduce-scatters its output.
The row layer's bias (replicated, its gradient a partial sum on each rank) is marked
``sequence_parallel``; as in PaddleNLP, the trainer all-reduces such gradients
(``allreduce_sequence_parallel_grads``).

``ParallelFusedMLP``: a column ``fc1`` and a row ``fc2`` computed by one ``fused_mlp_func`` call. For
swiglu / geglu each rank's fc1 shard is ``[gate shard | up shard]`` (PaddleNLP's fused gate-up
layout under tensor parallelism).
"""

from __future__ import annotations

import contextlib

import paddle
import paddle.distributed as dist
import paddle.nn as nn

from ..distributed import comm
from ..ops._pylayer import add
from ..ops.fused_dense import GATED, check_mlp_options, fused_dense_func, fused_mlp_func
from . import _args
from .fused_dense import fused_dense_options


def _model_parallel(mp_group):
    """Our ParallelGroup for ``mp_group`` (default: fleet's model-parallel group), None for one rank."""
    return comm.as_parallel_group(mp_group) if mp_group is not None else comm.model_parallel_group()


def _check_divisible(name: str, size: int, pg) -> int:
    world = pg.world_size if pg is not None else 1
    if size % world:
        raise ValueError(f"{name}: {size} does not divide by the model-parallel size {world}")
    return size // world


def _sharded_init(pg):
    """Fleet's model-parallel RNG state for initialising shards (distinct per rank), when set up."""
    from paddle.distributed.fleet.layers.mpu.random import MODEL_PARALLEL_RNG, get_rng_state_tracker

    tracker = get_rng_state_tracker()
    if pg is not None and MODEL_PARALLEL_RNG in tracker.states_:
        return tracker.rng_state(MODEL_PARALLEL_RNG)
    return contextlib.nullcontext()


def _create_weight(layer, shape, attr, pg, split_axis):
    with _sharded_init(pg):
        weight = layer.create_parameter(shape=shape, attr=attr, dtype=layer._helper.get_default_dtype(),
                                        is_bias=False)
    weight.is_distributed = pg is not None
    if pg is not None:
        weight.split_axis = split_axis
    return weight


def _create_bias(layer, size, pg, split):
    bias = layer.create_parameter(shape=[size], attr=paddle.nn.initializer.Constant(value=0.0),
                                  dtype=layer._helper.get_default_dtype(), is_bias=True)
    bias.is_distributed = split and pg is not None
    if bias.is_distributed:
        bias.split_axis = 0
    return bias


class ColumnParallelLinear(nn.Layer):
    """y = x @ W + b with W's output columns split over the model-parallel ranks.

    x is replicated (``sequence_parallel=False``; its gradient is all-reduced) or this rank's rows
    of the sequence (all-gathered inside the fused call). The output is this rank's columns, or all
    of them with ``gather_output``. ``fuse_matmul_bias`` is accepted for fleet compatibility: the bias
    is always fused into the GEMM.
    """

    def __init__(self, in_features, out_features, weight_attr=None, has_bias=None, gather_output=True,
                 fuse_matmul_bias=False, mp_group=None, name=None, sequence_parallel=False, backend="auto"):
        super().__init__()
        in_features = _args.positive_int("in_features", in_features)
        out_features = _args.positive_int("out_features", out_features)
        _args.backend(backend)
        self.pg = _model_parallel(mp_group)
        if sequence_parallel and gather_output:
            raise ValueError("gather_output: must be False with sequence_parallel (the output stays split "
                             "over the features, as in PaddleNLP's ColumnSequenceParallelLinear)")
        self.in_features = in_features
        self.out_features = out_features
        self.output_size_per_partition = _check_divisible("out_features", out_features, self.pg)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.fuse_matmul_bias = fuse_matmul_bias
        self.backend = backend
        self._name = name
        self.weight = _create_weight(self, [in_features, self.output_size_per_partition], weight_attr, self.pg, 1)
        self.bias = _create_bias(self, self.output_size_per_partition, self.pg, split=True) if has_bias else None

    def forward(self, x):
        out = fused_dense_func(x, self.weight, self.bias, process_group=self.pg,
                               sequence_parallel=self.sequence_parallel, backend=self.backend)
        if self.gather_output and self.pg is not None:
            out = comm.gather_last_axis(out, self.pg)
        return out


class RowParallelLinear(nn.Layer):
    """y = x @ W + b with W's input rows split over the model-parallel ranks.

    x is this rank's features (``input_is_parallel``) or replicated and split here. The partial
    products are all-reduced, or reduce-scattered over the sequence axis with ``sequence_parallel``
    (which needs ``input_is_parallel``); the replicated bias is added after the reduction.
    """

    def __init__(self, in_features, out_features, weight_attr=None, has_bias=True, input_is_parallel=False,
                 fuse_matmul_bias=False, mp_group=None, name=None, sequence_parallel=False, backend="auto"):
        super().__init__()
        in_features = _args.positive_int("in_features", in_features)
        out_features = _args.positive_int("out_features", out_features)
        _args.backend(backend)
        self.pg = _model_parallel(mp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("input_is_parallel: must be True with sequence_parallel (as in PaddleNLP's "
                             "RowSequenceParallelLinear)")
        self.in_features = in_features
        self.out_features = out_features
        self.input_size_per_partition = _check_divisible("in_features", in_features, self.pg)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.fuse_matmul_bias = fuse_matmul_bias
        self.backend = backend
        self._name = name
        self.weight = _create_weight(self, [self.input_size_per_partition, out_features], weight_attr, self.pg, 0)
        self.bias = _create_bias(self, out_features, self.pg, split=False) if has_bias else None
        if self.bias is not None and sequence_parallel and self.pg is not None:
            self.bias.sequence_parallel = True

    def forward(self, x):
        if self.pg is None:
            return fused_dense_func(x, self.weight, self.bias, backend=self.backend)
        if not self.input_is_parallel:
            x = comm.split_last_axis(x, self.pg)
        out = fused_dense_func(x, self.weight, backend=self.backend)
        out = comm.reduce_scatter_sequence(out, self.pg) if self.sequence_parallel else \
            comm.reduce_from_parallel(out, self.pg)
        return add(out, self.bias) if self.bias is not None else out  # add: no 16-bit CPU kernel


class ParallelFusedMLP(nn.Layer):
    """``fc2(act(fc1(x)))`` with fc1 a ``ColumnParallelLinear`` and fc2 a ``RowParallelLinear``
    (state-dict keys ``fc1.weight``, ``fc1.bias``, ``fc2.weight``, ``fc2.bias``), computed by one
    ``fused_mlp_func`` call: with ``sequence_parallel`` the input all-gather and the output
    reduce-scatter happen inside it. ``hidden_features`` (default ``4 * in_features``) must divide by
    the model-parallel size."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation="gelu_approx",
                 bias1=True, bias2=True, sequence_parallel=False, checkpoint_lvl=0, heuristic="auto",
                 weight_attr=None, mp_group=None, backend="auto"):
        super().__init__()
        check_mlp_options(activation, checkpoint_lvl)
        fused_dense_options(heuristic)
        in_features = _args.positive_int("in_features", in_features)
        hidden_features = _args.positive_int("hidden_features", hidden_features, optional=True) or 4 * in_features
        out_features = _args.positive_int("out_features", out_features, optional=True) or in_features
        _args.backend(backend)
        self.pg = _model_parallel(mp_group)
        _check_divisible("hidden_features", hidden_features, self.pg)
        gated = activation in GATED
        self.fc1 = ColumnParallelLinear(in_features, (2 if gated else 1) * hidden_features, weight_attr=weight_attr,
                                        has_bias=bias1, gather_output=False, mp_group=mp_group,
                                        sequence_parallel=sequence_parallel, backend=backend)
        self.fc2 = RowParallelLinear(hidden_features, out_features, weight_attr=weight_attr, has_bias=bias2,
                                     input_is_parallel=True, mp_group=mp_group, sequence_parallel=sequence_parallel,
                                     backend=backend)
        self.activation = activation
        self.sequence_parallel = sequence_parallel
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic
        self.backend = backend

    def forward(self, x):
        return fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                              activation=self.activation, checkpoint_lvl=self.checkpoint_lvl,
                              heuristic=self.heuristic, process_group=self.pg,
                              sequence_parallel=self.sequence_parallel, backend=self.backend)


def allreduce_sequence_parallel_grads(layer: nn.Layer, mp_group=None) -> None:
    """All-reduce over the model-parallel group the gradients of ``layer``'s parameters marked
    ``sequence_parallel`` (replicated parameters applied to sequence shards: each rank holds a partial
    sum), what PaddleNLP's ``register_sequence_parallel_allreduce_hooks`` does. Call after backward."""
    pg = _model_parallel(mp_group)
    if pg is None:
        return
    for param in layer.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=pg.group, sync_op=True)
