"""FusedAdamW where the autograd contract reaches an optimizer: gradients accumulated over
micro-batches, frozen parameters and parameters without a gradient this step, bad hyper-parameters,
on both backends, against ``paddle.optimizer.AdamW``."""

import numpy as np
import paddle
import pytest

import paddlenlp_fused as pf
from paddlenlp_fused.testing.numerics import assert_close

BACKENDS = ("reference", "triton")


def _model(values):
    layers = []
    for v in values:
        p = paddle.create_parameter(list(v.shape), "float32")
        p.set_value(paddle.to_tensor(v))
        layers.append(p)
    return layers


def _train(make_opt, values, frozen, unused, x):
    """Two micro-batches accumulated, one step; returns the parameters after it."""
    params = _model(values)
    params[frozen].stop_gradient = True
    opt = make_opt(params)
    for micro in (x, 2.0 * x):
        loss = sum(((micro * p).sum() ** 2) for i, p in enumerate(params) if i != unused)
        loss.backward()
    opt.step()
    opt.clear_grad()
    return [p.numpy() for p in params]


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulated_frozen_and_unused_parameters_match_paddle_adamw(backend):
    values = [np.random.randn(5, 3).astype(np.float32) for _ in range(4)]
    x = paddle.to_tensor(np.random.randn(5, 3).astype(np.float32))
    kw = dict(learning_rate=0.1, weight_decay=0.01, epsilon=1e-8)
    ours = _train(lambda ps: pf.FusedAdamW(parameters=ps, moment_dtype="float32", stochastic_rounding=False,
                                           backend=backend, **kw), values, frozen=1, unused=2, x=x)
    plain = _train(lambda ps: paddle.optimizer.AdamW(parameters=ps, **kw), values, frozen=1, unused=2, x=x)
    for i, (a, b) in enumerate(zip(ours, plain)):
        if i in (1, 2):  # frozen, and no gradient this step: untouched
            assert np.array_equal(a, values[i]), f"parameter {i} moved"
        assert_close(f"parameter {i}", a, b, "float32")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,value", [(name, value) for name in ("learning_rate", "epsilon", "beta1", "beta2",
                                                                    "weight_decay")
                                        for value in (float("nan"), float("inf"), float("-inf"))])
def test_bad_hyper_parameters_raise_naming_them(name, value, backend):
    params = _model([np.zeros((2, 2), np.float32)])
    with pytest.raises(ValueError, match=name):
        pf.FusedAdamW(parameters=params, backend=backend, **{name: value})
    # the same in a parameter group (its learning_rate: a scale of the base rate)
    with pytest.raises(ValueError, match=rf"parameters\[0\]\W+{name}"):
        pf.FusedAdamW(parameters=[{"params": params, name: value}], backend=backend)
