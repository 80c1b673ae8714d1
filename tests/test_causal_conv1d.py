"""Causal conv1d on the CPU: the CUDA backend's argument checks and its refusal on CPU tensors, the
ops' backend choice, and the Triton kernels (interpreter) with tiles small enough that a program
walks several tiles and the backward several segments. The float64 conv here is written from the
definition (a loop over taps), independently of the library."""

import numpy as np
import paddle
import pytest

from paddlenlp_fused.kernels.cuda import causal_conv1d as cuda_conv
from paddlenlp_fused.kernels.triton import causal_conv1d as conv_kernels
from paddlenlp_fused.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update, choose_backend, cuda_unsupported
from paddlenlp_fused.runtime import tensor as T
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close
from helpers import randn


def conv64(x, weight, bias=None, seq_idx=None, init=None, silu=True):
    """out [b, d, l] in float64 from numpy inputs: sum over taps of weight * the shifted input, inputs
    of another sequence (or before the initial states) zero."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    xp = np.concatenate([init if init is not None else np.zeros((batch, dim, width - 1)), x], axis=-1)
    ids = np.zeros((batch, seqlen), np.int64) if seq_idx is None else seq_idx
    idp = np.concatenate([np.repeat(ids[:, :1], width - 1, axis=1), ids], axis=-1)
    pre = np.zeros((batch, dim, seqlen)) + (0 if bias is None else bias[:, None])
    for k in range(width):
        same = (idp[:, k:k + seqlen] == ids)[:, None, :]
        pre += weight[:, k, None] * xp[:, :, k:k + seqlen] * same
    return pre / (1 + np.exp(-pre)) if silu else pre


# ----------------------------------------------------------------------------------------------
# CUDA backend: checks that need no GPU


def test_cuda_launchers_reject_widths_and_activations():
    S = T.SpecTensor
    x, out = S((2, 8, 16), "bfloat16"), S((2, 8, 16), "bfloat16")
    for width in (1, 5):
        with pytest.raises(ValueError, match=f"weight: the CUDA causal conv takes width 2 to 4, got width {width}"):
            cuda_conv.causal_conv1d_fwd(x, S((8, width), "bfloat16"), out)
        with pytest.raises(ValueError, match="width"):
            cuda_conv.causal_conv1d_bwd(x, S((8, width), "bfloat16"), out, out, S((8, width), "float32"))
    w = S((8, 4), "bfloat16")
    with pytest.raises(ValueError, match="activation: expected None, 'silu' or 'swish', got 'gelu'"):
        cuda_conv.causal_conv1d_fwd(x, w, out, activation="gelu")
    with pytest.raises(TypeError, match="out: expected x's dtype bfloat16, got float32"):
        cuda_conv.causal_conv1d_fwd(x, w, S((2, 8, 16), "float32"))
    with pytest.raises(TypeError, match="dweight: expected a float32 accumulator"):
        cuda_conv.causal_conv1d_bwd(x, w, out, out, S((8, 4), "bfloat16"))
    with pytest.raises(ValueError, match="dbias: expected exactly when bias is given"):
        cuda_conv.causal_conv1d_bwd(x, w, out, out, S((8, 4), "float32"), bias=S((8,), "bfloat16"))
    with pytest.raises(ValueError, match="out: expected shape"):
        cuda_conv.causal_conv1d_fwd(x, w, S((2, 8, 15), "bfloat16"))
    token, state = S((2, 8), "bfloat16"), S((2, 8, 3), "bfloat16")
    with pytest.raises(ValueError, match="width 2 to 4, got width 5"):
        cuda_conv.causal_conv1d_update(token, S((2, 8, 4), "bfloat16"), S((8, 5), "bfloat16"), token)
    with pytest.raises(ValueError, match="conv_state: expected"):
        cuda_conv.causal_conv1d_update(token, S((2, 8, 2), "bfloat16"), w, token)
    with pytest.raises(TypeError, match="cache_seqlens: expected int32 or int64"):
        cuda_conv.causal_conv1d_update(token, state, w, token, cache_seqlens=S((2,), "float32"))


def test_cuda_backend_on_cpu_raises_and_auto_does_not_pick_it():
    x, w = randn((1, 4, 9)), randn((4, 3))
    with pytest.raises(BackendUnavailableError, match="cuda.*GPU tensors"):
        causal_conv1d_fn(x, w, backend="cuda")
    with pytest.raises(BackendUnavailableError, match="cuda.*GPU tensors"):
        causal_conv1d_update(randn((1, 4)), randn((1, 4, 2)), w, backend="cuda")
    assert choose_backend("causal_conv1d", "auto", x, 3) == "triton"  # CPU suite: interpreter
    assert cuda_unsupported(4) is None
    assert "width 7" in cuda_unsupported(7)
    assert "seqlen" in cuda_unsupported(4, 65535 * 1024 + 1)


def test_ops_reject_bad_activation_and_width_zero():
    x = randn((1, 4, 9))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(x, randn((4, 3)), activation="tanh", backend="triton")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_fn(x, randn((4, 0)), backend="triton")


# ----------------------------------------------------------------------------------------------
# Triton kernels (interpreter), several tiles a program


@pytest.mark.parametrize("width", [2, 4])
def test_triton_tiles_segments_seq_idx_and_initial_states(width):
    """block_l 8 and a 16-position backward segment over seqlen 37: tiles, segments, a partial last
    tile; seq_idx boundaries inside and at the edges of tiles; initial states; outputs poisoned."""
    batch, dim, seqlen = 2, 3, 37
    x, dout = randn((batch, dim, seqlen)), randn((batch, dim, seqlen))
    weight, bias, init = randn((dim, width), scale=0.5), randn((dim,)), randn((batch, dim, width - 1))
    ids = np.array([[0] * 8 + [1] * 9 + [2] * 20, [0] * 1 + [1] * 15 + [2] * 21])
    seq_idx = paddle.to_tensor(ids.astype(np.int64))
    out = paddle.full([batch, dim, seqlen], float("nan"))
    conv_kernels.causal_conv1d_fwd(*triton_args(x, weight, out, bias, seq_idx, init), activation="silu",
                                   block_d=2, block_l=8)
    dx, dinit = paddle.full([batch, dim, seqlen], float("nan")), paddle.full([batch, dim, width - 1], float("nan"))
    dw, db = paddle.zeros([dim, width]), paddle.zeros([dim])
    conv_kernels.causal_conv1d_bwd(*triton_args(x, weight, dout, dx, dw, bias, db, seq_idx, init, dinit),
                                   activation="silu", block_d=2, block_l=8, segment=16)
    xs = [paddle.to_tensor(t.numpy().astype(np.float64), stop_gradient=False) for t in (x, weight, bias, init)]
    # float64 reference through Paddle autograd on the same definition
    x64, w64, b64, i64 = xs
    xp = paddle.concat([i64, x64], axis=-1)
    idp = np.concatenate([np.repeat(ids[:, :1], width - 1, axis=1), ids], axis=-1)
    pre = paddle.zeros([batch, dim, seqlen], "float64") + b64[:, None]
    for k in range(width):
        same = paddle.to_tensor((idp[:, k:k + seqlen] == ids)[:, None, :].astype(np.float64))
        pre = pre + w64[:, k:k + 1] * xp[:, :, k:k + seqlen] * same
    y64 = pre * paddle.nn.functional.sigmoid(pre)
    np.testing.assert_allclose(y64.numpy(), conv64(*(t.numpy() for t in xs[:3]), ids, xs[3].numpy()), rtol=1e-12)
    grads64 = paddle.grad(y64, xs, paddle.to_tensor(dout.numpy().astype(np.float64)))
    assert_close("out", out.numpy(), y64.numpy(), "float32")
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), (dx, dw, db, dinit), grads64):
        assert_close(name, got.numpy(), want.numpy(), "float32")


@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_triton_forward_halo_of_several_chunks(chunk):
    """Width 6 with chunks of 1, 2 and 8 positions a thread: the w - 1 = 5 inputs before a chunk
    come from 5, 3 and 1 chunks before it; seq_idx, initial states, a partial last tile, out poisoned."""
    batch, dim, seqlen, width = 2, 3, 29, 6
    x, weight, bias = randn((batch, dim, seqlen)), randn((dim, width), scale=0.5), randn((dim,))
    init = randn((batch, dim, width - 1))
    ids = np.array([[0] * 3 + [1] * 10 + [2] * 16, [0] * 20 + [1] * 9])
    out = paddle.full([batch, dim, seqlen], float("nan"))
    conv_kernels.causal_conv1d_fwd(*triton_args(x, weight, out, bias, paddle.to_tensor(ids.astype(np.int32)), init),
                                   activation="silu", block_d=2, block_l=16, chunk=chunk)
    want = conv64(*(t.numpy().astype(np.float64) for t in (x, weight, bias)), ids, init.numpy().astype(np.float64))
    assert_close("out", out.numpy(), want, "float32")
