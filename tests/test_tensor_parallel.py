"""Tensor / sequence parallel layers in 2 processes on gloo (Triton kernels in the interpreter):
Column/Row/ParallelFusedMLP with and without sequence parallel equal the dense layer (output and the
gradient of every shard), fleet-layout state dicts load, parameters carry fleet's marks."""

import numpy as np
import paddle

from paddlenlp_fused.layers.tensor_parallel import (ColumnParallelLinear, ParallelFusedMLP, RowParallelLinear,
                                                    allreduce_sequence_parallel_grads)
from paddlenlp_fused.reference.fused_dense import activation_ref
from paddlenlp_fused.testing.distributed import init_fleet, run_distributed
from paddlenlp_fused.testing.numerics import assert_close

WORLD = 2


def _full(shape, seed, scale=1.0):
    """The same array on every rank."""
    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def _dense(x, weights, fn, dy):
    """fn(x, *weights) and the gradients of x and every weight, in float64."""
    leaves = [paddle.to_tensor(t.astype(np.float64), stop_gradient=False) for t in [x] + weights]
    out = fn(*leaves)
    return [out.numpy()] + [g.numpy() for g in paddle.grad(out, leaves, paddle.to_tensor(dy.astype(np.float64)))]


def _run(layer, x_np, dy_np, params):
    x = paddle.to_tensor(x_np, stop_gradient=False)
    out = layer(x)
    out.backward(paddle.to_tensor(dy_np))
    allreduce_sequence_parallel_grads(layer)
    return [out.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in params]


def _close(name, ours, ref):
    assert_close(name, ours, ref, "float32")


def _shard(a, axis, rank):
    return np.split(a, WORLD, axis=axis)[rank]


def _linear_body():
    hcg = init_fleet(mp_degree=WORLD)
    r = hcg.get_model_parallel_rank()
    S, B, D, F = 4, 3, 8, 6  # sequence, batch, features
    X, W1, B1 = _full((S, B, D), 1), _full((D, F), 2, 0.3), _full((F,), 3)
    W2, B2 = _full((F, D), 4, 0.3), _full((D,), 5)
    for sp in (False, True):
        rows = slice(r * S // WORLD, (r + 1) * S // WORLD) if sp else slice(None)
        # column then row, as in an MLP: x -> column (features split) -> row (reduced)
        column = ColumnParallelLinear(D, F, has_bias=True, gather_output=False, sequence_parallel=sp, backend="triton")
        row = RowParallelLinear(F, D, input_is_parallel=True, sequence_parallel=sp, backend="triton")
        assert column.weight.is_distributed and column.weight.split_axis == 1 and column.bias.split_axis == 0
        assert row.weight.is_distributed and row.weight.split_axis == 0 and not row.bias.is_distributed
        assert getattr(row.bias, "sequence_parallel", False) == sp
        # fleet's layout: column weight [in, out/n] (shard of the out axis), row weight [in/n, out]
        column.set_state_dict({"weight": _shard(W1, 1, r), "bias": _shard(B1, 0, r)})
        row.set_state_dict({"weight": _shard(W2, 0, r), "bias": B2})
        np.testing.assert_array_equal(column.weight.numpy(), _shard(W1, 1, r))

        class Stack(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.column, self.row = column, row

            def forward(self, x):
                return self.row(self.column(x))

        dY = _full((S, B, D), 6)
        ours = _run(Stack(), X[rows], dY[rows], [column.weight, column.bias, row.weight, row.bias])
        ref = _dense(X, [W1, B1, W2, B2], lambda x, w1, b1, w2, b2: paddle.matmul(paddle.matmul(x, w1) + b1, w2) + b2,
                     dY)
        tag = f"sp={sp}"
        _close(f"{tag} out", ours[0], ref[0][rows])
        _close(f"{tag} dx", ours[1], ref[1][rows])
        _close(f"{tag} column dweight", ours[2], _shard(ref[2], 1, r))
        _close(f"{tag} column dbias", ours[3], _shard(ref[3], 0, r))
        _close(f"{tag} row dweight", ours[4], _shard(ref[4], 0, r))
        _close(f"{tag} row dbias", ours[5], ref[5])

    # every dtype on CPU (the replicated bias added after the reduction had no 16-bit CPU kernel), against float32
    ref = _dense(X[..., :F], [W2, B2], lambda x, w, b: paddle.matmul(x, w) + b, dY)
    for dtype in ("float32", "bfloat16", "float16"):
        paddle.set_default_dtype(dtype)  # the layer's parameters in dtype
        try:
            row = RowParallelLinear(F, D, input_is_parallel=True, backend="reference")
        finally:
            paddle.set_default_dtype("float32")
        for param, value in ((row.weight, _shard(W2, 0, r)), (row.bias, B2)):
            param.set_value(paddle.to_tensor(value).astype(dtype))
        x = paddle.to_tensor(_shard(X[..., :F], 2, r)).astype(dtype)
        x.stop_gradient = False
        out = row(x)
        out.backward(paddle.to_tensor(dY).astype(dtype))
        assert out.dtype == x.dtype and row.bias.grad.dtype == x.dtype, (dtype, out.dtype, row.bias.grad.dtype)
        for name, ours, want in (("out", out, ref[0]), ("dx", x.grad, _shard(ref[1], 2, r)),
                                 ("dweight", row.weight.grad, _shard(ref[2], 0, r)), ("dbias", row.bias.grad, ref[3])):
            assert_close(f"{dtype} row {name}", ours.astype("float32").numpy(), want, dtype)

    # sharded weights initialised under fleet's model-parallel RNG state: distinct on each rank,
    # while the global RNG stream stays the same on both
    from paddle.distributed.fleet.layers.mpu.random import model_parallel_random_seed

    model_parallel_random_seed(1234)
    shard = ColumnParallelLinear(D, F, gather_output=False, backend="triton").weight
    shards, after = [], []
    paddle.distributed.all_gather(shards, shard.detach())
    paddle.distributed.all_gather(after, paddle.randn([4]))
    assert not np.array_equal(shards[0].numpy(), shards[1].numpy())
    np.testing.assert_array_equal(after[0].numpy(), after[1].numpy())

    # gather_output and a replicated input split inside the row layer
    column = ColumnParallelLinear(D, F, has_bias=False, gather_output=True, backend="triton")
    row = RowParallelLinear(F, D, has_bias=False, input_is_parallel=False, backend="triton")
    column.set_state_dict({"weight": _shard(W1, 1, r)})
    row.set_state_dict({"weight": _shard(W2, 0, r)})
    x = paddle.to_tensor(X)
    mid = column(x)
    _close("gather_output", mid.numpy(), X @ W1)
    _close("row with split input", row(mid).numpy(), X @ W1 @ W2)


def _mlp_body():
    hcg = init_fleet(mp_degree=WORLD)
    r = hcg.get_model_parallel_rank()
    S, B, D, H = 4, 2, 8, 16
    X, dY = _full((S, B, D), 11), _full((S, B, D), 12)
    for activation, sp, level in (("gelu_approx", False, 0), ("gelu_approx", True, 2), ("swiglu", True, 1)):
        gated = activation == "swiglu"
        W1, B1 = _full((D, (2 if gated else 1) * H), 13, 0.3), _full(((2 if gated else 1) * H,), 14)
        W2, B2 = _full((H, D), 15, 0.3), _full((D,), 16)
        mlp = ParallelFusedMLP(D, H, activation=activation, sequence_parallel=sp, checkpoint_lvl=level,
                               backend="triton")
        # Each rank's fc1 shard is [gate shard | up shard] for the gated activation.
        if gated:
            w1_shard = np.concatenate([_shard(W1[:, :H], 1, r), _shard(W1[:, H:], 1, r)], axis=1)
            b1_shard = np.concatenate([_shard(B1[:H], 0, r), _shard(B1[H:], 0, r)])
        else:
            w1_shard, b1_shard = _shard(W1, 1, r), _shard(B1, 0, r)
        mlp.set_state_dict({"fc1.weight": w1_shard, "fc1.bias": b1_shard, "fc2.weight": _shard(W2, 0, r),
                            "fc2.bias": B2})
        rows = slice(r * S // WORLD, (r + 1) * S // WORLD) if sp else slice(None)
        params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
        ours = _run(mlp, X[rows], dY[rows], params)
        ref = _dense(X, [W1, B1, W2, B2],
                     lambda x, w1, b1, w2, b2: paddle.matmul(activation_ref(paddle.matmul(x, w1) + b1, activation),
                                                             w2) + b2, dY)
        tag = f"{activation} sp={sp} lvl={level}"
        if gated:
            ref_dw1 = np.concatenate([_shard(ref[2][:, :H], 1, r), _shard(ref[2][:, H:], 1, r)], axis=1)
            ref_db1 = np.concatenate([_shard(ref[3][:H], 0, r), _shard(ref[3][H:], 0, r)])
        else:
            ref_dw1, ref_db1 = _shard(ref[2], 1, r), _shard(ref[3], 0, r)
        _close(f"{tag} out", ours[0], ref[0][rows])
        _close(f"{tag} dx", ours[1], ref[1][rows])
        _close(f"{tag} dweight1", ours[2], ref_dw1)
        _close(f"{tag} dbias1", ours[3], ref_db1)
        _close(f"{tag} dweight2", ours[4], _shard(ref[4], 0, r))
        _close(f"{tag} dbias2", ours[5], ref[5])


def test_column_and_row_parallel_linear_equal_the_dense_layers():
    run_distributed(_linear_body)


def test_parallel_fused_mlp_equals_the_dense_mlp():
    run_distributed(_mlp_body)
