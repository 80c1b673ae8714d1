"""FusedAdamW where fleet's wrappers reach into an optimizer, in one process: ``_apply_optimize``
with the pairs and parameter-group dicts they pass, the clip they install after construction,
bfloat16 parameters with ``main_grad`` (MixPrecisionOptimizer), the stage-2 sharding protocol,
and the kernel-path tables under MoE routing. The 2-process runs inside the real wrappers are in
tests/contract/test_fleet_optimizer_contract.py."""

import numpy as np
import paddle
import pytest

from paddlenlp_fused.optimizer.adamw import TABLE_CACHE_SIZE, FusedAdamW
from paddlenlp_fused.testing.numerics import assert_close

LR = 0.01
# Paddle's CPU AdamW rounds its step differently from ours by a few float32 ulp a step (see
# tests/test_adamw.py): the bound after tens of steps
MANY_STEPS_BOUND = 1e-4


def _params(n=4, shape=(5, 3), seed=0):
    rng = np.random.default_rng(seed)
    with paddle.utils.unique_name.guard():
        out = []
        for _ in range(n):
            p = paddle.create_parameter(list(shape), "float32")
            p.set_value(paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)))
            out.append(p)
    return out


def _grads(params, seed):
    rng = np.random.default_rng(seed)
    return [paddle.to_tensor(rng.standard_normal(p.shape).astype(np.float32) * 3) for p in params]


def _fused(parameters, **kw):
    return FusedAdamW(LR, parameters=parameters, moment_dtype="float32", stochastic_rounding=False, **kw)


def _paddle(parameters, **kw):
    return paddle.optimizer.AdamW(LR, parameters=parameters, **kw)


def _check_updates(name, ours, theirs, start):
    for i, (a, b, s) in enumerate(zip(ours, theirs, start)):
        assert_close(f"{name}: parameter {i} update", a.numpy().astype(np.float64) - s,
                     b.numpy().astype(np.float64) - s, "float32")


def test_apply_optimize_applies_exactly_the_given_pairs():
    """A list of (param, grad) as DygraphShardingOptimizer passes its shard: only those move, with
    those gradients (not the parameters' own), clipped by the optimizer's clip; found_inf skips."""
    results, start = {}, None
    for label, make in (("ours", _fused), ("paddle", _paddle)):
        params = _params()
        start = [p.numpy().astype(np.float64) for p in params]
        opt = make(params, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1))
        for p in params:  # a gradient of their own that must not be read
            p.grad = paddle.ones_like(p)
        for step in range(3):
            opt._apply_optimize(None, None, list(zip(params[:2], _grads(params[:2], seed=step))))
        opt._set_auxiliary_var("found_inf", paddle.to_tensor(True))
        opt._apply_optimize(None, None, list(zip(params[:2], _grads(params[:2], seed=9))))
        results[label] = params
    _check_updates("given pairs", results["ours"], results["paddle"], start)
    for p, s in zip(results["ours"][2:], start[2:]):
        np.testing.assert_array_equal(p.numpy(), s.astype(np.float32))


def test_apply_optimize_takes_a_parameter_group_dict():
    """The dict MixPrecisionOptimizer passes per group: the pairs plus the group's options, the
    group's own clip and hyper-parameters."""
    results = {}
    for label, make in (("ours", _fused), ("paddle", _paddle)):
        params = _params()
        start = [p.numpy().astype(np.float64) for p in params]
        groups = [{"params": params[:2], "weight_decay": 0.3, "beta1": 0.8, "grad_clip": paddle.nn.ClipGradByNorm(0.5)},
                  {"params": params[2:], "learning_rate": 0.5}]
        opt = make(groups, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.2))
        for step in range(3):
            for group in opt._param_groups:
                given = dict(group, params=list(zip(group["params"], _grads(group["params"], seed=step))))
                opt._apply_optimize(None, None, given)
        results[label] = params
    _check_updates("group dicts", results["ours"], results["paddle"], start)


def test_default_clip_follows_the_clip_installed_after_construction():
    """Fleet's wrappers replace ``_grad_clip`` after construction: the optimizer-wide clip, and the
    groups that took the constructor's, use the new one; a group's own clip stays its own."""
    installed = paddle.nn.ClipGradByGlobalNorm(0.05)
    own = paddle.nn.ClipGradByNorm(0.5)

    def run(make, groups_of, replace):
        params = _params()
        opt = make(groups_of(params), grad_clip=None if replace else installed)
        if replace:
            opt._grad_clip = installed
        for step in range(3):
            for p, g in zip(params, _grads(params, seed=step)):
                p.grad = g
            opt.step()
            opt.clear_grad()
        return params

    for groups_of in (lambda ps: ps, lambda ps: [{"params": ps[:2], "grad_clip": own}, {"params": ps[2:]}]):
        start = [p.numpy().astype(np.float64) for p in _params()]
        _check_updates("installed clip", run(_fused, groups_of, replace=True), run(_paddle, groups_of, replace=False),
                       start)


def test_bfloat16_parameters_with_main_grad_in_mix_precision_optimizer():
    """``--amp_master_grad``: bfloat16 parameters, float32 ``main_grad``, MixPrecisionOptimizer. The
    master weights follow Paddle's AdamW on float32 copies with the same gradients (Paddle's CPU
    ``adamw`` kernel has no bfloat16: it cannot step the bfloat16 parameters itself), and each
    parameter is its master weight rounded to bfloat16."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionOptimizer

    plain = _params()
    low = [paddle.create_parameter(p.shape, "bfloat16", default_initializer=paddle.nn.initializer.Constant(0.0))
           for p in plain]
    for p, q in zip(low, plain):
        p.set_value(q.astype("bfloat16"))
        q.set_value(p.astype("float32"))  # the same values in both
    start = [p.numpy().astype(np.float64) for p in plain]
    clip = paddle.nn.ClipGradByGlobalNorm(0.1)
    ours = MixPrecisionOptimizer(_fused(low, grad_clip=clip))
    theirs = _paddle(plain, grad_clip=clip)
    for step in range(3):
        grads = _grads(plain, seed=step)
        for p, q, g in zip(low, plain, grads):
            p.main_grad, q.grad = g, g
        ours.step()
        theirs.step()
        ours.clear_grad()
        theirs.clear_grad()
    masters = [ours._master_weights[p.name] for p in low]
    _check_updates("bfloat16 + main_grad", masters, plain, start)
    for p, m in zip(low, masters):
        np.testing.assert_array_equal(p.numpy(), m.astype("bfloat16").numpy())


def test_sharding_stage2_protocol():
    """GroupShardedOptimizerStage2 needs a CUDA or XPU build of Paddle (its constructor asserts
    it), so it is stepped here as it drives the inner optimizer: ``_parameter_list`` and
    ``_param_groups`` set to this rank's parameters, ``_grad_clip`` replaced, ``step()``."""
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2)

    params = _params()
    with pytest.raises(AssertionError, match="Only GPU and XPU"):
        GroupShardedOptimizerStage2(params, _fused(params))

    results = {}
    for label, make in (("ours", _fused), ("paddle", _paddle)):
        params = _params()
        start = [p.numpy().astype(np.float64) for p in params]
        opt = make(params, grad_clip=None)  # (a clip that binds at every step would give the same Adam steps)
        opt._parameter_list = opt._param_groups = params[1:3]
        opt._grad_clip = paddle.nn.ClipGradByGlobalNorm(0.05)
        for step in range(3):
            for p, g in zip(params, _grads(params, seed=step)):
                p.grad = g
            opt.step()
            opt.clear_grad()
        results[label] = params
    _check_updates("stage-2 protocol", results["ours"], results["paddle"], start)
    for p, s in zip(results["ours"][::3], start[::3]):
        np.testing.assert_array_equal(p.numpy(), s.astype(np.float32))


def test_kernel_tables_stay_bounded_under_moe_routing():
    """6 experts, top-2 routing, ``clear_grad(set_to_zero=False)``: each step a different set of
    parameters has a gradient. 40 steps on the kernel path keep at most TABLE_CACHE_SIZE sets of
    device tables (the unbounded cache held 13 and grew), and the parameters follow Paddle's AdamW."""
    rng = np.random.default_rng(1)
    routes = [rng.choice(6, size=2, replace=False) for _ in range(40)]
    x = paddle.to_tensor(rng.standard_normal((3, 4)).astype(np.float32))

    def run(make):
        shared, *experts = _params(n=7, shape=(4, 4), seed=2)
        opt = make([shared, *experts])
        for route in routes:
            h = paddle.tanh(x @ shared)
            loss = sum(((h @ experts[e]) ** 2).sum() for e in route)
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
        return opt, [shared, *experts]

    ours, got = run(lambda ps: _fused(ps, backend="triton"))
    assert 0 < len(ours._tables) <= TABLE_CACHE_SIZE
    _, want = run(_paddle)
    for i, (a, b) in enumerate(zip(got, want)):
        err = np.linalg.norm(a.numpy() - b.numpy()) / np.linalg.norm(b.numpy())
        assert err <= MANY_STEPS_BOUND, f"parameter {i}: {err:.3e} off Paddle's AdamW"


def test_static_graph_error_names_the_cause(monkeypatch):
    opt = _fused(_params(n=1))
    monkeypatch.setattr(paddle, "in_dynamic_mode", lambda: False)
    with pytest.raises(NotImplementedError, match="static-graph"):
        opt._apply_optimize(None, None, [])
