"""The entries of the autograd contract suite: one ``Entry`` per public op or layer configuration.

A new op joins the suite by adding one ``Entry`` to ``ENTRIES``: its float32 inputs, the call of the
fused op (or the layer it builds) on a backend, the plain Paddle composition it must equal, and,
where they apply, its empty (0-token) inputs, its bad inputs and its low-precision (AMP) inputs.
Shapes are tiny: the Triton backend runs in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import paddle
import paddle.nn.functional as F

import paddlenlp_fused as pf
from paddlenlp_fused.reference import mamba as mamba_ref
from paddlenlp_fused.reference import ssd as ssd_ref
from paddlenlp_fused.reference.fused_dense import activation_ref
from paddlenlp_fused.reference.gated_activation import gated_activation_ref
from paddlenlp_fused.reference.norm import dropout_mask, rmsnorm_gated_ref


@dataclass
class Bad:
    """A bad input: ``change(inputs)`` returns the altered inputs (``options``: keyword arguments
    added to the fused call); every backend must raise ``error`` with ``arg`` (the argument's name)
    in its message."""
    label: str
    change: Callable[[dict], dict]
    error: type
    arg: str
    options: dict = field(default_factory=dict)


@dataclass
class Entry:
    """``inputs()``: name -> float32 tensor (int tensors are passed along, never differentiated).
    Functional entries: ``fused(backend, **inputs)`` and ``plain(**inputs)``. Layer entries:
    ``build(backend)`` returns the layer (the same parameters on every backend), ``fused(layer,
    **inputs)`` calls it and ``plain(layer, **inputs)`` computes the same from ``layer``'s
    parameters with plain Paddle ops (``layer`` is then a copy built for the reference backend).
    Outputs: a tensor or a tuple; float outputs enter the loss. ``low_precision``: the inputs that
    are activations (cast to bfloat16 in the AMP O1 check; O2 casts every float input and
    parameter), None where the op takes no low-precision inputs."""
    name: str
    inputs: Callable[[], dict]
    fused: Callable
    plain: Callable
    build: Optional[Callable] = None
    backends: tuple = ("reference", "triton")
    empty: Optional[Callable[[], dict]] = None
    bad: tuple = ()
    low_precision: Optional[tuple] = None
    o1: bool = True  # O1 (bf16 activations, fp32 weights) is accepted by the plain composition too
    amp_factor: Optional[float] = None  # see test_amp_dtypes: chains of bfloat16 roundings
    # the axes of the outputs that index tokens, where the weights' gradients are sums over every token
    # whose terms cancel: they are then measured against the loss's per-token terms (see _check_grad)
    token_axes: Optional[tuple] = None
    notes: dict = field(default_factory=dict)
    # check (or (check, backend)) -> a defect of a file owned elsewhere, reported: a strict xfail. Checks:
    # other_consumers, paddle_grad, stop_gradient, no_grad, non_contiguous, recompute, inplace,
    # create_graph, empty, O1, O2 (test_autograd_contract.py)
    known: dict = field(default_factory=dict)

    @property
    def is_layer(self) -> bool:
        return self.build is not None


def randn(*shape, scale=1.0):
    return paddle.to_tensor((np.random.randn(*shape) * scale).astype(np.float32))


def uniform(low, high, *shape):
    return paddle.to_tensor(np.random.uniform(low, high, shape).astype(np.float32))


def labels(high, *shape):
    return paddle.to_tensor(np.random.randint(0, high, shape).astype(np.int64))


def with_(**changes):
    return lambda inputs: {**inputs, **changes}


def built(layer_cls, *args, **kwargs):
    """A builder of ``layer_cls(*args, backend=..., **kwargs)`` with the same parameters for every
    backend (a fixed seed for the initialisers, then fresh random values for every parameter)."""
    def build(backend):
        rng = np.random.RandomState(1234)
        layer = layer_cls(*args, backend=backend, **kwargs)
        for p in layer.parameters():
            values = np.asarray(rng.randn(*p.shape) * 0.5, dtype=np.float32)
            p.set_value(paddle.to_tensor(values).astype(p.dtype))
        return layer
    return build


# ---- norms -----------------------------------------------------------------------------------

def _layer_norm_plain(x, weight, bias, residual, eps=1e-5):
    h = x + residual
    return F.layer_norm(h, h.shape[-1], weight=weight, bias=bias, epsilon=eps), h


def _rms(h, weight, eps=1e-6):
    return h * paddle.rsqrt((h * h).mean(axis=-1, keepdim=True) + eps) * weight


def _into_buffers(backend, x, weight, bias, residual, **options):
    """layer_norm_fn writing y and h into preallocated tensors (flash-attn's out / residual_out),
    which it must return."""
    out = options.pop("out", None)
    out = paddle.empty(x.shape, dtype=x.dtype) if out is None else out
    residual_out = paddle.empty(x.shape, dtype=residual.dtype)
    y, h = pf.layer_norm_fn(x, weight, bias, residual, prenorm=True, out=out, residual_out=residual_out,
                            backend=backend, **options)
    if y is not out or h is not residual_out:
        raise AssertionError("layer_norm_fn: out / residual_out are not the tensors returned")
    return y, h


_NORM_BAD = (
    Bad("weight shape", lambda i: {**i, "weight": randn(7)}, ValueError, "weight"),
    Bad("residual shape", lambda i: {**i, "residual": randn(3, 8)}, ValueError, "residual"),
    Bad("int x", lambda i: {**i, "x": paddle.ones(i["x"].shape, dtype="int32")}, TypeError, "x"),
)

NORMS = [
    Entry("layer_norm_fn(residual, prenorm)",
          lambda: dict(x=randn(2, 3, 16), weight=randn(16), bias=randn(16), residual=randn(2, 3, 16)),
          lambda backend, x, weight, bias, residual, eps=1e-5: pf.layer_norm_fn(x, weight, bias, residual, eps=eps,
                                                                              prenorm=True, backend=backend),
          _layer_norm_plain,
          empty=lambda: dict(x=randn(0, 16), weight=randn(16), bias=randn(16), residual=randn(0, 16)),
          bad=_NORM_BAD + (Bad("eps nan", with_(), ValueError, "eps", dict(eps=float("nan"))),),
          low_precision=("x", "residual")),
    Entry("rms_norm_fn(residual, prenorm)",
          lambda: dict(x=randn(5, 16), weight=randn(16), residual=randn(5, 16)),
          lambda backend, x, weight, residual: pf.rms_norm_fn(x, weight, None, residual, prenorm=True, backend=backend),
          lambda x, weight, residual: (_rms(x + residual, weight), x + residual),
          empty=lambda: dict(x=randn(0, 16), weight=randn(16), residual=randn(0, 16)),
          bad=_NORM_BAD, low_precision=("x", "residual")),
    Entry("rms_norm_fn",
          lambda: dict(x=randn(3, 5, 24), weight=randn(24)),
          lambda backend, x, weight: pf.rms_norm_fn(x, weight, backend=backend),
          lambda x, weight: _rms(x, weight),
          empty=lambda: dict(x=randn(2, 0, 24), weight=randn(24)),
          low_precision=("x",)),
    Entry("rmsnorm_gated_fn(group_size, norm after gate)",
          lambda: dict(x=randn(4, 16), weight=randn(16), z=randn(4, 16)),
          lambda backend, x, weight, z, group_size=8: pf.rmsnorm_gated_fn(x, weight, z, group_size=group_size,
                                                                          norm_before_gate=False, backend=backend),
          lambda x, weight, z: rmsnorm_gated_ref(x, weight, z, 1e-6, 8, False),
          empty=lambda: dict(x=randn(0, 16), weight=randn(16), z=randn(0, 16)),
          bad=(Bad("z shape", with_(z=randn(4, 8)), ValueError, "z"),
               Bad("group_size", with_(), ValueError, "group_size", dict(group_size=5))),
          low_precision=("x", "z")),
    Entry("layer_norm_fn(x1, weight1, bias1, residual, prenorm)",
          lambda: dict(x=randn(2, 3, 16), x1=randn(2, 3, 16), residual=randn(2, 3, 16), weight=randn(16),
                       bias=randn(16), weight1=randn(16), bias1=randn(16)),
          lambda backend, x, x1, residual, weight, bias, weight1, bias1: pf.layer_norm_fn(
              x, weight, bias, residual, x1, weight1, bias1, prenorm=True, backend=backend),
          lambda x, x1, residual, weight, bias, weight1, bias1: (
              F.layer_norm(x + x1 + residual, 16, weight=weight, bias=bias, epsilon=1e-5),
              F.layer_norm(x + x1 + residual, 16, weight=weight1, bias=bias1, epsilon=1e-5), x + x1 + residual),
          bad=(Bad("x1 shape", with_(x1=randn(2, 3, 8)), ValueError, "x1"),
               Bad("bias1 shape", with_(bias1=randn(8)), ValueError, "bias1")),
          low_precision=("x", "x1", "residual")),
    Entry("layer_norm_fn(out, residual_out, residual, prenorm)",
          lambda: dict(x=randn(2, 3, 16), weight=randn(16), bias=randn(16), residual=randn(2, 3, 16)),
          _into_buffers,
          _layer_norm_plain,
          empty=lambda: dict(x=randn(0, 16), weight=randn(16), bias=randn(16), residual=randn(0, 16)),
          bad=(Bad("out shape", with_(), ValueError, "out", dict(out=randn(2, 3, 8))),),
          low_precision=("x", "residual")),
    Entry("rms_norm_fn(x1, residual, prenorm)",
          lambda: dict(x=randn(5, 16), x1=randn(5, 16), residual=randn(5, 16), weight=randn(16)),
          lambda backend, x, x1, residual, weight: pf.rms_norm_fn(x, weight, None, residual, x1, prenorm=True,
                                                                  backend=backend),
          lambda x, x1, residual, weight: (_rms(x + x1 + residual, weight), x + x1 + residual),
          empty=lambda: dict(x=randn(0, 16), x1=randn(0, 16), residual=randn(0, 16), weight=randn(16)),
          bad=(Bad("x1 shape", with_(x1=randn(5, 8)), ValueError, "x1"),),
          low_precision=("x", "x1", "residual")),
    Entry("rms_norm_fn(rowscale, dropout_p, seed, residual)",
          lambda: dict(x=randn(5, 16), weight=randn(16), rowscale=randn(5), residual=randn(5, 16)),
          lambda backend, x, weight, rowscale, residual: pf.rms_norm_fn(
              x, weight, None, residual, dropout_p=0.25, rowscale=rowscale, seed=5, backend=backend),
          lambda x, weight, rowscale, residual: _rms(
              x * rowscale.unsqueeze(-1) * dropout_mask(x.shape, 0.25, 5).astype(x.dtype) / 0.75 + residual, weight),
          backends=("reference",),  # (plain draws the reference's mask; Triton's is Philox, tested in test_norm)
          bad=(Bad("rowscale shape", with_(rowscale=randn(16)), ValueError, "rowscale"),),
          low_precision=("x", "residual")),
    Entry("rmsnorm_gated_fn(bias, is_rms_norm=False, group_size)",
          lambda: dict(x=randn(4, 16), weight=randn(16), bias=randn(16), z=randn(4, 16)),
          lambda backend, x, weight, bias, z: pf.rmsnorm_gated_fn(x, weight, z, group_size=8, backend=backend,
                                                                  bias=bias, is_rms_norm=False),
          lambda x, weight, bias, z: (F.layer_norm(x.reshape([-1, 2, 8]), 8, epsilon=1e-6).reshape(x.shape) * weight
                                      + bias) * F.silu(z),
          empty=lambda: dict(x=randn(0, 16), weight=randn(16), bias=randn(16), z=randn(0, 16)),
          bad=(Bad("bias shape", with_(bias=randn(8)), ValueError, "bias"),),
          low_precision=("x", "z")),
    Entry("FusedLayerNorm(residual)",
          lambda: dict(x=randn(3, 12), residual=randn(3, 12)),
          lambda layer, x, residual: layer(x, residual),
          lambda layer, x, residual: _layer_norm_plain(x, layer.weight, layer.bias, residual),
          build=built(pf.FusedLayerNorm, 12),
          empty=lambda: dict(x=randn(0, 12), residual=randn(0, 12)),
          low_precision=("x", "residual")),
    Entry("FusedRMSNorm",
          lambda: dict(x=randn(2, 3, 12)),
          lambda layer, x: layer(x),
          lambda layer, x: _rms(x, layer.weight),
          build=built(pf.FusedRMSNorm, 12),
          empty=lambda: dict(x=randn(0, 3, 12)),
          low_precision=("x",)),
    Entry("GatedRMSNorm",
          lambda: dict(x=randn(3, 12), z=randn(3, 12)),
          lambda layer, x, z: layer(x, z),
          lambda layer, x, z: rmsnorm_gated_ref(x, layer.weight, z, 1e-6, None, True),
          build=built(pf.GatedRMSNorm, 12),
          low_precision=("x", "z")),
]


# ---- gated activations, dense and MLP ----------------------------------------------------------

def _plain_mlp(x, w1, w2, b1, b2, activation):
    return paddle.matmul(activation_ref(paddle.matmul(x, w1) + b1, activation), w2) + b2


GATED = [
    Entry(f"{name}",
          lambda: dict(x=randn(3, 5, 16)),
          lambda backend, x, name=name: getattr(pf, name)(x, backend=backend),
          lambda x, act=act: gated_activation_ref(x, act),
          empty=lambda: dict(x=randn(0, 16)),
          bad=(Bad("odd last axis", with_(x=randn(3, 5)), ValueError, "x"),
               Bad("int x", with_(x=paddle.ones([3, 4], dtype="int64")), TypeError, "x")),
          low_precision=("x",))
    for name, act in (("swiglu", "silu"), ("geglu", "gelu_tanh"))
]

# the MLPs' kernels round the hidden activations to bfloat16 between their GEMMs (as the plain
# composition in bfloat16 does) where the reference keeps them float32: up to 4.5x the reference's
# error seen; over 150 seeds of five MLP entries (O1 as O2) at most 0.35 of this factor's limits
MLP_AMP_FACTOR = 3

_DENSE_BAD = (Bad("weight rows", with_(weight=randn(7, 6)), ValueError, "weight"),
              Bad("bias shape", with_(bias=randn(5)), ValueError, "bias"))

DENSE = [
    Entry("fused_dense_func",
          lambda: dict(x=randn(2, 3, 8), weight=randn(8, 6), bias=randn(6)),
          lambda backend, x, weight, bias: pf.fused_dense_func(x, weight, bias, backend=backend),
          lambda x, weight, bias: paddle.matmul(x, weight) + bias,
          backends=("reference", "triton"),
          empty=lambda: dict(x=randn(0, 8), weight=randn(8, 6), bias=randn(6)),
          bad=_DENSE_BAD, low_precision=("x",), o1=True),
] + [
    Entry(f"fused_mlp_func({act}, checkpoint_lvl={lvl})",
          lambda act=act: dict(x=randn(5, 8), w1=randn(8, 12 if act in ("swiglu", "geglu") else 6, scale=0.5),
                               w2=randn(6, 4, scale=0.5), b1=randn(12 if act in ("swiglu", "geglu") else 6),
                               b2=randn(4)),
          lambda backend, x, w1, w2, b1, b2, act=act, lvl=lvl: pf.fused_mlp_func(
              x, w1, w2, b1, b2, activation=act, checkpoint_lvl=lvl, backend=backend),
          lambda x, w1, w2, b1, b2, act=act: _plain_mlp(x, w1, w2, b1, b2, act),
          empty=lambda act=act: dict(x=randn(0, 8), w1=randn(8, 12 if act in ("swiglu", "geglu") else 6),
                                     w2=randn(6, 4), b1=randn(12 if act in ("swiglu", "geglu") else 6), b2=randn(4)),
          bad=(Bad("weight1 rows", with_(w1=randn(7, 6)), ValueError, "weight1"),),
          low_precision=("x",), amp_factor=MLP_AMP_FACTOR)
    for act, lvl in (("gelu_approx", 0), ("gelu_approx", 1), ("relu", 2), ("swiglu", 1))
] + [
    Entry("FusedDense", lambda: dict(x=randn(4, 8)), lambda layer, x: layer(x),
          lambda layer, x: paddle.matmul(x, layer.weight) + layer.bias, build=built(pf.FusedDense, 8, 6),
          empty=lambda: dict(x=randn(0, 8)), low_precision=("x",)),
    Entry("FusedMLP(gelu_approx, checkpoint_lvl=2)", lambda: dict(x=randn(4, 8)), lambda layer, x: layer(x),
          lambda layer, x: _plain_mlp(x, layer.fc1.weight, layer.fc2.weight, layer.fc1.bias, layer.fc2.bias,
                                      "gelu_approx"),
          build=built(pf.FusedMLP, 8, 12, activation="gelu_approx", checkpoint_lvl=2),
          empty=lambda: dict(x=randn(0, 8)), low_precision=("x",), amp_factor=MLP_AMP_FACTOR),
    Entry("ColumnParallelLinear(1 process)", lambda: dict(x=randn(2, 3, 8)), lambda layer, x: layer(x),
          lambda layer, x: paddle.matmul(x, layer.weight) + layer.bias,
          build=built(pf.ColumnParallelLinear, 8, 6, has_bias=True), low_precision=("x",)),
    Entry("RowParallelLinear(1 process)", lambda: dict(x=randn(2, 3, 8)), lambda layer, x: layer(x),
          lambda layer, x: paddle.matmul(x, layer.weight) + layer.bias,
          build=built(pf.RowParallelLinear, 8, 6), low_precision=("x",)),
    Entry("ParallelFusedMLP(1 process)", lambda: dict(x=randn(3, 8)), lambda layer, x: layer(x),
          lambda layer, x: _plain_mlp(x, layer.fc1.weight, layer.fc2.weight, layer.fc1.bias, layer.fc2.bias,
                                      "gelu_approx"),
          build=built(pf.ParallelFusedMLP, 8, 12), low_precision=("x",), amp_factor=MLP_AMP_FACTOR),
]


# ---- losses ------------------------------------------------------------------------------------

def _plain_lce(hidden, weight, labels, bias=None):
    """The mean over the labelled tokens of lse - the label's logit, written out: Paddle's CPU
    F.cross_entropy clips a token's loss at 64 and, for ignore_index < 0 (-100 here), divides by every
    token."""
    logits = paddle.matmul(hidden, weight, transpose_y=True)
    if bias is not None:
        logits = logits + bias
    logits, labels = logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1])
    valid = labels != -100
    picked = paddle.take_along_axis(logits, paddle.clip(labels, 0, logits.shape[-1] - 1).unsqueeze(-1), axis=-1)
    loss = paddle.logsumexp(logits, axis=-1) - picked.squeeze(-1)
    loss = paddle.where(valid, loss, paddle.zeros_like(loss))
    return loss.sum() / paddle.clip(valid.astype("float32").sum(), min=1.0)


def _confident_lce(shape, D, V):
    """hidden [*shape, D] and weight [V, D] whose logits are in the thousands (the regime where Paddle's
    softmax clips), their classes 200 apart: hidden's first channel is +-100, weight's first column
    a permutation of 0, 2, ..., 2 (V - 1); the other channels add O(3). The softmax is then one-hot in
    float32 too, so the fused op and the float32 composition agree to rounding."""
    hidden = np.random.randn(*shape, D)
    hidden[..., 0] = 100.0 * np.sign(np.random.randn(*shape))
    weight = np.random.randn(V, D)
    weight[:, 0] = 2.0 * np.random.permutation(V)
    return paddle.to_tensor(hidden.astype(np.float32)), paddle.to_tensor(weight.astype(np.float32))


def _some_ignored(high, *shape):
    """Labels with about a third ignored (-100), at least one of each kind."""
    values = np.random.randint(0, high, shape).reshape(-1)
    values[np.random.permutation(values.size)[:max(1, values.size // 3)]] = -100
    return paddle.to_tensor(values.reshape(shape).astype(np.int64))


def _lce_inputs(shape, bias=False):
    hidden, weight = _confident_lce(shape, 8, 11)
    inputs = dict(hidden=hidden, weight=weight, labels=_some_ignored(11, *shape))
    return {**inputs, "bias": randn(11)} if bias else inputs


def _confident_layer(backend):
    """LinearCrossEntropy(8, 11) whose [D, V] weight gives _confident_lce's logits."""
    layer = built(pf.LinearCrossEntropy, 8, 11)(backend)
    rng = np.random.RandomState(4321)
    weight = rng.randn(8, 11)
    weight[0] = 2.0 * rng.permutation(11)
    layer.weight.set_value(paddle.to_tensor(weight.astype(np.float32)))
    return layer


def _plain_contrastive(q, k, scale=2.0, symmetric=False):
    logits = scale * paddle.matmul(q, k, transpose_y=True)
    targets = paddle.arange(q.shape[0], dtype="int64")
    loss = F.cross_entropy(logits, targets)
    if symmetric:
        loss = 0.5 * (loss + F.cross_entropy(logits.T, targets))
    return loss


def _matching_pairs(batch, dim):
    """q and k whose rows i match (k_i = q_i plus noise), as contrastive training sees them. The
    scale's gradient sums each row's softmax mean of S minus S_ii: of one sign where pairs match,
    while unrelated draws make it a sum that cancels to near zero, whose relative error no rounding
    bound holds (the bfloat16 path rounds each term)."""
    q = np.random.randn(batch, dim) * 0.5
    k = q + np.random.randn(batch, dim) * 0.25
    return dict(q=paddle.to_tensor(q.astype(np.float32)), k=paddle.to_tensor(k.astype(np.float32)))


LOSSES = [
    Entry("linear_cross_entropy",
          lambda: _lce_inputs((2, 3)),
          lambda backend, hidden, weight, labels: pf.linear_cross_entropy(hidden, weight, labels, backend=backend),
          _plain_lce,
          empty=lambda: dict(hidden=randn(0, 8), weight=randn(11, 8), labels=labels(11, 0)),
          bad=(Bad("weight dim", with_(weight=randn(11, 7)), ValueError, "weight"),
               Bad("labels shape", with_(labels=labels(11, 5)), ValueError, "labels"),
               Bad("float labels", with_(labels=randn(2, 3)), TypeError, "labels")),
          low_precision=("hidden",)),
    Entry("linear_cross_entropy(bias, deterministic)",
          lambda: _lce_inputs((2, 3), bias=True),
          lambda backend, **t: pf.linear_cross_entropy(**t, backend=backend, deterministic=True),
          _plain_lce),
    Entry("LinearCrossEntropy",
          lambda: dict(hidden=_confident_lce((5,), 8, 11)[0], labels=_some_ignored(11, 5)),
          lambda layer, hidden, labels: layer(hidden, labels),
          lambda layer, hidden, labels: _plain_lce(hidden, layer.weight.T, labels),
          build=_confident_layer,
          low_precision=("hidden",)),
    Entry("flash_contrastive_loss",
          lambda: dict(q=randn(6, 8, scale=0.5), k=randn(6, 8, scale=0.5)),
          lambda backend, q, k: pf.flash_contrastive_loss(
              q, k, scale=2.0, backend=backend, precision="ieee" if q.dtype == paddle.float32 else "auto"),
          _plain_contrastive,
          bad=(Bad("k dim", with_(k=randn(6, 7)), ValueError, "k"),
               Bad("q rank", with_(q=randn(6)), ValueError, "q")),
          empty=lambda: dict(q=randn(0, 8), k=randn(0, 8)),  # loss 0 (the plain mean over 0 rows is NaN)
          low_precision=("q", "k")),
    Entry("FlashContrastiveLoss(symmetric, learnable scale)", lambda: _matching_pairs(5, 8),
          lambda layer, q, k: layer(q, k),
          lambda layer, q, k: _plain_contrastive(q, k, layer.scale(), symmetric=True),
          build=built(pf.FlashContrastiveLoss, symmetric=True, learnable_scale=True, init_scale=2.0),
          empty=lambda: dict(q=randn(0, 8), k=randn(0, 8)),
          low_precision=("q", "k")),
]


# the plain composition does not take these AMP inputs on CPU: nn.Linear's matmul has no CPU
# bfloat16 kernel (O2) and no mixed bfloat16 x float32 form (O1)
_NO_CPU_BF16_LINEAR = "not on CPU: the layer's nn.Linear projections, as the plain composition's, lack bfloat16"


# the Mamba ops round their intermediates (delta, conv output, states, the gated norm's input) to
# bfloat16 where the reference keeps float32: 3.4e-2 seen against float32 for the split path's O2 input
# gradient, 4.4x bfloat16's bound; 16 leaves a margin of 3.7
MAMBA_AMP_FACTOR = 16


# ---- Mamba-1 -----------------------------------------------------------------------------------

def _scan_inputs(batch=2, dim=4, seqlen=7, dstate=3):
    return dict(u=randn(batch, dim, seqlen), delta=randn(batch, dim, seqlen, scale=0.5),
                A=-uniform(0.5, 1.5, dim, dstate), B=randn(batch, dstate, seqlen), C=randn(batch, dstate, seqlen),
                D=randn(dim), z=randn(batch, dim, seqlen), delta_bias=randn(dim, scale=0.5))


def _complex_scan_inputs(batch=2, dim=4, seqlen=7, dstate=3):
    """Complex A (passed along: the suite differentiates the float inputs) with input-dependent B and C
    as mamba_ssm's real (re, im) pairs [batch, dstate, 2 seqlen]."""
    return dict(u=randn(batch, dim, seqlen), delta=randn(batch, dim, seqlen, scale=0.5),
                A=paddle.complex(-uniform(0.5, 1.5, dim, dstate), randn(dim, dstate, scale=2.0)),
                B=randn(batch, dstate, 2 * seqlen), C=randn(batch, dstate, 2 * seqlen), D=randn(dim),
                z=randn(batch, dim, seqlen), delta_bias=randn(dim, scale=0.5))


def _inner_inputs(batch=2, dim=4, seqlen=6, dstate=3, rank=2, d_model=5):
    return dict(xz=randn(batch, 2 * dim, seqlen), conv_w=randn(dim, 4, scale=0.5), conv_b=randn(dim),
                x_proj_w=randn(dim, rank + 2 * dstate, scale=0.5), delta_proj_w=randn(rank, dim, scale=0.5),
                out_proj_w=randn(dim, d_model, scale=0.5), A=-uniform(0.5, 1.5, dim, dstate), D=randn(dim),
                delta_bias=randn(dim, scale=0.5))


def _scan(**kw):
    """selective_scan_fn with softplus on a backend (``kw``: its other options)."""
    return lambda backend, **t: pf.selective_scan_fn(**t, delta_softplus=True, backend=backend, **kw)


def _scan_ref(**t):
    return mamba_ref.selective_scan_ref(**t, delta_softplus=True)


def _inner(fn, **kw):
    return lambda xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, A, D, delta_bias: fn(
        xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, None, A, D=D, delta_bias=delta_bias,
        delta_softplus=True, **kw)


MAMBA = [
    Entry("selective_scan_fn",
          _scan_inputs,
          _scan(),
          _scan_ref,
          empty=lambda: _scan_inputs(seqlen=0),
          bad=(Bad("delta shape", lambda i: {**i, "delta": randn(2, 4, 3)}, ValueError, "delta"),
               Bad("A rows", lambda i: {**i, "A": randn(3, 3)}, ValueError, "A")),
          low_precision=("u", "delta", "z"), amp_factor=MAMBA_AMP_FACTOR),
    Entry("selective_scan_fn(deterministic)",
          _scan_inputs,
          _scan(deterministic=True),
          _scan_ref),
    Entry("selective_scan_fn(complex A)",
          _complex_scan_inputs,
          _scan(),
          _scan_ref,
          empty=lambda: _complex_scan_inputs(seqlen=0),
          bad=(Bad("B pairs length", lambda i: {**i, "B": randn(2, 3, 7)}, ValueError, "B"),
               Bad("complex input-dependent C", lambda i: {**i, "C": paddle.complex(i["C"], i["C"])}, TypeError,
                   "C")),
          low_precision=("u", "delta", "z"), amp_factor=MAMBA_AMP_FACTOR),
    Entry("causal_conv1d_fn",
          lambda: dict(x=randn(2, 5, 9), weight=randn(5, 4), bias=randn(5)),
          lambda backend, x, weight, bias: pf.causal_conv1d_fn(x, weight, bias, activation="silu", backend=backend),
          lambda x, weight, bias: mamba_ref.causal_conv1d_ref(x, weight, bias, activation="silu"),
          empty=lambda: dict(x=randn(2, 5, 0), weight=randn(5, 4), bias=randn(5)),
          bad=(Bad("weight dim", with_(weight=randn(4, 4)), ValueError, "weight"),
               Bad("bias shape", with_(bias=randn(4)), ValueError, "bias")),
          low_precision=("x",)),
    Entry("causal_conv1d_fn(seq_idx with padding, deterministic)",
          lambda: dict(x=randn(2, 5, 9), weight=randn(5, 4), bias=randn(5), seq_idx=paddle.to_tensor(
              np.array([[-1, 0, 0, 0, -1, 1, 1, 1, 1], [0, 0, 0, 0, 0, -1, -1, 2, 2]]))),
          lambda backend, x, weight, bias, seq_idx: pf.causal_conv1d_fn(x, weight, bias, seq_idx, activation="silu",
                                                                        backend=backend, deterministic=True),
          lambda x, weight, bias, seq_idx: mamba_ref.causal_conv1d_ref(x, weight, bias, seq_idx, activation="silu"),
          low_precision=("x",)),
    Entry("mamba_inner_fn(checkpoint_lvl=1)",
          _inner_inputs,
          lambda backend, **t: _inner(pf.mamba_inner_fn, checkpoint_lvl=1, backend=backend)(**t),
          lambda **t: _inner(mamba_ref.mamba_inner_ref)(**t),
          empty=lambda: _inner_inputs(seqlen=0),
          bad=(Bad("xz odd", lambda i: {**i, "xz": randn(2, 7, 6)}, ValueError, "xz"),),
          low_precision=("xz",), amp_factor=MAMBA_AMP_FACTOR),
    Entry("mamba_inner_fn(checkpoint_lvl=0)",
          _inner_inputs,
          lambda backend, **t: _inner(pf.mamba_inner_fn, checkpoint_lvl=0, backend=backend)(**t),
          lambda **t: _inner(mamba_ref.mamba_inner_ref)(**t),
          low_precision=("xz",), amp_factor=MAMBA_AMP_FACTOR),
    Entry("mamba_inner_fn(b/c/dt_rms_weight)",
          lambda: dict(_inner_inputs(), b_rms=randn(3), c_rms=randn(3), dt_rms=randn(4)),
          lambda backend, b_rms, c_rms, dt_rms, **t: _inner(
              pf.mamba_inner_fn, b_rms_weight=b_rms, c_rms_weight=c_rms, dt_rms_weight=dt_rms, backend=backend)(**t),
          lambda b_rms, c_rms, dt_rms, **t: _inner(
              mamba_ref.mamba_inner_ref, b_rms_weight=b_rms, c_rms_weight=c_rms, dt_rms_weight=dt_rms)(**t),
          low_precision=("xz",), amp_factor=MAMBA_AMP_FACTOR),
    Entry("MambaMixer",
          lambda: dict(hidden_states=randn(2, 6, 8)),
          lambda layer, hidden_states: layer(hidden_states),
          lambda layer, hidden_states: layer(hidden_states),
          build=built(pf.MambaMixer, d_model=8, d_state=4, d_conv=3, expand=1),
          notes={"amp": _NO_CPU_BF16_LINEAR}),
]


# ---- Mamba-2 -----------------------------------------------------------------------------------

def _ssd_inputs(batch=1, seqlen=12, nheads=2, headdim=4, ngroups=1, dstate=4):
    return dict(x=randn(batch, seqlen, nheads, headdim), dt=randn(batch, seqlen, nheads, scale=0.5),
                A=-uniform(0.5, 1.5, nheads), B=randn(batch, seqlen, ngroups, dstate),
                C=randn(batch, seqlen, ngroups, dstate), D=randn(nheads), z=randn(batch, seqlen, nheads, headdim),
                dt_bias=randn(nheads, scale=0.5))


def _split_inputs(batch=1, seqlen=10, nheads=4, headdim=4, dstate=4, width=4, d_out=6):
    """Four heads: dA, dD and ddt_bias sum one term a token per head, which cancel, and the relative
    error of a two-element sum has a long tail (dD at O2 reached 0.92 of its limit within ~50 draws
    with two heads; 0.27 within 100 with four)."""
    dim, conv_dim = nheads * headdim, nheads * headdim + 2 * dstate
    return dict(zxbcdt=randn(batch, seqlen, 2 * dim + 2 * dstate + nheads), conv_w=randn(conv_dim, width, scale=0.5),
                conv_b=randn(conv_dim), dt_bias=randn(nheads, scale=0.5), A=-uniform(0.5, 1.5, nheads),
                D=randn(nheads), norm_w=randn(dim), out_w=randn(dim, d_out, scale=0.5))


def _split(backend, lvl, zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w):
    return pf.mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, 8, headdim=4,
                                               rmsnorm_weight=norm_w, outproj_weight=out_w, checkpoint_lvl=lvl,
                                               backend=backend)


MAMBA2 = [
    Entry("mamba_chunk_scan_combined",
          _ssd_inputs,
          lambda backend, **t: pf.mamba_chunk_scan_combined(**{**t, "chunk_size": 8}, dt_softplus=True,
                                                            backend=backend),
          lambda **t: ssd_ref.ssd_chunked_ref(**{**t, "chunk_size": 8}, dt_softplus=True)[0],
          empty=lambda: _ssd_inputs(seqlen=0),
          bad=(Bad("dt shape", lambda i: {**i, "dt": randn(1, 12, 3)}, ValueError, "dt"),
               Bad("C shape", lambda i: {**i, "C": randn(1, 12, 1, 3)}, ValueError, "C")),
          low_precision=("x", "dt", "B", "C", "z"), amp_factor=MAMBA_AMP_FACTOR),
] + [
    Entry(f"mamba_split_conv1d_scan_combined(checkpoint_lvl={lvl})",
          _split_inputs,
          lambda backend, lvl=lvl, **t: _split(backend, lvl, **t),
          lambda **t: _split("reference", 1, **t),
          bad=(Bad("zxbcdt width", lambda i: {**i, "zxbcdt": randn(1, 10, 5)}, ValueError, "zxbcdt"),),
          low_precision=("zxbcdt",), amp_factor=MAMBA_AMP_FACTOR)
    for lvl in (0, 1)
] + [
    Entry("Mamba2Block",
          lambda: dict(u=randn(2, 10, 8)),
          lambda layer, u: layer(u),
          lambda layer, u: layer(u),
          build=built(pf.Mamba2Block, 8, d_state=4, d_conv=3, expand=1, headdim=4, chunk_size=8),
          notes={"amp": _NO_CPU_BF16_LINEAR}),
]

# dA, dD, d(dt_bias), the conv and projection weights' gradients: sums over every token whose terms
# cancel; the outputs' tokens on axes (0, 2) for the scan and the conv ([batch, dim, seqlen]), else (0, 1)
for _entry in MAMBA + MAMBA2:
    _entry.token_axes = (0, 2) if _entry.name.startswith(("selective_scan_fn", "causal_conv1d_fn")) else (0, 1)

ENTRIES = NORMS + GATED + DENSE + LOSSES + MAMBA + MAMBA2
