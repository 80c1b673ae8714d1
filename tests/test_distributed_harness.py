"""The 2-process gloo runner: collectives the distributed layers build on."""

import paddle
import paddle.distributed as dist

from paddlenlp_fused.testing.distributed import init_fleet, run_distributed


def _collectives_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    x = paddle.to_tensor([float(rank + 1), 10.0])
    dist.all_reduce(x)
    assert x.numpy().tolist() == [3.0, 20.0], x
    y = paddle.to_tensor([float(rank) * 7])
    dist.broadcast(y, src=1)
    assert y.numpy().tolist() == [7.0], y
    gathered = []
    dist.all_gather(gathered, paddle.to_tensor([rank, rank * 2]))
    assert [t.numpy().tolist() for t in gathered] == [[0, 0], [1, 2]]


def _fleet_model_parallel_body():
    hcg = init_fleet(mp_degree=2)
    assert hcg.get_model_parallel_world_size() == 2
    x = paddle.to_tensor([float(hcg.get_model_parallel_rank() + 1)])
    dist.all_reduce(x, group=hcg.get_model_parallel_group())
    assert x.numpy().tolist() == [3.0]


def test_collectives_in_two_processes():
    run_distributed(_collectives_body)


def test_fleet_model_parallel_group_in_two_processes():
    run_distributed(_fleet_model_parallel_body)


def test_a_failing_rank_fails_the_test():
    import pytest

    with pytest.raises(AssertionError, match="rank 0"):
        run_distributed(_failing_body)


def _failing_body():
    assert dist.get_rank() != 0, "rank 0 fails on purpose"
