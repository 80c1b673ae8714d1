"""Model-parallel Mamba layers in 2 CPU processes (gloo, fleet mp_degree 2) against the dense layer
with the same full weights: outputs, the input's gradient and every shard's parameter gradients.

* ``Mamba2Block``: B/C sharded by groups (ngroups 2) and replicated (ngroups 1, the gated norm's
  mean square all-reduced), with and without sequence parallel (sequence-first shards of seqlen 10,
  a ragged last chunk of 4); prefill then step-by-step decoding under model parallelism equals the
  dense forward.
* ``MambaMixer``: inner channels sharded, x_proj's output (dt_low, B, C) all-reduced forward and
  backward; decoding under model parallelism.
"""

import numpy as np
import paddle

from paddlenlp_fused.testing.distributed import init_fleet, run_distributed
from paddlenlp_fused.testing.numerics import assert_close

D_MODEL, HEADDIM, D_STATE, CHUNK, SEQLEN, BATCH = 16, 8, 6, 4, 10, 2


def _tensor(shape, scale=1.0):
    return paddle.to_tensor(np.random.randn(*shape).astype(np.float32) * scale)


def _perturb(layer, names):
    """Move parameters off their structured init (D = 1, norm weight = 1, zero biases)."""
    params = dict(layer.named_parameters())
    for name in names:
        if name in params:
            p = params[name]
            p.set_value(p + _tensor(p.shape, 0.3))


def _dense_run(layer, u, grad_out, **kw):
    u = u.clone()
    u.stop_gradient = False
    out = layer(u, **kw)
    (out * grad_out).sum().backward()
    grads = {name: p.grad.numpy() for name, p in layer.named_parameters()}
    return out.numpy(), u.grad.numpy(), grads


def _check_shards(name, mp_layer, dense_grads):
    expected = mp_layer.dense_to_local(dense_grads)
    for pname, p in mp_layer.named_parameters():
        assert p.grad is not None, f"{name}: {pname} has no gradient"
        assert_close(f"{name} d{pname}", p.grad.numpy(), expected[pname], "float32")


def _check_fleet_grad_norm(name, mp_layer, dense_grads):
    """The gradient norm as fleet's HybridParallelClipGrad takes it (squares of parameters marked
    is_distributed summed over the model-parallel ranks, the others counted once) is the dense one's,
    per dense parameter (``x_bc`` counts towards ``x``): no replicated value may sit inside a parameter
    marked is_distributed."""
    import paddle.distributed as dist

    names = sorted(dense_grads)
    sharded, replicated = np.zeros(len(names)), np.zeros(len(names))
    for pname, p in mp_layer.named_parameters():
        square = float((p.grad.astype("float64") ** 2).sum())
        index = names.index(pname[:-len("_bc")] if pname.endswith("_bc") else pname)
        (sharded if p.is_distributed else replicated)[index] += square
    total = paddle.to_tensor(sharded)
    dist.all_reduce(total, group=mp_layer.pg.group, sync_op=True)
    for i, dense_name in enumerate(names):
        dense = float((np.asarray(dense_grads[dense_name], np.float64) ** 2).sum())
        assert_close(f"{name} fleet grad norm of {dense_name}", np.sqrt(total.numpy()[i] + replicated[i]),
                     np.sqrt(dense), "float32")


def _mamba2_body():
    from paddlenlp_fused.layers.mamba2 import Mamba2Block, Mamba2InferenceParams
    from paddlenlp_fused.layers.tensor_parallel import allreduce_sequence_parallel_grads

    np.random.seed(0)
    paddle.seed(0)
    # the reference backend (the collectives sit outside the op; tests/test_mamba2.py covers the
    # op's PyLayer on the Triton kernels)
    configs = [dict(ngroups=2, sequence_parallel=False), dict(ngroups=1, sequence_parallel=False),
               dict(ngroups=1, sequence_parallel=True), dict(ngroups=2, sequence_parallel=True)]
    dense, runs = [], []
    for cfg in configs:  # dense blocks built and run before fleet.init: no model-parallel group yet
        blk = Mamba2Block(D_MODEL, d_state=D_STATE, headdim=HEADDIM, ngroups=cfg["ngroups"], chunk_size=CHUNK,
                          bias=True, dt_limit=(0.0, 0.09), layer_idx=0, backend="reference")
        _perturb(blk, ["D", "norm.weight", "conv1d.bias", "out_proj.bias", "in_proj.bias"])
        u, grad_out = _tensor((BATCH, SEQLEN, D_MODEL)), _tensor((BATCH, SEQLEN, D_MODEL))
        dense.append(blk)
        runs.append((u, grad_out, _dense_run(blk, u, grad_out)))
    hcg = init_fleet(mp_degree=2)
    rank = hcg.get_model_parallel_rank()
    for cfg, blk, (u, grad_out, (ref_out, ref_du, ref_grads)) in zip(configs, dense, runs):
        name = f"mamba2 {cfg}"
        mp = Mamba2Block(D_MODEL, d_state=D_STATE, headdim=HEADDIM, chunk_size=CHUNK, bias=True, dt_limit=(0.0, 0.09),
                         layer_idx=0, backend="reference", **cfg)
        assert mp.pg is not None and mp.nheads_local == 2 and mp.in_proj.weight.is_distributed
        mp.set_dense_state_dict(blk.state_dict())
        if cfg["sequence_parallel"]:  # this rank's half of the sequence, sequence-first
            rows = slice(rank * SEQLEN // 2, (rank + 1) * SEQLEN // 2)
            u_local = u.transpose([1, 0, 2])[rows].contiguous()
            u_local.stop_gradient = False
            out = mp(u_local)
            (out * grad_out.transpose([1, 0, 2])[rows]).sum().backward()
            allreduce_sequence_parallel_grads(mp)
            assert_close(f"{name} out", out.numpy(), ref_out.transpose([1, 0, 2])[rows], "float32")
            assert_close(f"{name} du", u_local.grad.numpy(), ref_du.transpose([1, 0, 2])[rows], "float32")
        else:
            mp_out, mp_du, _ = _dense_run(mp, u, grad_out)
            assert_close(f"{name} out", mp_out, ref_out, "float32")
            assert_close(f"{name} du", mp_du, ref_du, "float32")
        _check_shards(name, mp, ref_grads)
        _check_fleet_grad_norm(name, mp, ref_grads)
        if cfg["sequence_parallel"]:
            continue
        with paddle.no_grad():  # prefill 6 tokens, then 4 decoding steps, on this rank's heads
            cache = Mamba2InferenceParams(max_seqlen=SEQLEN, max_batch_size=BATCH)
            outs = [mp(u[:, :6], inference_params=cache)]
            cache.seqlen_offset = 6
            for t in range(6, SEQLEN):
                outs.append(mp(u[:, t:t + 1], inference_params=cache))
                cache.seqlen_offset += 1
        assert_close(f"{name} decoded", paddle.concat(outs, axis=1).numpy(), ref_out, "float32")


def test_mamba2_block_model_parallel_equals_dense():
    run_distributed(_mamba2_body)


def _mamba1_body():
    from paddlenlp_fused.layers.mamba import MambaInferenceCache, MambaMixer

    np.random.seed(1)
    paddle.seed(1)
    dense = MambaMixer(d_model=8, d_state=3, d_conv=4, expand=2, use_bias=True, backend="reference")
    _perturb(dense, ["D", "conv1d.bias", "in_proj.bias", "out_proj.bias"])
    u, grad_out = _tensor((2, 7, 8)), _tensor((2, 7, 8))
    ref_out, ref_du, ref_grads = _dense_run(dense, u, grad_out)
    init_fleet(mp_degree=2)
    mp = MambaMixer(d_model=8, d_state=3, d_conv=4, expand=2, use_bias=True, backend="reference")
    assert mp.pg is not None and mp.inner_local == 8 and mp.x_proj.weight.split_axis == 0
    mp.set_dense_state_dict(dense.state_dict())
    mp_out, mp_du, _ = _dense_run(mp, u, grad_out)
    assert_close("mamba1 out", mp_out, ref_out, "float32")
    assert_close("mamba1 du", mp_du, ref_du, "float32")
    _check_shards("mamba1", mp, ref_grads)
    with paddle.no_grad():
        cache = MambaInferenceCache(1, 2, mp.inner_local, 3, 4)
        outs = [mp(u[:, :3], cache_params=cache)]
        cache.seqlen_offset = 3
        for t in range(3, 7):
            outs.append(mp(u[:, t:t + 1], cache_params=cache))
            cache.seqlen_offset += 1
    assert_close("mamba1 decoded", paddle.concat(outs, axis=1).numpy(), ref_out, "float32")
    try:  # a cache of the full intermediate size does not fit this rank's shard
        mp(u[:, :3], cache_params=MambaInferenceCache(1, 2, 16, 3, 4))
    except ValueError as err:
        assert "cache_params" in str(err), err
    else:
        raise AssertionError("a full-size cache under model parallelism did not raise")


def test_mamba_mixer_model_parallel_equals_dense():
    run_distributed(_mamba1_body)
