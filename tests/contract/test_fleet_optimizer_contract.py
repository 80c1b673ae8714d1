"""The fleet contract, optimizer side: each optimizer of ours steps inside every wrapper fleet and
PaddleNLP's Trainer put around it exactly as ``paddle.optimizer.AdamW`` does in the same wrapper.

``OPTIMIZERS`` lists ours (a new one joins with one entry); ``MODES`` lists the wrappers and
parallel modes, each a function that trains a tiny model a few steps with an optimizer factory and
returns the updates (fp32: of the parameters; 16-bit parameters: of their master weights). Every
optimizer's updates must equal Paddle AdamW's within the float32 bound (float32 moments, no
stochastic rounding), with a global-norm clip small enough to bind:

- plain: no wrapper (one process);
- hybrid_mp2: ``HybridParallelOptimizer`` over mp_degree=2 with our Column/RowParallelLinear
  (fleet swaps the clip for ``HybridParallelClipGrad``; sharded and replicated parameters);
- hybrid_mp2_groups: the same with parameter groups (fleet puts its clip into each group);
- mix_precision_mp2: ``MixPrecisionLayer`` + ``MixPrecisionOptimizer`` (gradients in ``main_grad``)
  inside ``HybridParallelOptimizer`` (``--amp_master_grad`` under TP). In float32: Paddle's CPU
  ``adamw`` kernel has no bfloat16 (tests/test_fleet_optimizer.py steps bfloat16 parameters with
  ``main_grad`` against Paddle's AdamW on their float32 masters);
- sharding_stage1: ``DygraphShardingOptimizer`` over sharding_degree=2 (``--sharding stage1``),
  each rank with its own data; sharding_stage1_main_grad: the same inside MixPrecisionOptimizer
  with ``main_grad`` (``--sharding stage1 --amp_master_grad``).
Sharding stage 2 (``GroupShardedOptimizerStage2``) is not here: its constructor asserts a CUDA or
XPU build of Paddle (tests/test_fleet_optimizer.py steps the same protocol in one process).
The 2-process modes run in one launch per fleet topology.
"""

import numpy as np
import paddle
import pytest

import paddlenlp_fused as pf
from paddlenlp_fused.testing.distributed import init_fleet, run_distributed
from paddlenlp_fused.testing.numerics import assert_close

LR, WEIGHT_DECAY, CLIP_NORM, STEPS = 0.01, 0.01, 0.01, 3
D, F, BATCH = 8, 12, 6


def _fused_adamw(parameters, grad_clip, multi_precision):
    return pf.FusedAdamW(learning_rate=LR, parameters=parameters, weight_decay=WEIGHT_DECAY, grad_clip=grad_clip,
                         moment_dtype="float32", stochastic_rounding=False, multi_precision=multi_precision)


OPTIMIZERS = {"FusedAdamW": _fused_adamw}


def _paddle_adamw(parameters, grad_clip, multi_precision):
    return paddle.optimizer.AdamW(learning_rate=LR, parameters=parameters, weight_decay=WEIGHT_DECAY,
                                  grad_clip=grad_clip, multi_precision=multi_precision)


def _set_values(layer, seed):
    rng = np.random.default_rng(seed)
    for param in layer.parameters():
        param.set_value(paddle.to_tensor(rng.standard_normal(param.shape).astype(np.float32) * 0.3)
                        .astype(param.dtype))


def _batches(seed):
    rng = np.random.default_rng(seed)
    return [paddle.to_tensor(rng.standard_normal((BATCH, D)).astype(np.float32) * (1 + step)) for step in range(STEPS)]


def _train(model, opt, batches):
    for x in batches:
        loss = (model(x) ** 2).sum()
        loss.backward()
        opt.step()
        opt.clear_grad()


def _start(model):
    return {p.name: p.numpy().astype(np.float64) for p in model.parameters()}


def _updates(model, start):
    """{name: value after training - value before}"""
    return {p.name: p.numpy().astype(np.float64) - start[p.name] for p in model.parameters()}


class _Gain(paddle.nn.Layer):
    """A replicated scale."""

    def __init__(self):
        super().__init__()
        self.gain = self.create_parameter([D], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x):
        return x * self.gain


def _mp_model():
    with paddle.utils.unique_name.guard():
        model = paddle.nn.Sequential(
            pf.ColumnParallelLinear(D, F, has_bias=True, gather_output=False, backend="reference"),
            paddle.nn.Tanh(),
            pf.RowParallelLinear(F, D, has_bias=True, input_is_parallel=True, backend="reference"),
            _Gain())
    _set_values(model, seed=11 + paddle.distributed.get_rank())  # the shards differ by rank
    for replicated in (model[2].bias, model[3].gain):  # the same on every rank
        replicated.set_value(paddle.full(replicated.shape, 0.5, "float32"))
    return model


def _mode_plain(make_opt):
    with paddle.utils.unique_name.guard():
        model = paddle.nn.Sequential(paddle.nn.Linear(D, F), paddle.nn.Tanh(), paddle.nn.Linear(F, D))
    _set_values(model, seed=5)
    start = _start(model)
    opt = make_opt(model.parameters(), paddle.nn.ClipGradByGlobalNorm(CLIP_NORM), False)
    _train(model, opt, _batches(seed=3))
    return _updates(model, start)


def _mode_hybrid_mp2(make_opt):
    from paddle.distributed import fleet

    model = _mp_model()
    start = _start(model)
    opt = fleet.distributed_optimizer(make_opt(model.parameters(), paddle.nn.ClipGradByGlobalNorm(CLIP_NORM), False))
    _train(model, opt, _batches(seed=3))
    return _updates(model, start)


def _mode_hybrid_mp2_groups(make_opt):
    from paddle.distributed import fleet

    model = _mp_model()
    start = _start(model)
    groups = [{"params": model[0].parameters(), "weight_decay": 0.1},
              {"params": model[2].parameters() + model[3].parameters(), "learning_rate": 0.5}]
    opt = fleet.distributed_optimizer(make_opt(groups, paddle.nn.ClipGradByGlobalNorm(CLIP_NORM), False))
    _train(model, opt, _batches(seed=3))
    return _updates(model, start)


def _mode_mix_precision_mp2(make_opt):
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils import mix_precision_utils

    model = _mp_model()
    start = _start(model)
    mix_precision_utils.MixPrecisionLayer(model, dtype="bfloat16")  # main_grad hooks; the dtype is only checked
    inner = make_opt(model.parameters(), paddle.nn.ClipGradByGlobalNorm(CLIP_NORM), True)
    opt = fleet.distributed_optimizer(mix_precision_utils.MixPrecisionOptimizer(inner))
    _train(model, opt, _batches(seed=3))
    assert all(p.main_grad is not None and p.grad is None for p in model.parameters())  # the step read main_grad
    return _updates(model, start)


def _sharding_stage1(make_opt, main_grad):
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils import mix_precision_utils

    with paddle.utils.unique_name.guard():
        model = paddle.nn.Sequential(paddle.nn.Linear(D, F), paddle.nn.Tanh(), paddle.nn.Linear(F, F),
                                     paddle.nn.Tanh(), paddle.nn.Linear(F, D))
    _set_values(model, seed=5)
    start = _start(model)
    opt = make_opt(model.parameters(), paddle.nn.ClipGradByGlobalNorm(CLIP_NORM), main_grad)
    if main_grad:  # as PaddleNLP's Trainer wraps for --sharding stage1 --amp_master_grad
        mix_precision_utils.MixPrecisionLayer(model, dtype="bfloat16")
        opt = mix_precision_utils.MixPrecisionOptimizer(opt)
    opt = fleet.distributed_optimizer(opt)
    trained = fleet.distributed_model(model)
    _train(trained, opt, _batches(seed=3 + paddle.distributed.get_rank()))
    return _updates(model, start)


def _mode_sharding_stage1(make_opt):
    return _sharding_stage1(make_opt, main_grad=False)


def _mode_sharding_stage1_main_grad(make_opt):
    return _sharding_stage1(make_opt, main_grad=True)


# the fleet topologies, one launch each: init_fleet's arguments
TOPOLOGIES = {"mp2": {"mp_degree": 2}, "sharding2": {"sharding_degree": 2}}
# mode name -> (the topology it runs under, None for one process without fleet; its run)
MODES = {
    "plain": (None, _mode_plain),
    "hybrid_mp2": ("mp2", _mode_hybrid_mp2),
    "hybrid_mp2_groups": ("mp2", _mode_hybrid_mp2_groups),
    "mix_precision_mp2": ("mp2", _mode_mix_precision_mp2),
    "sharding_stage1": ("sharding2", _mode_sharding_stage1),
    "sharding_stage1_main_grad": ("sharding2", _mode_sharding_stage1_main_grad),
}


def _check_mode(mode):
    run = MODES[mode][1]
    want = run(_paddle_adamw)
    assert want and all(np.abs(update).max() > 0 for update in want.values()), f"{mode}: Paddle's AdamW moved nothing"
    for name, make_opt in OPTIMIZERS.items():
        got = run(make_opt)
        assert sorted(got) == sorted(want)
        for param, update in want.items():
            assert_close(f"{mode} / {name} / {param} update", got[param], update, "float32")


def _run_topology(topology):
    init_fleet(**TOPOLOGIES[topology])
    for mode, (where, _) in MODES.items():
        if where == topology:
            _check_mode(mode)
            print(f"rank {paddle.distributed.get_rank()}: {mode} ok", flush=True)


def _mp2_body():
    _run_topology("mp2")


def _sharding2_body():
    _run_topology("sharding2")


_BODIES = {"mp2": _mp2_body, "sharding2": _sharding2_body}


def test_plain():
    _check_mode("plain")


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_fleet_modes(topology):
    run_distributed(_BODIES[topology])
