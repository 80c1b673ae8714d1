"""Causal conv1d on the CPU: the CUDA backend's argument checks and its refusal on CPU tensors, the
ops' backend choice, and the Triton kernels (interpreter) with tiles small enough that a program
walks several tiles and the backward several segments. The float64 conv here is written from the
definition (a loop over taps), independently of the library."""

import numpy as np
import paddle
import pytest

from paddlenlp_fused.kernels.cuda import causal_conv1d as cuda_conv
from paddlenlp_fused.kernels.triton import causal_conv1d as conv_kernels
from paddlenlp_fused.ops.causal_conv1d import (causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_states,
                                               choose_backend, cuda_unsupported)
from paddlenlp_fused.runtime import tensor as T
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close
from helpers import deterministic_settings, randn, to64


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
    out = pre / (1 + np.exp(-pre)) if silu else pre
    return out * (ids >= 0)[:, None, :]  # causal-conv1d: a negative id is padding, output 0


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
    out, dx, dw, db, dinit = _run_tiled_kernels(x, weight, bias, paddle.to_tensor(ids.astype(np.int64)), init, dout)
    y64, grads64 = _conv_grads64(x, weight, bias, init, ids, dout)
    np.testing.assert_allclose(y64, conv64(to64(x), to64(weight), to64(bias), ids, to64(init)), rtol=1e-12)
    assert_close("out", out.numpy(), y64, "float32")
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), (dx, dw, db, dinit), grads64):
        assert_close(name, got.numpy(), want, "float32")


def _run_tiled_kernels(x, weight, bias, seq_idx, init, dout):
    """The Triton forward and backward with silu at block_l 8 and 16-position backward segments, on
    poisoned outputs: (out, dx, dweight, dbias, dinitial_states)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    out = paddle.full([batch, dim, seqlen], float("nan"))
    conv_kernels.causal_conv1d_fwd(*triton_args(x, weight, out, bias, seq_idx, init), activation="silu",
                                   block_d=2, block_l=8)
    dx, dinit = paddle.full([batch, dim, seqlen], float("nan")), paddle.full([batch, dim, width - 1], float("nan"))
    dw, db = paddle.zeros([dim, width]), paddle.zeros([dim])
    conv_kernels.causal_conv1d_bwd(*triton_args(x, weight, dout, dx, dw, bias, db, seq_idx, init, dinit),
                                   activation="silu", block_d=2, block_l=8, segment=16)
    return out, dx, dw, db, dinit


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


# ----------------------------------------------------------------------------------------------
# seq_idx padding, deterministic backward, state caches, varlen states (issue #18)


def _padded_ids(width):
    """Packed rows with padding (-1) at the start, between sequences, inside a tile and at the end."""
    return np.array([[-1] * 2 + [0] * 9 + [-1] * 3 + [1] * 11 + [-1] * 12,
                     [0] * 5 + [1] * 1 + [2] * 20 + [-1] * 1 + [3] * 10])


def _conv_grads64(x, weight, bias, init, ids, dout):
    """float64 out and gradients (x, weight, bias, init) by Paddle autograd on conv64's definition."""
    xs = [paddle.to_tensor(to64(t), stop_gradient=False) for t in (x, weight, bias, init)]
    x64, w64, b64, i64 = xs
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    xp = paddle.concat([i64, x64], axis=-1)
    idp = np.concatenate([np.repeat(ids[:, :1], width - 1, axis=1), ids], axis=-1)
    pre = paddle.zeros([batch, dim, seqlen], "float64") + b64[:, None]
    for k in range(width):
        same = paddle.to_tensor((idp[:, k:k + seqlen] == ids)[:, None, :].astype(np.float64))
        pre = pre + w64[:, k:k + 1] * xp[:, :, k:k + seqlen] * same
    y64 = pre * paddle.nn.functional.sigmoid(pre) * paddle.to_tensor((ids >= 0)[:, None, :].astype(np.float64))
    return y64.numpy(), [g.numpy() for g in paddle.grad(y64, xs, paddle.to_tensor(to64(dout)))]


@pytest.mark.parametrize("width", [2, 4])
def test_seq_idx_padding_triton_kernels(width):
    """seq_idx -1 = padding (causal-conv1d): output 0 there, no gradient through it, nothing carried
    across it; tiles of 8 with pads at tile edges; outputs poisoned; float32 against float64."""
    batch, dim = 2, 3
    ids = _padded_ids(width)
    seqlen = ids.shape[1]
    x, dout = randn((batch, dim, seqlen)), randn((batch, dim, seqlen))
    weight, bias, init = randn((dim, width), scale=0.5), randn((dim,)), randn((batch, dim, width - 1))
    out, dx, dw, db, dinit = _run_tiled_kernels(x, weight, bias, paddle.to_tensor(ids.astype(np.int32)), init, dout)
    y64, grads64 = _conv_grads64(x, weight, bias, init, ids, dout)
    np.testing.assert_allclose(y64, conv64(to64(x), to64(weight), to64(bias), ids, to64(init)), rtol=1e-12)
    assert (out.numpy()[:, :, ids[0] < 0][0] == 0).all() and (out.numpy()[1][:, ids[1] < 0] == 0).all()
    assert_close("out", out.numpy(), y64, "float32")
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), (dx, dw, db, dinit), grads64):
        assert_close(name, got.numpy(), want, "float32")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seq_idx_padding_op(backend, dtype):
    """causal_conv1d_fn with padded seq_idx on both CPU backends: out and every gradient against
    float64 (bfloat16 against 2x the reference backend's own error in that dtype)."""
    batch, dim, width = 2, 5, 4
    ids = _padded_ids(width)
    seqlen = ids.shape[1]
    x, weight, bias = (randn(s, dtype, requires_grad=True) for s in ((batch, dim, seqlen), (dim, width), (dim,)))
    init, dout = randn((batch, dim, width - 1), dtype, requires_grad=True), randn((batch, dim, seqlen), dtype)
    out = causal_conv1d_fn(x, weight, bias, paddle.to_tensor(ids), init, activation="silu", backend=backend)
    grads = paddle.grad(out, [x, weight, bias, init], dout)
    y64, grads64 = _conv_grads64(x, weight, bias, init, ids, dout)
    assert (to64(out)[0][:, ids[0] < 0] == 0).all()
    baseline = None
    if dtype != "float32":
        base = causal_conv1d_fn(x, weight, bias, paddle.to_tensor(ids), init, activation="silu", backend="reference")
        from paddlenlp_fused.testing.numerics import rel_err
        baseline = max(rel_err(to64(base), y64), 1e-3)
    assert_close("out", to64(out), y64, dtype, baseline)
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), grads, grads64):
        assert_close(name, to64(got), want, dtype, None if baseline is None else 4e-3)


def test_cuda_routed_around_seq_idx_deterministic_and_state_cache():
    assert "seq_idx" in cuda_unsupported(4, 16, seq_idx=True)
    assert "deterministic" in cuda_unsupported(4, 16, deterministic=True)
    assert "conv_state_indices" in cuda_unsupported(4, 1, state_indices=True)
    x = randn((1, 4, 9))
    assert choose_backend("causal_conv1d", "auto", x, 4, seq_idx=True, deterministic=True) == "triton"


@pytest.mark.parametrize("with_bias", [True, False])
def test_deterministic_backward_triton(with_bias):
    """The workspace path: per-program partial sums (several programs along seqlen and batch), then a
    fixed-order sum; accumulates into dweight/dbias like the atomic path; equal to float64, and two
    runs bit-identical."""
    batch, dim, seqlen, width = 2, 3, 37, 4
    x, dout = randn((batch, dim, seqlen)), randn((batch, dim, seqlen))
    weight, bias = randn((dim, width), scale=0.5), randn((dim,)) if with_bias else None
    shape = conv_kernels.bwd_workspace_shape(x, weight, block_d=2, block_l=8)
    assert shape == (batch * 5, dim, width + 1)
    runs = []
    for _ in range(2):
        dx = paddle.full([batch, dim, seqlen], float("nan"))
        dw = paddle.ones([dim, width])  # accumulated into
        db = paddle.ones([dim]) if with_bias else None
        work = paddle.full(list(shape), float("nan"))  # contents ignored
        conv_kernels.causal_conv1d_bwd(*triton_args(x, weight, dout, dx, dw, bias, db), activation="silu",
                                       block_d=2, block_l=8, workspace=triton_args(work)[0])
        runs.append([t.numpy().copy() for t in (dx, dw, db) if t is not None])
    init = paddle.zeros([batch, dim, width - 1])
    _, grads64 = _conv_grads64(x, weight, bias if with_bias else paddle.zeros([dim]), init,
                               np.zeros((batch, seqlen), np.int64), dout)
    assert_close("dx", runs[0][0], grads64[0], "float32")
    assert_close("dweight", runs[0][1] - 1, grads64[1], "float32")
    if with_bias:
        assert_close("dbias", runs[0][2] - 1, grads64[2], "float32")
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="workspace: expected shape"):
        conv_kernels.causal_conv1d_bwd(*triton_args(x, weight, dout, dx, paddle.zeros([dim, width])),
                                       workspace=triton_args(paddle.zeros([1, dim, width + 1]))[0])


def test_deterministic_option_and_flag(monkeypatch):
    """deterministic=True, and None under FLAGS_cudnn_deterministic, take the workspace path (mamba's
    conv backward too); False and the unset flag do not; anything but None/bool is a TypeError."""
    seen = []
    real = conv_kernels.causal_conv1d_bwd
    monkeypatch.setattr(conv_kernels, "causal_conv1d_bwd",
                        lambda *a, **k: (seen.append(k.get("workspace") is not None), real(*a, **k))[1])
    x, w = randn((2, 4, 9), requires_grad=True), randn((4, 3), requires_grad=True)
    grads = {}
    for deterministic, env in deterministic_settings(monkeypatch):
        out = causal_conv1d_fn(x, w, activation="silu", backend="triton", deterministic=deterministic)
        grads[(deterministic, env)] = paddle.grad(out, [x, w])[1].numpy()
    assert seen == [False, True, False, True]
    np.testing.assert_allclose(grads[(True, None)], grads[(None, None)], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="deterministic: expected None, True or False"):
        causal_conv1d_fn(x, w, backend="triton", deterministic=1)
    with pytest.raises(TypeError, match="deterministic"):
        causal_conv1d_fn(x, w, backend="reference", deterministic="yes")


def _update64(x, state, weight, bias, silu, seqlens=None):
    """Decoding step(s) in float64 numpy: (out, new state) for x [b, d, s], state [b, d, L]."""
    batch, dim, steps = x.shape
    width, state_len = weight.shape[1], state.shape[2]
    outs, new = np.zeros_like(x), state.copy()
    for b in range(batch):
        if seqlens is None:
            hist = np.concatenate([state[b], x[b]], axis=-1)
            new[b] = hist[:, -state_len:]
            window = hist[:, state_len - (width - 1):]
        else:
            order = [(seqlens[b] - (width - 1) + i) % state_len for i in range(width - 1)]
            window = np.concatenate([state[b][:, order], x[b]], axis=-1)
            for i in range(steps):
                new[b][:, (seqlens[b] + i) % state_len] = x[b][:, i]
        for t in range(steps):
            pre = (window[:, t:t + width] * weight).sum(-1) + (0 if bias is None else bias)
            outs[b, :, t] = pre / (1 + np.exp(-pre)) if silu else pre
    return outs, new


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("circular", [False, True])
def test_update_conv_state_indices(backend, dtype, circular):
    """conv_state_indices: rows use slots of a larger cache in any order; -1 rows (padding) output 0
    and touch no slot; the unused slots are bit-unchanged; 2-step x; odd sizes."""
    batch, dim, width, state_len, slots, steps = 4, 5, 4, 5, 7, 2
    idx = np.array([5, -1, 0, 3])
    x, weight, bias = randn((batch, dim, steps), dtype), randn((dim, width), dtype, 0.5), randn((dim,), dtype)
    cache = randn((slots, dim, state_len), dtype)
    before = to64(cache)
    seqlens = np.array([3, 0, 9, 1]) if circular else None
    out = causal_conv1d_update(x, cache, weight, bias, "silu",
                               None if seqlens is None else paddle.to_tensor(seqlens.astype(np.int32)),
                               conv_state_indices=paddle.to_tensor(idx.astype(np.int32)), backend=backend)
    live = idx >= 0
    want, new = _update64(to64(x)[live], before[idx[live]], to64(weight), to64(bias), True,
                          None if seqlens is None else seqlens[live])
    got = to64(out)
    assert (got[~live] == 0).all()
    assert_close("out", got[live], want, dtype, None if dtype == "float32" else 4e-3)
    after = to64(cache)
    np.testing.assert_array_equal(after[[s for s in range(slots) if s not in idx]],
                                  before[[s for s in range(slots) if s not in idx]])
    assert_close("conv_state", after[idx[live]], new, dtype, None if dtype == "float32" else 4e-3)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_update_conv_state_indices_bad_input(backend):
    x, w, cache = randn((2, 4)), randn((4, 3)), randn((5, 4, 2))
    with pytest.raises(ValueError, match="conv_state_indices: expected entries < 5"):
        causal_conv1d_update(x, cache, w, conv_state_indices=paddle.to_tensor([0, 5]), backend=backend)
    with pytest.raises(TypeError, match="conv_state_indices: expected dtype"):
        causal_conv1d_update(x, cache, w, conv_state_indices=paddle.to_tensor([0.0, 1.0]), backend=backend)
    with pytest.raises(ValueError, match="conv_state_indices: expected shape"):
        causal_conv1d_update(x, cache, w, conv_state_indices=paddle.to_tensor([0, 1, 2]), backend=backend)
    with pytest.raises(ValueError, match="conv_state: expected \\[slots=5, dim=4"):
        causal_conv1d_update(x, randn((5, 3, 2)), w, conv_state_indices=paddle.to_tensor([0, 1]), backend=backend)


def _varlen64(x, bounds, state_len):
    out = np.zeros((len(bounds) - 1, x.shape[1], state_len))
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        for k in range(state_len):
            t = end - state_len + k
            if t >= start:
                out[b, :, k] = x[t]
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_varlen_states(backend, dtype):
    """Final conv states of each packed sequence: sequences shorter than state_len (zeros before
    them), empty ones, a tail of x past the last sequence, state_len past one tile of 16; exact."""
    bounds = np.array([0, 2, 2, 23, 40, 41])
    x = randn((45, 300), dtype)
    for state_len in (3, 19):
        states = causal_conv1d_varlen_states(x, paddle.to_tensor(bounds.astype(np.int32)), state_len,
                                             backend=backend)
        assert list(states.shape) == [5, 300, state_len] and states.dtype == x.dtype
        np.testing.assert_array_equal(to64(states), _varlen64(to64(x), bounds, state_len))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_states_bad_input(backend):
    x = randn((10, 4))
    for bad in ([1, 4], [0, 5, 3], [0, 11]):
        with pytest.raises(ValueError, match="cu_seqlens: expected sorted offsets"):
            causal_conv1d_varlen_states(x, paddle.to_tensor(bad), 2, backend=backend)
    with pytest.raises(TypeError, match="cu_seqlens: expected dtype"):
        causal_conv1d_varlen_states(x, paddle.to_tensor([0.0, 4.0]), 2, backend=backend)
    with pytest.raises(ValueError, match="x: expected \\[total_tokens, dim\\]"):
        causal_conv1d_varlen_states(randn((2, 10, 4)), paddle.to_tensor([0, 4]), 2, backend=backend)
    with pytest.raises(ValueError, match="state_len: expected an int >= 0"):
        causal_conv1d_varlen_states(x, paddle.to_tensor([0, 4]), -1, backend=backend)
