"""The examples: fused and plain runs give the same losses (the main job, GPT, Mamba, Mamba-2), and the
data generators stay small at the base vocabulary. Tiny configs, a few steps each, on the reference
backend (what a CPU run of an example takes; the suite's interpreter would take minutes)."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import common  # noqa: E402
from paddlenlp_fused import use_backend  # noqa: E402


def _run(module, tmp_path, *flags, steps=3):
    main = __import__(module).main
    with use_backend("reference"):
        return np.array(main(["--steps", str(steps), "--plot", str(tmp_path / f"{module}.png"), *flags]))


@pytest.mark.parametrize("module", ["train_llama", "train_gpt", "train_mamba", "train_mamba2"])
def test_fused_and_plain_losses_match(module, tmp_path, capsys):
    if module in ("train_gpt", "train_mamba"):
        pytest.importorskip("paddlenlp")
    fused = _run(module, tmp_path, "--fused")
    printed = capsys.readouterr().out
    # on the reference, FusedAdamW keeps float32 moments by default: Paddle's AdamW update, as the plain run's
    assert "backend: reference (forced)" in printed and "FusedAdamW (float32 moments)" in printed, printed
    plain = _run(module, tmp_path, "--no-fused")
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
    assert (tmp_path / f"{module}.png").stat().st_size > 0


def _same_weights(module):
    """The example's fused and plain models built from the same seed (so with the same weights), and its
    loss function ``loss_of(model, inputs, labels)``."""
    import paddle

    example, cfg = __import__(module), __import__(module).SIZES["tiny"]
    built = []
    for fused in (True, False):
        paddle.seed(0)
        np.random.seed(0)
        if module in ("train_llama", "train_mamba2"):
            model = (example.TinyLlama if module == "train_llama" else example.TinyMamba2)(cfg, fused)
        else:
            from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

            build = example.build_gpt if module == "train_gpt" else example.build_mamba
            model = (getattr(example, "build_mamba_fused", build) if fused else build)(cfg)
            if fused:
                swap_fused_layers(model)
        built.append(model)
    loss_of = getattr(example, "mamba_loss", None) or getattr(example, "labelled_loss", lambda m, x, y: m(x, y))
    return built, loss_of, cfg


@pytest.mark.parametrize("module", ["train_llama", "train_gpt", "train_mamba", "train_mamba2"])
def test_plain_loss_takes_the_mean_over_counted_tokens(module):
    """With ignored labels (-100) the plain loss is the mean over the other tokens, as the fused one (and
    PaddleNLP's criteria): not Paddle's mean over every token."""
    import paddle

    if module in ("train_gpt", "train_mamba"):
        pytest.importorskip("paddlenlp")
    (fused, plain), loss_of, cfg = _same_weights(module)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg["vocab"], (2, 17))
    labels = tokens[:, 1:].copy()
    labels[:, ::3] = -100  # a third of the tokens: PaddleNLP's and linear_cross_entropy's ignore_index
    inputs, labels = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(labels)
    with use_backend("reference"):
        fused_loss, plain_loss = float(loss_of(fused, inputs, labels)), float(loss_of(plain, inputs, labels))
    assert math.isfinite(plain_loss), plain_loss
    assert abs(fused_loss - plain_loss) <= 1e-5 * abs(plain_loss), (fused_loss, plain_loss)


def test_cross_entropy_means_over_counted_tokens():
    import paddle

    rng = np.random.default_rng(2)
    logits, labels = rng.standard_normal((2, 5, 7)), rng.integers(0, 7, (2, 5))
    labels[0, 1:4] = common.IGNORE_INDEX
    counted = labels != common.IGNORE_INDEX
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, np.where(counted, labels, 0)[..., None], -1)[..., 0][counted].mean()
    got = float(common.cross_entropy(paddle.to_tensor(logits, dtype="float32"), paddle.to_tensor(labels)))
    assert abs(got - expected) <= 1e-6 * abs(expected)
    assert float(common.cross_entropy(paddle.zeros([3, 7]), paddle.full([3], common.IGNORE_INDEX, "int64"))) == 0.0


def test_base_mamba_starts_near_the_uniform_loss():
    """PaddleNLP's default init (std 0.1) starts the base Mamba at loss 64-75 (the tied embedding's own token
    dominates the first logits; the plain loss shows 64, Paddle's CPU cross_entropy clipping each token there);
    the example's (std 0.02) starts near ln V (11.3 against 10.37). One forward of 2 x 16 tokens."""
    pytest.importorskip("paddle")
    pytest.importorskip("paddlenlp")
    import paddle
    import train_mamba

    cfg = train_mamba.SIZES["base"]
    paddle.seed(0)
    model = train_mamba.build_mamba(cfg)
    tokens = paddle.to_tensor(np.random.default_rng(0).integers(0, cfg["vocab"], (2, 17)))
    with paddle.no_grad():
        loss = float(train_mamba.mamba_loss(model, tokens[:, :-1], tokens[:, 1:]))
    assert abs(loss - math.log(cfg["vocab"])) < 2.0, loss


def test_steps_must_be_positive(capsys):
    for steps in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            common.example_args("x", {"tiny": {}}, "train_x", ["--steps", steps])
        assert "--steps: expected a positive integer" in capsys.readouterr().err


def test_short_runs_get_integer_step_ticks():
    import matplotlib.pyplot as plt

    chain = common.MarkovChain(8, np.random.default_rng(0))
    figure = common.loss_figure([3.0, 2.5, 2.2], chain, "three steps")
    ticks = [t for t in figure.axes[0].get_xticks() if 1 <= t <= 3]
    plt.close(figure)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_default_plots_are_distinct_and_in_the_plot_folder(tmp_path, monkeypatch, capsys):
    import argparse

    runs = [dict(size=size, data=data, fused=fused, tensor_parallel=tp, sequence_parallel=sp)
            for size in ("tiny", "base") for data in ("synthetic", "text") for fused in (True, False)
            for tp, sp in ((1, False), (2, False), (2, True))]
    names = {common.default_plot("train_llama", argparse.Namespace(**run)) for run in runs}
    assert len(names) == len(runs) and all(Path(n).parent == common.PLOT_DIR for n in names)
    assert common.PLOT_DIR == Path(common.__file__).resolve().parent / "plots"
    monkeypatch.setattr(common, "PLOT_DIR", tmp_path / "plots")  # the folder is made when missing
    with use_backend("reference"):
        __import__("train_mamba2").main(["--steps", "2", "--no-fused"])
    assert (tmp_path / "plots" / "train_mamba2_tiny_synthetic_plain.png").stat().st_size > 0
    assert f"loss curve: {tmp_path / 'plots'}" in capsys.readouterr().out


def test_tensor_parallel_parameter_count():
    """The fleet run states the whole model's parameter count: a shard (``is_distributed``) counts once per
    rank, a replicated parameter once."""
    import paddle.nn as nn
    import train_llama

    layer = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    layer[0].weight.is_distributed = True  # a column-parallel shard: 24 of each rank's 42
    assert train_llama.parameter_counts(layer, 2) == (66, 42)
    assert train_llama.parameter_counts(layer, 1) == (42, 42)


def test_bfloat16_moments_follow_the_plain_run(tmp_path, capsys):
    """The main job with FusedAdamW's bfloat16 moments (the default where it runs a kernel): the first loss
    is the same forward, later ones differ by the moments' rounding."""
    fused = _run("train_llama", tmp_path, "--moment-dtype", "bfloat16", steps=4)
    assert "FusedAdamW (bfloat16 moments)" in capsys.readouterr().out
    plain = _run("train_llama", tmp_path, "--no-fused", steps=4)
    assert abs(fused[0] - plain[0]) <= 1e-5 * abs(plain[0])
    np.testing.assert_allclose(fused, plain, rtol=2e-3)
    assert not np.array_equal(fused, plain)


@pytest.mark.parametrize("backend, expected", [("reference", "float32"), ("triton", "bfloat16")])
def test_moment_dtype_auto_follows_the_optimizer_backend(backend, expected):
    """``--moment-dtype auto``: 16-bit moments where FusedAdamW runs its kernel (here Triton's interpreter,
    which the suite turns on), float32 where it runs the CPU reference."""
    with use_backend(backend):
        assert common.moment_dtype("auto") == expected
    assert common.moment_dtype("bfloat16") == "bfloat16" and common.moment_dtype("float32") == "float32"


def test_main_job_names_our_layers(tmp_path, capsys):
    _run("train_llama", tmp_path, "--data", "text", steps=1)
    out = capsys.readouterr().out
    for layer in ("FusedRMSNorm", "FusedMLP", "LinearCrossEntropy", "FusedAdamW"):
        assert layer in out
    assert "standard-library source" in out


def test_markov_chain_is_sparse_at_the_base_vocabulary():
    rng = np.random.default_rng(0)
    chain = common.MarkovChain(32000, rng)  # a dense V x V float64 matrix would take 8 GB
    assert chain.successors.shape == chain.weights.shape == (32000, common.SUCCESSORS)
    assert 0 < chain.floor < math.log(32000)
    tokens = chain.sample(64, 200, rng)
    assert tokens.shape == (64, 200) and tokens.min() >= 0 and tokens.max() < 32000
    follows = (chain.successors[tokens[:, :-1]] == tokens[:, 1:, None]).any(-1).mean()
    assert abs(follows - (1 - common.BACKGROUND)) < 0.02  # a successor, unless the uniform jump was taken


def test_chain_floor_is_its_entropy_rate():
    """On a small chain, against the entropy rate of the dense transition matrix built from it."""
    chain = common.MarkovChain(12, np.random.default_rng(1))
    dense = np.full((12, 12), common.BACKGROUND / 12)
    for row in range(12):
        dense[row, chain.successors[row]] += (1 - common.BACKGROUND) * chain.weights[row]
    values, vectors = np.linalg.eig(dense.T)
    stationary = np.real(vectors[:, np.argmax(np.real(values))])
    stationary /= stationary.sum()
    assert abs(chain.floor - float(-(stationary[:, None] * dense * np.log(dense)).sum())) < 1e-9


def test_stdlib_text_bytes():
    text = common.StdlibText(256)
    batch = text.sample(4, 33, np.random.default_rng(0))
    assert batch.shape == (4, 33) and batch.min() >= 0 and batch.max() < 256
    assert len(text.data) > 1_000_000 and 3.0 < text.floor < math.log(256)
    with pytest.raises(SystemExit, match="256"):
        common.StdlibText(100)
