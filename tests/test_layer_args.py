"""Every layer's constructor rejects a bad size, level, enum or range argument with a ValueError or
TypeError naming it, when it is built (not at the first forward, and not as Paddle's AssertionError),
and forward errors name the user's input rather than the weight it is compared with."""

import re

import numpy as np
import paddle
import pytest

import paddlenlp_fused as pf

BAD_ARGS = [
    # (layer, constructor call, error, the argument the message must name)
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(0), ValueError, "hidden_size"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(-3), ValueError, "hidden_size"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm("16"), TypeError, "hidden_size"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(16.0), TypeError, "hidden_size"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(16, epsilon=-1.0), ValueError, "epsilon"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(16, weight_offset=float("nan")), ValueError, "weight_offset"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(16, backend="cudnn"), ValueError, "backend"),
    ("FusedRMSNorm", lambda: pf.FusedRMSNorm(16, residual_in_fp32="yes"), TypeError, "residual_in_fp32"),
    ("FusedLayerNorm", lambda: pf.FusedLayerNorm(0), ValueError, "normalized_shape"),
    ("FusedLayerNorm", lambda: pf.FusedLayerNorm([4, 0]), ValueError, "normalized_shape"),
    ("FusedLayerNorm", lambda: pf.FusedLayerNorm([]), ValueError, "normalized_shape"),
    ("FusedLayerNorm", lambda: pf.FusedLayerNorm("8"), TypeError, "normalized_shape"),
    ("FusedLayerNorm", lambda: pf.FusedLayerNorm(8, epsilon=float("inf")), ValueError, "epsilon"),
    ("FusedLayerNorm", lambda: pf.FusedLayerNorm(8, backend="gpu"), ValueError, "backend"),
    ("GatedRMSNorm", lambda: pf.GatedRMSNorm(0), ValueError, "hidden_size"),
    ("GatedRMSNorm", lambda: pf.GatedRMSNorm(8, group_size=3), ValueError, "group_size"),
    ("GatedRMSNorm", lambda: pf.GatedRMSNorm(8, group_size=0), ValueError, "group_size"),
    ("GatedRMSNorm", lambda: pf.GatedRMSNorm(8, group_size="4"), TypeError, "group_size"),
    ("GatedRMSNorm", lambda: pf.GatedRMSNorm(8, backend="x"), ValueError, "backend"),
    ("FusedDense", lambda: pf.FusedDense(0, 6), ValueError, "in_features"),
    ("FusedDense", lambda: pf.FusedDense(-1, 6), ValueError, "in_features"),
    ("FusedDense", lambda: pf.FusedDense(4, 0), ValueError, "out_features"),
    ("FusedDense", lambda: pf.FusedDense("4", 6), TypeError, "in_features"),
    ("FusedDense", lambda: pf.FusedDense(4, 6, backend="cublas"), ValueError, "backend"),
    ("FusedMLP", lambda: pf.FusedMLP(0), ValueError, "in_features"),
    ("FusedMLP", lambda: pf.FusedMLP(8, hidden_features=0), ValueError, "hidden_features"),
    ("FusedMLP", lambda: pf.FusedMLP(8, out_features=-2), ValueError, "out_features"),
    ("FusedMLP", lambda: pf.FusedMLP(8, activation="tanh"), ValueError, "activation"),
    ("FusedMLP", lambda: pf.FusedMLP(8, checkpoint_lvl=3), ValueError, "checkpoint_lvl"),
    ("FusedMLP", lambda: pf.FusedMLP(8, heuristic=-1), ValueError, "heuristic"),
    ("FusedMLP", lambda: pf.FusedMLP(8, backend="fast"), ValueError, "backend"),
    ("ColumnParallelLinear", lambda: pf.ColumnParallelLinear(0, 8), ValueError, "in_features"),
    ("ColumnParallelLinear", lambda: pf.ColumnParallelLinear(8, 0), ValueError, "out_features"),
    ("ColumnParallelLinear", lambda: pf.ColumnParallelLinear(8, 8, backend="x"), ValueError, "backend"),
    ("RowParallelLinear", lambda: pf.RowParallelLinear(-8, 8), ValueError, "in_features"),
    ("RowParallelLinear", lambda: pf.RowParallelLinear(8, 0), ValueError, "out_features"),
    ("ParallelFusedMLP", lambda: pf.ParallelFusedMLP(8, hidden_features=0), ValueError, "hidden_features"),
    ("ParallelFusedMLP", lambda: pf.ParallelFusedMLP(8, checkpoint_lvl=5), ValueError, "checkpoint_lvl"),
    ("ParallelFusedMLP", lambda: pf.ParallelFusedMLP(8, heuristic="best"), TypeError, "heuristic"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 0), ValueError, "vocab_size"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(0, 11), ValueError, "hidden_size"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11.0), TypeError, "vocab_size"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, reduction="avg"), ValueError, "reduction"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, label_smoothing=1.0), ValueError,
     "label_smoothing"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, z_loss=-0.1), ValueError, "z_loss"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, softcap=0.0), ValueError, "softcap"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, shift=-1), ValueError, "shift"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, filter_eps="fast"), ValueError, "filter_eps"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, max_workspace_gib=0), ValueError,
     "max_workspace_gib"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, ignore_index=-1.5), TypeError, "ignore_index"),
    ("LinearCrossEntropy", lambda: pf.LinearCrossEntropy(8, 11, backend="x"), ValueError, "backend"),
    ("FlashContrastiveLoss", lambda: pf.FlashContrastiveLoss(init_scale=0.0), ValueError, "init_scale"),
    ("FlashContrastiveLoss", lambda: pf.FlashContrastiveLoss(init_scale=float("inf")), ValueError, "init_scale"),
    ("FlashContrastiveLoss", lambda: pf.FlashContrastiveLoss(max_scale=float("nan")), ValueError, "max_scale"),
    ("FlashContrastiveLoss", lambda: pf.FlashContrastiveLoss(reduction="avg"), ValueError, "reduction"),
    ("FlashContrastiveLoss", lambda: pf.FlashContrastiveLoss(precision="fp8"), ValueError, "precision"),
    ("FlashContrastiveLoss", lambda: pf.FlashContrastiveLoss(backend="x"), ValueError, "backend"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=0), ValueError, "d_model"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, d_conv=0), ValueError, "d_conv"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, d_state=0), ValueError, "d_state"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, expand=0), ValueError, "expand"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, dt_rank=0), ValueError, "dt_rank"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, checkpoint_lvl=5), ValueError, "checkpoint_lvl"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, dt_min=0.0), ValueError, "dt_min"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, dt_min=0.1, dt_max=0.01), ValueError, "dt_max"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, dt_init="normal"), ValueError, "dt_init"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, layer_idx=-1), ValueError, "layer_idx"),
    ("MambaMixer", lambda: pf.MambaMixer(d_model=8, backend="x"), ValueError, "backend"),
    ("MambaMixer", lambda: pf.MambaMixer(type("Config", (), dict(hidden_size=8, conv_kernel=0))()), ValueError,
     "config.conv_kernel"),
    ("Mamba2Block", lambda: pf.Mamba2Block(0), ValueError, "d_model"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, chunk_size=0), ValueError, "chunk_size"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, d_conv=0), ValueError, "d_conv"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, d_state=-1), ValueError, "d_state"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=0), ValueError, "headdim"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=8, ngroups=0), ValueError, "ngroups"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, expand="2"), TypeError, "expand"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=8, checkpoint_lvl=5), ValueError, "checkpoint_lvl"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=8, dt_limit=(0.1, 0.01)), ValueError, "dt_limit"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=8, dt_min=-1.0), ValueError, "dt_min"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=8, layer_idx=-2), ValueError, "layer_idx"),
    ("Mamba2Block", lambda: pf.Mamba2Block(16, headdim=8, backend="x"), ValueError, "backend"),
]


@pytest.mark.parametrize("layer, build, error, arg", BAD_ARGS,
                         ids=[f"{layer}-{arg}-{i}" for i, (layer, _, _, arg) in enumerate(BAD_ARGS)])
def test_constructor_rejects_bad_argument(layer, build, error, arg):
    with pytest.raises(error, match=rf"^{re.escape(arg)}\b"):
        build()


def test_every_layer_is_in_the_table():
    from paddlenlp_fused import layers  # noqa: F401  (the package's lazily exported layers)

    exported = {name for name, where in pf._EXPORTS.items() if where.startswith("layers.")
                and isinstance(getattr(pf, name), type) and issubclass(getattr(pf, name), paddle.nn.Layer)}
    assert exported <= {layer for layer, *_ in BAD_ARGS}, sorted(exported - {layer for layer, *_ in BAD_ARGS})


def _randn(*shape):
    return paddle.to_tensor(np.random.randn(*shape).astype(np.float32))


@pytest.mark.parametrize("layer, x, message", [
    (lambda: pf.FusedRMSNorm(16), (2, 17), r"^x: expected \[\.\.\., hidden_size=16\], got shape \[2, 17\]"),
    (lambda: pf.GatedRMSNorm(16), (2, 8), r"^x: expected \[\.\.\., hidden_size=16\]"),
    (lambda: pf.FusedDense(4, 6), (3, 5), r"^x: expected \[\.\.\., in_features=4\], got shape \[3, 5\]"),
    (lambda: pf.FusedMLP(4, 8), (3, 5), r"^x: expected \[\.\.\., in_features=4\]"),
    (lambda: pf.LinearCrossEntropy(8, 11), (2, 7), r"^hidden: expected \[\.\.\., hidden_size=8\]"),
])
def test_forward_error_names_the_input(layer, x, message):
    built = layer()
    with pytest.raises(ValueError, match=message):
        if isinstance(built, pf.LinearCrossEntropy):
            built(_randn(*x), paddle.zeros(x[:-1], dtype="int64"))
        else:
            built(_randn(*x))


def test_mamba2_marks_no_weight_decay_as_mamba_ssm():
    block = pf.Mamba2Block(16, d_state=4, headdim=8, chunk_size=4)
    marked = {name for name, p in block.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert marked == {"dt_bias", "A_log", "D"}
    assert {name for name, p in block.named_parameters() if getattr(p, "no_weight_decay", False)} == marked
    mixer = pf.MambaMixer(d_model=8)
    assert {name for name, p in mixer.named_parameters() if getattr(p, "_no_weight_decay", False)} == {"A_log", "D"}
