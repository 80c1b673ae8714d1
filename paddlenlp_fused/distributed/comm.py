"""Communication PyLayers for tensor and sequence parallelism, and fleet group helpers.

Built on ``paddle.distributed`` collectives with ``sync_op=True``, so they run on NCCL and on gloo
(fleet's own ``c_identity``/``c_split``/``c_concat`` have no CPU kernels). Every op is the identity
when ``group`` is None or has one rank, and issues no collective then.

Tensor parallel (Megatron's f/g and the last-axis split/gather):
    ``copy_to_parallel``      fwd identity,            bwd all-reduce
    ``reduce_from_parallel``  fwd all-reduce,          bwd identity
    ``split_last_axis``       fwd keep this rank's chunk of the last axis, bwd all-gather it
    ``gather_last_axis``      fwd all-gather along the last axis,         bwd keep this rank's chunk
Sequence parallel (axis 0 is the sequence axis, as PaddleNLP's ``[seq * batch, hidden]``):
    ``scatter_sequence``        fwd keep this rank's chunk,  bwd all-gather
    ``gather_sequence``         fwd all-gather,              bwd keep this rank's chunk
    ``all_gather_sequence``     fwd all-gather,              bwd reduce-scatter
    ``reduce_scatter_sequence`` fwd reduce-scatter,          bwd all-gather
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer


class ParallelGroup(NamedTuple):
    group: object  # paddle.distributed Group
    world_size: int
    rank: int  # rank inside the group
    src_rank: int  # global rank of the group's first member (what broadcast takes as src)


def model_parallel_group() -> Optional[ParallelGroup]:
    """Fleet's model-parallel group, or None without ``fleet.init`` or with one rank."""
    return _hybrid_group("model")


def data_parallel_group() -> Optional[ParallelGroup]:
    """Fleet's data-parallel group, or None without ``fleet.init`` or with one rank."""
    return _hybrid_group("data")


def _fleet_initialised(fleet) -> bool:
    """Whether ``fleet.init`` built the hybrid groups: before it, ``get_hybrid_communicate_group``
    fails on the fleet object's missing (or None) ``_hcg``, which is all this looks at, so any other
    failure of a real fleet call still propagates."""
    owner = getattr(fleet.get_hybrid_communicate_group, "__self__", None)
    return owner is None or getattr(owner, "_hcg", None) is not None


def _hybrid_group(kind: str) -> Optional[ParallelGroup]:
    from paddle.distributed import fleet

    if not _fleet_initialised(fleet):
        return None
    hcg = fleet.get_hybrid_communicate_group()
    if hcg is None:
        return None
    world = getattr(hcg, f"get_{kind}_parallel_world_size")()
    if world <= 1:
        return None
    return ParallelGroup(getattr(hcg, f"get_{kind}_parallel_group")(), world,
                         getattr(hcg, f"get_{kind}_parallel_rank")(),
                         getattr(hcg, f"get_{kind}_parallel_group_src_rank")())


def as_parallel_group(group) -> Optional[ParallelGroup]:
    """Accept a ParallelGroup, a ``paddle.distributed`` Group or None; None for one rank."""
    if group is None or isinstance(group, ParallelGroup):
        return group if group is None or group.world_size > 1 else None
    world = group.nranks
    if world <= 1:
        return None
    return ParallelGroup(group, world, group.rank, group.ranks[0])


def _all_reduce(x, pg: ParallelGroup):
    if x.dtype == paddle.float16 and dist.get_backend(pg.group).lower() == "gloo":
        # gloo's float16 sum is wrong (Paddle 3.3.1 CPU: 0.1 + 0.1 gives inf); bfloat16's is right
        return _all_reduce(x.astype("float32"), pg).astype(x.dtype)
    x = x.clone()
    dist.all_reduce(x, group=pg.group, sync_op=True)
    return x


def _all_gather(x, pg: ParallelGroup, axis: int):
    parts = []
    dist.all_gather(parts, x.contiguous(), group=pg.group, sync_op=True)
    return paddle.concat(parts, axis=axis)


def _chunk(x, pg: ParallelGroup, axis: int, what: str):
    size = x.shape[axis]
    if size % pg.world_size:
        raise ValueError(f"{what}: axis {axis} of size {size} does not split over {pg.world_size} ranks")
    return paddle.split(x, pg.world_size, axis=axis)[pg.rank].contiguous()


def _fresh(grad, dy):
    """``grad``, or a copy where it shares ``dy``'s buffer (a chunk that a strided ``split`` left a view):
    a PyLayer returns a gradient of its own, since Paddle may accumulate into it in place."""
    return grad.clone() if grad._is_shared_buffer_with(dy) else grad


def _reduce_scatter(x, pg: ParallelGroup):
    if x.shape[0] % pg.world_size:
        raise ValueError(f"reduce_scatter_sequence: axis 0 of size {x.shape[0]} does not split over "
                         f"{pg.world_size} ranks")
    if dist.get_backend(pg.group).lower() == "gloo":  # gloo has no reduce_scatter
        return _chunk(_all_reduce(x, pg), pg, 0, "reduce_scatter_sequence")
    out = paddle.empty([x.shape[0] // pg.world_size] + list(x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter(out, list(paddle.split(x.contiguous(), pg.world_size, axis=0)), group=pg.group,
                        sync_op=True)
    return out


class _CopyToParallel(PyLayer):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.pg)


class _ReduceFromParallel(PyLayer):
    @staticmethod
    def forward(ctx, x, pg):
        return _all_reduce(x, pg)

    @staticmethod
    def backward(ctx, dy):
        return dy.clone()  # not dy itself: Paddle may accumulate into the returned gradient in place


class _SplitAxis(PyLayer):
    """fwd: this rank's chunk along ``axis``; bwd: all-gather along it."""

    @staticmethod
    def forward(ctx, x, pg, axis):
        ctx.pg, ctx.axis = pg, axis
        return _chunk(x, pg, axis, "split")

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.pg, ctx.axis)


class _GatherAxis(PyLayer):
    """fwd: all-gather along ``axis``; bwd: this rank's chunk (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x, pg, axis):
        ctx.pg, ctx.axis = pg, axis
        return _all_gather(x, pg, axis)

    @staticmethod
    def backward(ctx, dy):
        return _fresh(_chunk(dy, ctx.pg, ctx.axis, "gather backward"), dy)


class _AllGatherSequence(PyLayer):
    """fwd: all-gather along axis 0; bwd: reduce-scatter (each rank's gradient differs)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _all_gather(x, pg, 0)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.pg)


class _ReduceScatterSequence(PyLayer):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _reduce_scatter(x, pg)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.pg, 0)


def _apply(layer, x, group, *args):
    """``layer`` over ``x`` on ``group``; ``x`` itself when there is no group or one rank."""
    pg = as_parallel_group(group)
    return x if pg is None else layer.apply(x, pg, *args)


def copy_to_parallel(x, group=None):
    return _apply(_CopyToParallel, x, group)


def reduce_from_parallel(x, group=None):
    return _apply(_ReduceFromParallel, x, group)


def split_last_axis(x, group=None):
    return _apply(_SplitAxis, x, group, x.ndim - 1)


def gather_last_axis(x, group=None):
    return _apply(_GatherAxis, x, group, x.ndim - 1)


def scatter_sequence(x, group=None):
    return _apply(_SplitAxis, x, group, 0)


def gather_sequence(x, group=None):
    return _apply(_GatherAxis, x, group, 0)


def all_gather_sequence(x, group=None):
    return _apply(_AllGatherSequence, x, group)


def reduce_scatter_sequence(x, group=None):
    return _apply(_ReduceScatterSequence, x, group)


def broadcast_from_src(t, group=None):
    """Broadcast ``t`` in place from the group's first rank (replicated parameters and their
    gradients, e.g. Mamba's dB/dC); identity for one rank."""
    pg = as_parallel_group(group)
    if pg is not None:
        dist.broadcast(t, src=pg.src_rank, group=pg.group, sync_op=True)
    return t
