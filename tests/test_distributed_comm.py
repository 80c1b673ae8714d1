"""Comm PyLayers in 2 processes on gloo: forward values and backward gradients of each op against
what the collective must give, and identity with no group."""

import numpy as np
import paddle

from paddlenlp_fused.distributed import comm
from paddlenlp_fused.testing.distributed import init_fleet, run_distributed


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
