"""Ring over a data-parallel group for the contrastive loss (Inf-CL's ring loss).

Each of the W ranks holds its local ``a`` rows (q) and ``b`` rows (k), B of each; the loss is that of
the global batch (rows of all ranks against columns of all ranks), and no rank ever holds the global
similarity matrix nor the global ``b``: the ``b`` blocks travel around the ring, one step a block.

Forward (``ring_row_stats``): at step t rank r holds the block of rank ``(r - t) mod W``, computes the
log-sum-exp of its rows over that block (and the positive logit where the label falls in it), and
combines it with what it has (``logaddexp``). W - 1 shifts.

Backward (``ring_grad``): the ``b`` block travels with what its column term needs (its log-sum-exp,
upstream weights and labels) and with its gradient accumulator ``ub``: each rank adds the
contribution of its own rows and passes ``ub`` on, so after W shifts every ``ub`` is back with its
owner holding the gradient of the global loss. ``ua`` (the local rows' gradient) stays put.

Memory per rank: the blocks travel as the callers hold them (the inputs themselves, no operand
copies), so beyond its local inputs and gradients a rank holds the block it receives while it
computes on the visiting one (and in backward the travelling ``ub``): a few local-block-sized
buffers, whatever the group size, plus per-row vectors.

Transport (measured on Paddle 3.3.1, CPU, gloo): blocking ``send``/``recv`` work; ``isend`` blocks
until the peer receives, so ``isend``+``irecv`` (and ``batch_isend_irecv``) posted in the same order
on both sides deadlock, while ``reduce_scatter`` and ``alltoall`` are not implemented. On gloo the
shift is therefore blocking ``send``/``recv`` with even ranks sending first and odd ranks receiving
first (any W >= 2 completes: a chain of senders ends at a receiver). Other backends (NCCL) post the
shift with ``batch_isend_irecv`` before the block's compute and wait after it, so transfer and compute
overlap.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import paddle
import paddle.distributed as dist

from .comm import ParallelGroup, as_parallel_group, data_parallel_group


def resolve_group(group) -> Optional[ParallelGroup]:
    """``group`` as a ParallelGroup, None for a single process. ``None`` means fleet's data-parallel
    group when fleet is initialised with more than one data-parallel rank; ``False``: no group."""
    if group is False:
        return None
    if group is None:
        return data_parallel_group()
    return as_parallel_group(group)


class _Done:
    """A finished shift."""

    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self) -> List[paddle.Tensor]:
        return self._tensors


class _InFlight:
    def __init__(self, tasks, tensors):
        self._tasks, self._tensors = tasks, tensors

    def wait(self) -> List[paddle.Tensor]:
        for task in self._tasks:
            task.wait()
        return self._tensors


class Ring:
    """This rank's place in the ring of ``pg`` (None: one rank, shifts are the identity)."""

    def __init__(self, pg: Optional[ParallelGroup]):
        self.pg = pg
        self.world = pg.world_size if pg is not None else 1
        self.rank = pg.rank if pg is not None else 0
        if pg is not None:
            ranks = pg.group.ranks  # global ranks, what send/recv take
            self._next = ranks[(self.rank + 1) % self.world]
            self._prev = ranks[(self.rank - 1) % self.world]
            self._gloo = dist.get_backend(pg.group).lower() == "gloo"

    def owner(self, step: int) -> int:
        """Rank (in the group) whose block this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def shift(self, tensors: Sequence[paddle.Tensor]):
        """Send ``tensors`` to the next rank and receive the previous rank's; ``.wait()`` returns them."""
        if self.world == 1:
            return _Done(list(tensors))
        tensors = [t.contiguous() for t in tensors]
        received = [paddle.empty(t.shape, dtype=t.dtype) for t in tensors]
        group = self.pg.group
        if self._gloo:
            for out, got in zip(tensors, received):
                if self.rank % 2 == 0:
                    dist.send(out, dst=self._next, group=group)
                    dist.recv(got, src=self._prev, group=group)
                else:
                    dist.recv(got, src=self._prev, group=group)
                    dist.send(out, dst=self._next, group=group)
            return _Done(received)
        ops = [dist.P2POp(dist.isend, t, self._next, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self._prev, group) for r in received]
        return _InFlight(dist.batch_isend_irecv(ops), received)

    def check_same_rows(self, rows: int, what: str) -> None:
        """Every rank must hold the same number of rows (blocks are exchanged in place)."""
        if self.world == 1:
            return
        sizes: List[paddle.Tensor] = []
        dist.all_gather(sizes, paddle.to_tensor([rows], dtype="int64"), group=self.pg.group)
        sizes = [int(s.item()) for s in sizes]
        if len(set(sizes)) != 1:
            raise ValueError(f"{what}: every rank of the group must hold the same batch size, got {sizes}")


def _logaddexp(x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    top = paddle.maximum(x, y)
    return top + paddle.log(paddle.exp(x - top) + paddle.exp(y - top))


def ring_row_stats(ring: Ring, a: paddle.Tensor, b: paddle.Tensor,
                   block_stats: Callable[[paddle.Tensor, int], tuple]):
    """(lse, pos) of the local rows of ``a`` over the global ``b`` (every rank's block).

    ``block_stats(b_block, b_offset)`` returns (lse, pos) float32 [rows of a] of the local rows over
    one block whose first row has global index ``b_offset`` (pos 0 where the label is elsewhere).
    """
    rows_b = b.shape[0]
    visiting, lse, pos = b, None, None
    for step in range(ring.world):
        pending = ring.shift([visiting]) if step + 1 < ring.world else None
        lse_block, pos_block = block_stats(visiting, ring.owner(step) * rows_b)
        lse = lse_block if lse is None else _logaddexp(lse, lse_block)
        pos = pos_block if pos is None else pos + pos_block
        if pending is not None:
            (visiting,) = pending.wait()
    return lse, pos


def ring_grad(ring: Ring, b_pack: Sequence[paddle.Tensor], ub_shape, block_grad: Callable) -> paddle.Tensor:
    """Runs ``block_grad(pack, ub, b_offset, first)`` on every block of the ring and returns ``ub`` of
    the local block (float32 ``ub_shape``) with every rank's contribution summed.

    ``b_pack``: the local block and what travels with it (``pack[0]`` is b). ``block_grad`` adds the
    local rows' contribution to the unscaled gradients: ``ua`` (its own, overwritten when ``first``)
    and ``ub`` of the visiting block (overwritten when ``first``: the owner is the first to write it).
    """
    rows_b = b_pack[0].shape[0]
    visiting = list(b_pack)
    ub = paddle.empty(ub_shape, dtype="float32")
    for step in range(ring.world):
        pending = ring.shift(visiting) if step + 1 < ring.world else None
        block_grad(visiting, ub, ring.owner(step) * rows_b, step == 0)
        (ub,) = ring.shift([ub]).wait()  # follows its block; after W shifts it is home
        if pending is not None:
            visiting = pending.wait()
    return ub
