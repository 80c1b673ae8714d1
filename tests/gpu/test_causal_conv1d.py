"""Causal conv1d kernels on the GPU (fwd, bwd, decoding step) against a float64 numpy reference with
a hand-written adjoint: every dtype, odd widths and shapes, channel-last strides, packed batches,
seqlen 32768 and a tensor past 2^31 elements (64-bit offsets). Outputs are poisoned (NaN) before the
kernels write them."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton import causal_conv1d as conv_kernels
from paddlenlp_fused.testing.numerics import assert_close

DTYPES = ("float32", "float16", "bfloat16")


def _silu(x):
    return x / (1 + np.exp(-x))


def _dsilu(x):
    s = 1 / (1 + np.exp(-x))
    return s * (1 + x * (1 - s))


def conv_reference(x, weight, bias=None, seq_idx=None, init=None, silu=True, dout=None):
    """(out) and, with dout, the gradients (dx, dweight, dbias, dinit)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    xp = np.concatenate([init if init is not None else np.zeros((batch, dim, width - 1)), x], axis=-1)
    if seq_idx is not None:
        sp = np.concatenate([np.repeat(seq_idx[:, :1], width - 1, axis=1), seq_idx], axis=-1)
        same = [(sp[:, k:k + seqlen] == seq_idx)[:, None, :] for k in range(width)]
    else:
        same = [np.ones((1, 1, seqlen), bool)] * width
    pre = np.zeros((batch, dim, seqlen)) + (bias[:, None] if bias is not None else 0)
    for k in range(width):
        pre += weight[:, k, None] * xp[:, :, k:k + seqlen] * same[k]
    out = _silu(pre) if silu else pre
    if dout is None:
        return out
    dpre = dout * _dsilu(pre) if silu else dout
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(weight)
    for k in range(width):
        dxp[:, :, k:k + seqlen] += weight[:, k, None] * dpre * same[k]
        dw[:, k] = (dpre * xp[:, :, k:k + seqlen] * same[k]).sum(axis=(0, 2))
    return out, dict(dx=dxp[:, :, width - 1:], dweight=dw, dbias=dpre.sum(axis=(0, 2)) if bias is not None else None,
                     dinit=dxp[:, :, :width - 1] if init is not None else None)


# ----------------------------------------------------------------------------------------------
# causal conv1d

# (batch, dim, seqlen, width, channel-last, seq_idx + initial states)
CONV_SHAPES = [
    (1, 1, 1, 2, False, False),
    (2, 37, 300, 4, False, True),
    (3, 130, 1000, 3, True, False),
    (2, 64, 2049, 4, True, True),
    (1, 33, 777, 7, False, False),
]


def _run_conv(provider, x, weight, bias, seq_idx, init, dout, silu=True):
    batch, dim, seqlen = x.shape
    dtype = str(x.dtype).split(".")[-1]
    act = "silu" if silu else None
    out = provider.poisoned((batch, dim, seqlen), dtype)
    conv_kernels.causal_conv1d_fwd(x, weight, out, bias, seq_idx, init, activation=act)
    dx = provider.poisoned((batch, dim, seqlen), dtype)
    dinit = provider.poisoned(tuple(init.shape), dtype) if init is not None else None
    dw = provider.zeros(tuple(weight.shape), "float32")
    db = provider.zeros((dim,), "float32") if bias is not None else None
    conv_kernels.causal_conv1d_bwd(x, weight, dout, dx, dw, bias, db, seq_idx, init, dinit, activation=act)
    provider.synchronize()
    return out, dict(dx=dx, dweight=dw, dbias=db, dinit=dinit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=str)
def test_conv_fwd_bwd_match_float64(provider, shape, dtype):
    batch, dim, seqlen, width, channel_last, packed = shape
    if channel_last:  # strides (l*d, 1, d)
        x = provider.randn((batch, seqlen, dim), dtype)
        x = x.transpose(1, 2) if provider.name == "torch" else x.transpose([0, 2, 1])
    else:
        x = provider.randn((batch, dim, seqlen), dtype)
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    seq_idx = init = None
    if packed:
        cuts = np.sort(np.random.randint(0, seqlen, size=(batch, 3)), axis=1)
        seq_idx = provider.from_numpy((np.arange(seqlen)[None, :, None] >= cuts[:, None, :]).sum(-1), "int32")
        init = provider.randn((batch, dim, width - 1), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    out, grads = _run_conv(provider, x, weight, bias, seq_idx, init, dout)
    ref_out, ref_grads = conv_reference(provider.to_numpy(x), provider.to_numpy(weight), provider.to_numpy(bias),
                                        None if seq_idx is None else provider.to_numpy(seq_idx),
                                        None if init is None else provider.to_numpy(init), True,
                                        provider.to_numpy(dout))
    assert_close("out", provider.to_numpy(out), ref_out, dtype)
    for name, g in grads.items():
        if g is not None:
            assert_close(name, provider.to_numpy(g), ref_grads[name], dtype)


def test_conv_seqlen_32768_and_past_2_31_elements(provider):
    """x [2, 16384, 65537] bf16 (2^31 + 32768 elements): the last batch's last dims past 2^31 and a
    32768-long stretch of them checked against float64, forward and backward."""
    batch, dim, seqlen, width = 2, 16384, 65537, 4
    x = provider.randn((batch, dim, seqlen), "bfloat16")
    weight, bias = provider.randn((dim, width), "bfloat16", scale=0.5), provider.randn((dim,), "bfloat16")
    dout = provider.randn((batch, dim, seqlen), "bfloat16")
    out, grads = _run_conv(provider, x, weight, bias, None, None, dout)
    rows, cols = slice(dim - 2, dim), slice(seqlen - 32768, seqlen)
    # the window's first outputs need the width - 1 inputs before it
    xs = provider.to_numpy(x[1:, rows, seqlen - 32768 - (width - 1):])
    ref_out = conv_reference(xs, provider.to_numpy(weight[rows]), provider.to_numpy(bias[rows]))
    assert_close("out tail", provider.to_numpy(out[1:, rows, cols]), ref_out[:, :, width - 1:], "bfloat16")
    _, ref_grads = conv_reference(provider.to_numpy(x[1:, rows]), provider.to_numpy(weight[rows]),
                                  provider.to_numpy(bias[rows]), dout=provider.to_numpy(dout[1:, rows]))
    assert_close("dx tail", provider.to_numpy(grads["dx"][1:, rows, cols]), ref_grads["dx"][:, :, cols], "bfloat16")


def test_causal_conv1d_update_matches_reference(provider):
    for dtype in DTYPES:
        for ring in (False, True):
            batch, dim, width, state_len, steps = 3, 70, 4, 5, 2
            state = provider.randn((batch, dim, state_len), dtype)
            state0 = provider.to_numpy(state)
            x = provider.randn((batch, dim, steps), dtype)
            weight, bias = provider.randn((dim, width), dtype), provider.randn((dim,), dtype)
            seqlens = np.array([4, 9, 13], dtype=np.int32)
            out = provider.poisoned((batch, dim, steps), dtype)
            conv_kernels.causal_conv1d_update(x, state, weight, out, bias, activation="silu",
                                              cache_seqlens=provider.from_numpy(seqlens, "int32") if ring else None)
            provider.synchronize()
            x64, w64, b64 = provider.to_numpy(x), provider.to_numpy(weight), provider.to_numpy(bias)
            want_state = state0.copy()
            for b in range(batch):
                if ring:
                    window_idx = (np.arange(-(width - 1), 0) + seqlens[b]) % state_len
                    window = state0[b][:, window_idx]
                    for i in range(steps):
                        want_state[b][:, (seqlens[b] + i) % state_len] = x64[b][:, i]
                else:
                    window = state0[b][:, state_len - (width - 1):]
                    want_state[b] = np.concatenate([state0[b], x64[b]], axis=-1)[:, steps:]
                seq = np.concatenate([window, x64[b]], axis=-1)[None]
                want = conv_reference(seq, w64, b64)[0][:, width - 1:]
                assert_close(f"update out ring={ring}", provider.to_numpy(out)[b], want, dtype)
            np.testing.assert_array_equal(provider.to_numpy(state), want_state)
