"""flash_contrastive_loss, cal_flash_loss and FlashContrastiveLoss: a NaN or inf scale raises a
ValueError naming ``scale`` (it would make every loss NaN), and an empty batch gives loss 0 with zero
gradients (docs/autograd.md), on every backend."""

import numpy as np
import paddle
import pytest

import paddlenlp_fused as pf

BACKENDS = ("reference", "triton")


def _randn(*shape):
    return paddle.to_tensor(np.random.randn(*shape).astype(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale_raises(backend, bad):
    q, k = _randn(4, 8), _randn(4, 8)
    for scale in (bad, paddle.to_tensor(bad, dtype="float32")):
        with pytest.raises(ValueError, match=r"^scale: expected a finite value"):
            pf.flash_contrastive_loss(q, k, scale=scale, backend=backend)
        with pytest.raises(ValueError, match=r"^scale: expected a finite value"):
            pf.cal_flash_loss(q, k, scale=scale, backend=backend)


def test_layer_with_an_overflowing_learnable_scale_raises():
    layer = pf.FlashContrastiveLoss(max_scale=None, backend="reference")
    layer.logit_scale.set_value(paddle.to_tensor(1000.0))  # exp overflows float32
    with pytest.raises(ValueError, match=r"^scale: expected a finite value"):
        layer(_randn(4, 8), _randn(4, 8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_empty_batch_gives_zero_loss_and_zero_gradients(backend, reduction, symmetric):
    q, k = _randn(0, 8), _randn(0, 8)
    scale = paddle.to_tensor(2.0)
    for t in (q, k, scale):
        t.stop_gradient = False
    loss = pf.flash_contrastive_loss(q, k, scale=scale, symmetric=symmetric, reduction=reduction,
                                     backend=backend)
    assert loss.dtype == paddle.float32
    assert list(loss.shape) == ([0] if reduction == "none" else [])
    if reduction != "none":
        assert float(loss) == 0.0
    loss.sum().backward()
    for name, t in (("q", q), ("k", k), ("scale", scale)):
        assert t.grad is not None, name
        grad = t.grad.numpy()
        assert list(grad.shape) == list(t.shape) and np.all(grad == 0), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_queries_against_candidates_and_the_layer(backend):
    """cal_flash_loss with no query rows (k still has rows): [0] losses, zero gradient for k; the
    layer's learnable scale gets a zero gradient too."""
    q, k = _randn(0, 8), _randn(5, 8)
    k.stop_gradient = False
    rows = pf.cal_flash_loss(q, k, backend=backend)
    assert list(rows.shape) == [0]
    rows.sum().backward()
    assert np.all(k.grad.numpy() == 0) and list(k.grad.shape) == [5, 8]
    layer = pf.FlashContrastiveLoss(backend=backend)
    loss = layer(_randn(0, 8), _randn(0, 8))
    loss.backward()
    assert float(loss) == 0.0 and float(layer.logit_scale.grad) == 0.0
    with pytest.raises(ValueError, match=r"^k: expected at least one row"):
        pf.cal_flash_loss(_randn(3, 8), _randn(0, 8), backend=backend)
