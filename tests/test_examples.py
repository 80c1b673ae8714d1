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
