"""Comm PyLayers in 2 processes on gloo: forward values and backward gradients of each op against
what the collective must give, and identity with no group; the NCCL-only branches (reduce-scatter,
the contrastive ring's batched send/recv) on a recording stand-in for NCCL's collectives, against
fleet's sequence-parallel reduce-scatter and the gloo branch."""

import types

import numpy as np
import paddle
import pytest

from paddlenlp_fused.distributed import comm
from paddlenlp_fused.testing.distributed import FakeGroup, RecordingCollectives, init_fleet, run_distributed


def _rank_input(rank, shape=(4, 6)):
    """Distinct, known values on each rank."""
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100.0 * rank


def _run_op(op, x_np, dy_np, group):
    x = paddle.to_tensor(x_np, stop_gradient=False)
    y = op(x, group)
    (dx,) = paddle.grad(y, x, paddle.to_tensor(dy_np))
    return y.numpy(), dx.numpy()


def _comm_body():
    hcg = init_fleet(mp_degree=2)
    pg = comm.model_parallel_group()
    assert pg is not None and pg.world_size == 2 and pg.rank == hcg.get_model_parallel_rank()
    r = pg.rank
    xs = [_rank_input(i) for i in range(2)]
    x = xs[r]
    total = xs[0] + xs[1]

    def dy_for(shape, rank):
        return np.full(shape, rank + 1.0, np.float32) * np.arange(1, shape[-1] + 1, dtype=np.float32)

    y, dx = _run_op(comm.copy_to_parallel, x, dy_for(x.shape, r), pg)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(dx, dy_for(x.shape, 0) + dy_for(x.shape, 1))

    y, dx = _run_op(comm.reduce_from_parallel, x, dy_for(x.shape, r), pg)
    np.testing.assert_array_equal(y, total)
    np.testing.assert_array_equal(dx, dy_for(x.shape, r))

    y, dx = _run_op(comm.split_last_axis, x, dy_for((4, 3), r), pg)
    np.testing.assert_array_equal(y, x[:, 3 * r:3 * r + 3])
    expect = np.zeros_like(x)
    for i in range(2):
        expect[:, 3 * i:3 * i + 3] = dy_for((4, 3), i)
    np.testing.assert_array_equal(dx, expect)

    y, dx = _run_op(comm.gather_last_axis, x, dy_for((4, 12), 0), pg)
    np.testing.assert_array_equal(y, np.concatenate(xs, axis=1))
    np.testing.assert_array_equal(dx, dy_for((4, 12), 0)[:, 6 * r:6 * r + 6])

    y, dx = _run_op(comm.scatter_sequence, x, dy_for((2, 6), r), pg)
    np.testing.assert_array_equal(y, x[2 * r:2 * r + 2])
    np.testing.assert_array_equal(dx, np.concatenate([dy_for((2, 6), 0), dy_for((2, 6), 1)]))

    y, dx = _run_op(comm.gather_sequence, x, dy_for((8, 6), 0), pg)
    np.testing.assert_array_equal(y, np.concatenate(xs))
    np.testing.assert_array_equal(dx, dy_for((8, 6), 0)[4 * r:4 * r + 4])

    y, dx = _run_op(comm.all_gather_sequence, x, dy_for((8, 6), r), pg)
    np.testing.assert_array_equal(y, np.concatenate(xs))
    np.testing.assert_array_equal(dx, (dy_for((8, 6), 0) + dy_for((8, 6), 1))[4 * r:4 * r + 4])

    y, dx = _run_op(comm.reduce_scatter_sequence, x, dy_for((2, 6), r), pg)
    np.testing.assert_array_equal(y, total[2 * r:2 * r + 2])
    np.testing.assert_array_equal(dx, np.concatenate([dy_for((2, 6), 0), dy_for((2, 6), 1)]))

    t = paddle.to_tensor(x)
    comm.broadcast_from_src(t, pg)
    np.testing.assert_array_equal(t.numpy(), xs[0])


def test_comm_ops_in_two_processes():
    run_distributed(_comm_body)


def test_every_op_is_identity_without_a_group():
    x = paddle.to_tensor(_rank_input(0), stop_gradient=False)
    assert comm.model_parallel_group() is None
    for op in (comm.copy_to_parallel, comm.reduce_from_parallel, comm.split_last_axis, comm.gather_last_axis,
               comm.scatter_sequence, comm.gather_sequence, comm.all_gather_sequence,
               comm.reduce_scatter_sequence):
        assert op(x, None) is x


def test_fleet_errors_other_than_not_initialised_propagate(monkeypatch):
    """Only fleet not being initialised means "single process"; any other failure is raised."""
    from paddle.distributed import fleet

    assert comm.model_parallel_group() is None  # no fleet.init in this process

    def broken():
        raise RuntimeError("hybrid group construction failed")

    monkeypatch.setattr(fleet, "get_hybrid_communicate_group", broken)
    with pytest.raises(RuntimeError, match="construction failed"):
        comm.model_parallel_group()


# NCCL-only branches, on a recording stand-in for NCCL's collectives (gloo takes other branches, so
# the two-process CI tests never run these): rank 1 of 4 (ranks 10..13 globally)

def _nccl_rank(monkeypatch, peer, world=4, rank=1):
    group = FakeGroup([10 + i for i in range(world)], rank)
    collectives = RecordingCollectives(group, peer)
    collectives.install(monkeypatch)
    return comm.ParallelGroup(group, world, rank, 10), collectives


def test_reduce_scatter_nccl_branch_sends_what_fleet_sends(monkeypatch):
    from paddle.distributed.fleet.utils import sequence_parallel_utils as fleet_sp

    world, rank = 4, 1
    xs = [_rank_input(q, (8, 6)) for q in range(world)]
    pg, ours = _nccl_rank(monkeypatch, lambda kind, src, call: [xs[src]], world, rank)
    y = comm.reduce_scatter_sequence(paddle.to_tensor(xs[rank]), pg)
    np.testing.assert_array_equal(y.numpy(), sum(xs)[2 * rank:2 * rank + 2])

    fleets = RecordingCollectives(pg.group, lambda kind, src, call: [xs[src]])
    fleets.install(monkeypatch)
    hcg = types.SimpleNamespace(get_model_parallel_group=lambda: pg.group)
    monkeypatch.setattr(fleet_sp.fleet, "get_hybrid_communicate_group", lambda: hcg)
    y_fleet = fleet_sp.reduce_scatter(paddle.to_tensor(xs[rank]))
    np.testing.assert_array_equal(y.numpy(), y_fleet.numpy())
    [(kind, (chunks, op))], [(fleet_kind, (fleet_chunks, fleet_op))] = ours.calls, fleets.calls
    assert kind == fleet_kind == "reduce_scatter" and op == fleet_op == int(paddle.distributed.ReduceOp.SUM)
    assert len(chunks) == len(fleet_chunks) == world
    for mine, theirs in zip(chunks, fleet_chunks):  # chunk k goes to rank k, in both
        np.testing.assert_array_equal(mine, theirs)

    # the backward of all_gather_sequence is the same reduce-scatter (of the gradient)
    dys = [_rank_input(q + 7, (8, 6)) for q in range(world)]
    pg, grads = _nccl_rank(monkeypatch, lambda kind, src, call: [dys[src]], world, rank)
    dx = comm._reduce_scatter(paddle.to_tensor(dys[rank]), pg)
    np.testing.assert_array_equal(dx.numpy(), sum(dys)[2 * rank:2 * rank + 2])


def test_ring_shift_nccl_branch_matches_the_gloo_branch(monkeypatch):
    """The ring's batched isend/irecv (NCCL) sends each block to the next rank and receives the
    previous rank's, step by step, exactly as the blocking send/recv of the gloo branch does."""
    from paddlenlp_fused.distributed.contrastive_ring import Ring, ring_row_stats

    world, rank, rows = 3, 1, 4
    blocks = [_rank_input(q, (rows, 5)) for q in range(world)]

    def travelling(kind, src, step):  # at step t rank q sends the block it holds: rank (q - t)'s
        return [blocks[(src - step) % world]]

    def run(pg):
        visited = []

        def block_stats(block, offset):
            visited.append((block.numpy(), offset))
            zeros = paddle.zeros([rows], dtype="float32")
            return zeros, zeros

        ring_row_stats(Ring(pg), paddle.zeros([rows, 5]), paddle.to_tensor(blocks[rank]), block_stats)
        return visited

    pg, nccl = _nccl_rank(monkeypatch, travelling, world, rank)
    visited = run(pg)
    for step, (block, offset) in enumerate(visited):
        owner = (rank - step) % world
        np.testing.assert_array_equal(block, blocks[owner])
        assert offset == owner * rows
    nccl_sends = [(dst, data) for kind, (sends, _) in nccl.calls for dst, data in sends]
    nccl_recvs = [src for kind, (_, sources) in nccl.calls for src in sources]

    gloo_sends, gloo_recvs, step = [], [], {"recv": 0}

    def send(tensor, dst, group=None, sync_op=True):
        gloo_sends.append((dst, tensor.numpy()))

    def recv(tensor, src, group=None, sync_op=True):
        gloo_recvs.append(src)
        paddle.assign(paddle.to_tensor(travelling("p2p", pg.group.ranks.index(src), step["recv"])[0]), output=tensor)
        step["recv"] += 1

    monkeypatch.setattr(paddle.distributed, "get_backend", lambda group=None: "GLOO")
    monkeypatch.setattr(paddle.distributed, "send", send)
    monkeypatch.setattr(paddle.distributed, "recv", recv)
    gloo_visited = run(pg)
    assert [offset for _, offset in gloo_visited] == [offset for _, offset in visited]
    assert [dst for dst, _ in gloo_sends] == [dst for dst, _ in nccl_sends] == [pg.group.ranks[(rank + 1) % world]] * 2
    assert gloo_recvs == nccl_recvs == [pg.group.ranks[(rank - 1) % world]] * 2
    for (_, mine), (_, theirs) in zip(nccl_sends, gloo_sends):
        np.testing.assert_array_equal(mine, theirs)


def _views(x, num_or_sections, axis=0):
    """paddle.split as a strided kernel gives it: chunks that are views of ``x``."""
    n = x.shape[axis] // num_or_sections
    return [paddle.slice(x, [axis], [i * n], [(i + 1) * n]) for i in range(num_or_sections)]


@pytest.mark.parametrize("strided_split", [False, True], ids=["split copies", "split views"])
@pytest.mark.parametrize("layer,args", [
    (comm._CopyToParallel, ()), (comm._ReduceFromParallel, ()), (comm._SplitAxis, (0,)), (comm._SplitAxis, (1,)),
    (comm._GatherAxis, (0,)), (comm._GatherAxis, (1,)), (comm._AllGatherSequence, ()),
    (comm._ReduceScatterSequence, ())],
    ids=lambda v: v.__name__ if isinstance(v, type) else "".join(f"axis{a}" for a in v) or "-")
def test_backward_returns_a_gradient_of_its_own(monkeypatch, layer, args, strided_split):
    """Paddle may accumulate into a PyLayer's returned gradient in place (autograd contract), so no
    backward returns dy or a view of it. Rank 0 of 2, collectives stood in for (gloo branches)."""
    monkeypatch.setattr(paddle.distributed, "get_backend", lambda group=None: "GLOO")
    monkeypatch.setattr(paddle.distributed, "all_reduce", lambda t, op=0, group=None, sync_op=True: None)
    monkeypatch.setattr(paddle.distributed, "all_gather",
                        lambda parts, t, group=None, sync_op=True: parts.extend(t.clone() for _ in range(2)))
    if strided_split:
        monkeypatch.setattr(paddle, "split", _views)
    pg = comm.ParallelGroup(FakeGroup([10, 11], 0), 2, 0, 10)
    ctx = types.SimpleNamespace()
    y = layer.forward(ctx, paddle.to_tensor(_rank_input(0)), pg, *args)
    dy = paddle.to_tensor(np.random.randn(*y.shape).astype(np.float32))
    dx = layer.backward(ctx, dy)
    assert dx is not dy and not dx._is_shared_buffer_with(dy)
    assert list(dx.shape) == [4, 6]
