"""Tensor- and sequence-parallel pieces of the PaddleNLP swap (used by ``integrations.paddlenlp``).

A PaddleNLP model built with ``tensor_parallel_degree > 1`` holds fleet's ``ColumnParallelLinear`` /
``RowParallelLinear`` (``ColumnSequenceParallelLinear`` / ``RowSequenceParallelLinear`` with
``sequence_parallel``) and ``VocabParallelEmbedding``, each owning this rank's shard. Here they become
ours, owning the very same shard ``Parameter`` objects (so fleet's marks ``is_distributed``,
``split_axis`` and ``sequence_parallel`` travel along and the state dict keeps its keys):

- ``parallel_linear(old)``: our ``layers.tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear``
  over the group the fleet layer was built on, with the fleet layer's ``gather_output`` /
  ``input_is_parallel`` and ``sequence_parallel`` for the sequence-parallel classes;
- ``VocabParallelEmbedding(old)``: the same lookup (rows ``[rank * V/n, (rank + 1) * V/n)`` here, others
  0, summed over the group) on our comm ops. Fleet's own runs ``c_embedding`` and a calc-stream
  all-reduce, which have no CPU kernel / are rejected by gloo; this one also runs there.

``parallel_logits`` is the LM head's logits under tensor / sequence parallelism on our comm ops (fleet's
``parallel_matmul`` uses ``c_identity`` / ``c_concat``, no CPU kernels), used when the swapped head is
called without labels.
"""

from __future__ import annotations

import contextlib

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..distributed import comm
from ..layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def fleet_classes():
    """(column classes, row classes, sequence-parallel classes, embedding classes) of fleet, as
    PaddleNLP 3.0.0b4 builds them. Its refined-recompute ``RR*`` variants are subclasses and are
    swapped too; their recompute-skipping policy is then not kept."""
    from paddle.distributed.fleet import meta_parallel as mpu
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    column = (mpu.ColumnParallelLinear, spu.ColumnSequenceParallelLinear)
    row = (mpu.RowParallelLinear, spu.RowSequenceParallelLinear)
    sequence = (spu.ColumnSequenceParallelLinear, spu.RowSequenceParallelLinear)
    return column, row, sequence, (mpu.VocabParallelEmbedding,)


@contextlib.contextmanager
def _rng_preserved():
    """Our constructors draw an initial weight that the swap then replaces: put the global and fleet's
    model-parallel RNG states back, so a swap leaves every later draw (dropout, init) unchanged."""
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    tracker = get_rng_state_tracker()
    state, tracked = paddle.get_rng_state(), tracker.get_states_tracker()
    try:
        yield
    finally:
        paddle.set_rng_state(state)
        tracker.set_states_tracker(tracked)


def _group(old):
    return getattr(old, "model_parallel_group", None)


def parallel_linear(old: nn.Layer, backend: str = "auto"):
    """Our Column/RowParallelLinear owning ``old``'s shard parameters, or the reason it cannot.

    ``old``: fleet's column layer (weight ``[in, out / n]``, bias ``[out / n]``) or row layer (weight
    ``[in / n, out]``, bias ``[out]``)."""
    column, row, sequence, _ = fleet_classes()
    sequence_parallel = isinstance(old, sequence)
    group = _group(old)
    world = group.nranks if group is not None else 1
    has_bias = getattr(old, "bias", None) is not None
    with _rng_preserved():
        if isinstance(old, column):
            fan_in, local_out = old.weight.shape
            new = ColumnParallelLinear(fan_in, local_out * world, has_bias=has_bias,
                                       gather_output=bool(old.gather_output), mp_group=group,
                                       sequence_parallel=sequence_parallel, backend=backend)
        elif isinstance(old, row):
            if sequence_parallel and not old.input_is_parallel:
                return "input_is_parallel=False with sequence parallel"
            new = RowParallelLinear(old.in_features, old.out_features, has_bias=has_bias,
                                    input_is_parallel=bool(old.input_is_parallel), mp_group=group,
                                    sequence_parallel=sequence_parallel, backend=backend)
        else:
            return f"{type(old).__name__} is not a fleet parallel linear"
    if list(new.weight.shape) != list(old.weight.shape):
        return f"weight {list(old.weight.shape)} does not match our layer's {list(new.weight.shape)}"
    new.weight = old.weight
    if has_bias:
        new.bias = old.bias
    return new


class VocabParallelEmbedding(nn.Layer):
    """fleet's ``VocabParallelEmbedding`` (same ``weight`` shard ``[V / n, hidden]``) on our comm ops.

    ids ``[...]`` (global vocabulary ids) -> ``[..., hidden]``: each rank looks up the ids in its rows
    (zero for the others) and the group sums them (``reduce_from_parallel``: forward all-reduce,
    backward identity, so each rank's weight gradient holds its own rows)."""

    def __init__(self, old: nn.Layer):
        super().__init__()
        self.weight = old.weight
        self.pg = comm.as_parallel_group(_group(old))
        self.vocab_start_index = int(getattr(old, "vocab_start_index", 0))
        self.num_embeddings = int(getattr(old, "num_embeddings", old.weight.shape[0]))
        self._name = getattr(old, "_name", None)

    def forward(self, ids):
        if self.pg is None:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start_index
        outside = paddle.logical_or(local < 0, local >= self.weight.shape[0])
        local = paddle.where(outside, paddle.zeros_like(local), local)
        out = F.embedding(local, self.weight)
        out = paddle.where(outside.unsqueeze(-1), paddle.zeros_like(out), out)
        return comm.reduce_from_parallel(out, self.pg)

    def extra_repr(self) -> str:
        world = self.pg.world_size if self.pg is not None else 1
        return (f"num_embeddings={self.num_embeddings}, weight={list(self.weight.shape)}, "
                f"vocab_start_index={self.vocab_start_index}, ranks={world}")


def parallel_logits(hidden_states, weight, transpose_y: bool, pg, sequence_parallel: bool, seq_length,
                    tensor_parallel_output: bool):
    """Logits of a vocabulary-parallel LM head (``weight`` this rank's ``V / n`` vocabulary rows).

    hidden_states ``[batch, seq, hidden]``, or with ``sequence_parallel`` this rank's rows
    ``[batch * seq / n, hidden]`` (gathered here and reshaped to ``[-1, seq_length, hidden]``, as
    PaddleNLP's head does). Returns ``[batch, seq, V / n]``, or ``[batch, seq, V]`` without
    ``tensor_parallel_output``. In backward each rank's partial hidden gradient (its vocabulary rows)
    is summed over the group: reduce-scattered with sequence parallel, all-reduced otherwise."""
    if sequence_parallel:
        hidden_states = comm.all_gather_sequence(hidden_states, pg)
        hidden_states = hidden_states.reshape([-1, seq_length, hidden_states.shape[-1]])
    else:
        hidden_states = comm.copy_to_parallel(hidden_states, pg)
    logits = paddle.matmul(hidden_states, weight, transpose_y=transpose_y)
    if pg is not None and not tensor_parallel_output:
        logits = comm.gather_last_axis(logits, pg)
    return logits


def sequence_chunk(labels, pg):
    """This rank's chunk of the flattened ``labels`` ``[batch, seq]`` -> ``[batch * seq / n]`` (the rows
    its sequence-parallel hidden states hold)."""
    flat = labels.reshape([-1])
    if pg is None:
        return flat
    if flat.shape[0] % pg.world_size:
        raise ValueError(f"labels: {flat.shape[0]} tokens do not split over {pg.world_size} sequence-parallel ranks")
    return paddle.split(flat, pg.world_size)[pg.rank]
