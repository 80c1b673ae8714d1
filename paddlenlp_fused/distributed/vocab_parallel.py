"""Vocabulary-parallel linear cross-entropy: each rank of the tensor-parallel group holds ``V / n``
consecutive vocabulary rows of the LM-head weight (rank r: ids ``[r V/n, (r+1) V/n)``).

Forward: every rank computes, for every token, the log-sum-exp, target logit and logit sum over its
own rows; ``combine_stats`` makes them global (lse by an all-reduce MAX of the local lse and an
all-reduce SUM of ``exp(lse_r - max)``; the target logit, held by one rank and 0 elsewhere, and the
logit sum by all-reduce SUM). Backward: every rank's G uses the global lse, so its dW / dbias rows are
complete, and its dh is a partial sum over its rows that the hidden's comm op all-reduces
(``copy_to_parallel``) or reduce-scatters (sequence parallel: ``all_gather_sequence`` in forward).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import paddle
import paddle.distributed as dist

from . import comm


class VocabShard(NamedTuple):
    start: int  # first global vocabulary id held here
    total: int  # global vocabulary size


def resolve_group(tp_group) -> Optional[comm.ParallelGroup]:
    """None (no vocab parallelism), ``"fleet"`` (fleet's model-parallel group), a ParallelGroup or a
    ``paddle.distributed`` group; None when the group has one rank."""
    if isinstance(tp_group, str):
        if tp_group != "fleet":
            raise ValueError(f"tp_group: expected None, 'fleet' or a group, got {tp_group!r}")
        return comm.model_parallel_group()
    return comm.as_parallel_group(tp_group)


def shard(pg: Optional[comm.ParallelGroup], local_vocab: int) -> VocabShard:
    if pg is None:
        return VocabShard(0, local_vocab)
    return VocabShard(pg.rank * local_vocab, pg.world_size * local_vocab)


def gather_inputs(hidden2d, labels1d, pg: Optional[comm.ParallelGroup], sequence_parallel: bool):
    """The hidden states and labels every rank needs: with sequence parallelism the local ``[T/n, D]``
    rows are all-gathered (backward: reduce-scatter, which also sums the ranks' partial dh); without
    it, the replicated hidden goes through ``copy_to_parallel`` (backward: all-reduce of dh)."""
    if pg is None:
        return hidden2d, labels1d
    if sequence_parallel:
        return comm.all_gather_sequence(hidden2d, pg), comm.gather_sequence(labels1d, pg)
    return comm.copy_to_parallel(hidden2d, pg), labels1d


@paddle.no_grad()
def combine_stats(stats, pg: Optional[comm.ParallelGroup]):
    """Local stats ``[3, T]`` (lse, target logit, logit sum over this rank's rows) -> global ones."""
    if pg is None:
        return stats
    lse_local = stats[0]
    peak = lse_local.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pg.group, sync_op=True)
    sum_exp = paddle.exp(lse_local - peak)
    dist.all_reduce(sum_exp, group=pg.group, sync_op=True)
    rest = stats[1:3].clone()
    dist.all_reduce(rest, group=pg.group, sync_op=True)
    return paddle.concat([(peak + paddle.log(sum_exp)).unsqueeze(0), rest], axis=0)
