"""Causal conv1d kernels on the GPU (fwd, bwd, decoding step), Triton and CUDA backends, against a
float64 numpy reference with a hand-written adjoint: every dtype, odd widths and shapes,
channel-last and general strides, packed batches, seqlen past 32768 and a tensor past 2^31 elements
(64-bit offsets). Outputs are poisoned (NaN) before the kernels write them."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton import causal_conv1d as conv_kernels
from paddlenlp_fused.runtime import tensor as T
from paddlenlp_fused.testing.numerics import assert_close, dsilu as silu_grad, silu as silu_fn

DTYPES = ("float32", "float16", "bfloat16")


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
    out = silu_fn(pre) if silu else pre
    if dout is None:
        return out
    dpre = dout * silu_grad(pre) if silu else dout
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(weight)
    for k in range(width):
        dxp[:, :, k:k + seqlen] += weight[:, k, None] * dpre * same[k]
        dw[:, k] = (dpre * xp[:, :, k:k + seqlen] * same[k]).sum(axis=(0, 2))
    return out, dict(dx=dxp[:, :, width - 1:], dweight=dw, dbias=dpre.sum(axis=(0, 2)) if bias is not None else None,
                     dinit=dxp[:, :, :width - 1] if init is not None else None)


# ----------------------------------------------------------------------------------------------
# causal conv1d

BACKENDS = ("triton", "cuda")

# (batch, dim, seqlen, width, layout, seq_idx + initial states). Layouts: "first" (seqlen
# contiguous), "last" (x stored [b, l, d]), "strided" (neither axis contiguous). They cover both
# CUDA geometries: seq rows with 16-byte vectors (seqlen % 8 == 0) or element-wise (odd seqlen),
# several chunks per row; walks with 8-byte channel groups (dim % 4 == 0) or element-wise.
CONV_SHAPES = [
    (1, 1, 1, 2, "first", False),
    (2, 37, 300, 4, "first", True),
    (2, 24, 4104, 4, "first", True),
    (3, 130, 1000, 3, "last", False),
    (2, 64, 2049, 4, "last", True),
    (2, 20, 97, 2, "strided", True),
    (1, 33, 777, 7, "first", False),
]


def _kernels(backend):
    if backend == "cuda":
        from paddlenlp_fused.kernels.cuda import causal_conv1d as cuda_conv
        from paddlenlp_fused.kernels.cuda import library

        _, why = library.load()
        if why is not None:
            pytest.skip(f"CUDA library: {why}")
        return cuda_conv
    return conv_kernels


def _swap_last_axes(provider, t):
    return t.transpose(1, 2) if provider.name == "torch" else t.transpose([0, 2, 1])


def _layout(provider, shape, dtype, layout):
    """x [b, d, l] with the strides of ``layout``."""
    batch, dim, seqlen = shape
    if layout == "last":  # strides (l*d, 1, d)
        return _swap_last_axes(provider, provider.randn((batch, seqlen, dim), dtype))
    if layout == "strided":  # every other position of a twice longer row: strides (2*d*l, 2*l, 2)
        x = provider.randn((batch, dim, 2 * seqlen), dtype)
        return x[:, :, ::2]
    return provider.randn((batch, dim, seqlen), dtype)


def _poisoned_like(provider, x):
    """A NaN buffer shaped like x, channel-last when x is (dim contiguous), else channel-first."""
    batch, dim, seqlen = x.shape
    dtype = str(x.dtype).split(".")[-1]
    if dim > 1 and T.strides(x)[1] == 1:
        return _swap_last_axes(provider, provider.poisoned((batch, seqlen, dim), dtype))
    return provider.poisoned((batch, dim, seqlen), dtype)


def _run_conv(kernels, provider, x, weight, bias, seq_idx, init, dout, silu=True):
    """Forward and backward; out and dx take x's layout (channel-last or channel-first)."""
    dim = x.shape[1]
    dtype = str(x.dtype).split(".")[-1]
    act = "silu" if silu else None
    out = _poisoned_like(provider, x)
    kernels.causal_conv1d_fwd(x, weight, out, bias, seq_idx, init, activation=act)
    dx = _poisoned_like(provider, x)
    dinit = provider.poisoned(tuple(init.shape), dtype) if init is not None else None
    dw = provider.zeros(tuple(weight.shape), "float32")
    db = provider.zeros((dim,), "float32") if bias is not None else None
    kernels.causal_conv1d_bwd(x, weight, dout, dx, dw, bias, db, seq_idx, init, dinit, activation=act)
    provider.synchronize()
    return out, dict(dx=dx, dweight=dw, dbias=db, dinit=dinit)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=str)
def test_conv_fwd_bwd_match_float64(provider, shape, dtype, backend):
    batch, dim, seqlen, width, layout, packed = shape
    kernels = _kernels(backend)
    x = _layout(provider, (batch, dim, seqlen), dtype, layout)
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    seq_idx = init = None
    if packed:  # int64 ids in half the dtypes; a boundary exactly at position 0 and at chunk edges too
        cuts = np.sort(np.concatenate([np.random.randint(0, seqlen, size=(batch, 3)),
                                       np.full((batch, 1), min(2048, seqlen - 1))], axis=1), axis=1)
        ids = (np.arange(seqlen)[None, :, None] >= cuts[:, None, :]).sum(-1)
        seq_idx = provider.from_numpy(ids, "int64" if dtype == "float16" else "int32")
        init = provider.randn((batch, dim, width - 1), dtype)
    dout = _layout(provider, (batch, dim, seqlen), dtype, "last" if layout == "last" else "first")
    if backend == "cuda" and not 2 <= width <= 4:
        with pytest.raises(ValueError, match="width"):
            _run_conv(kernels, provider, x, weight, bias, seq_idx, init, dout)
        return
    out, grads = _run_conv(kernels, provider, x, weight, bias, seq_idx, init, dout)
    ref_out, ref_grads = conv_reference(provider.to_numpy(x), provider.to_numpy(weight), provider.to_numpy(bias),
                                        None if seq_idx is None else provider.to_numpy(seq_idx),
                                        None if init is None else provider.to_numpy(init), True,
                                        provider.to_numpy(dout))
    assert_close("out", provider.to_numpy(out), ref_out, dtype)
    for name, g in grads.items():
        if g is not None:
            assert_close(name, provider.to_numpy(g), ref_grads[name], dtype)


# Triton forward tiles other than the defaults: (block_d, block_l, chunk, num_warps). Chunks shorter
# than w - 1 take several halo chunks (width 7: up to 6); chunk 1 is the channel-last geometry.
FWD_TILES = [(1, 64, 8, 1), (4, 32, 2, 2), (2, 16, 1, 1), (8, 128, 16, 4), (2, 256, 4, 8)]


@pytest.mark.parametrize("width", [4, 7])
@pytest.mark.parametrize("tile", FWD_TILES, ids=str)
def test_triton_fwd_tiles_match_float64(provider, tile, width):
    """Odd shape, seq_idx and initial states, channel-first and channel-last, one dtype a tile."""
    block_d, block_l, chunk, warps = tile
    dtype = DTYPES[FWD_TILES.index(tile) % len(DTYPES)]
    batch, dim, seqlen = 2, 37, 301
    ids = np.sort(np.random.randint(0, 4, size=(batch, seqlen)), axis=1)
    seq_idx = provider.from_numpy(ids, "int32")
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    init = provider.randn((batch, dim, width - 1), dtype)
    for layout in ("first", "last"):
        x = _layout(provider, (batch, dim, seqlen), dtype, layout)
        out = _poisoned_like(provider, x)
        conv_kernels.causal_conv1d_fwd(x, weight, out, bias, seq_idx, init, activation="silu", block_d=block_d,
                                       block_l=block_l, chunk=chunk, num_warps=warps)
        provider.synchronize()
        ref = conv_reference(provider.to_numpy(x), provider.to_numpy(weight), provider.to_numpy(bias), ids,
                             provider.to_numpy(init))
        assert_close(f"out {layout}", provider.to_numpy(out), ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_without_bias_or_activation(provider, backend):
    """No bias, identity activation, width 3, fp32: exact enough for the float32 bound."""
    kernels = _kernels(backend)
    batch, dim, seqlen, width = 2, 16, 520, 3
    x, dout = provider.randn((batch, dim, seqlen)), provider.randn((batch, dim, seqlen))
    weight = provider.randn((dim, width), scale=0.5)
    out, grads = _run_conv(kernels, provider, x, weight, None, None, None, dout, silu=False)
    ref_out, ref_grads = conv_reference(provider.to_numpy(x), provider.to_numpy(weight), silu=False,
                                        dout=provider.to_numpy(dout))
    assert_close("out", provider.to_numpy(out), ref_out, "float32")
    for name in ("dx", "dweight"):
        assert_close(name, provider.to_numpy(grads[name]), ref_grads[name], "float32")


@pytest.mark.xdist_group("huge")
@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_seqlen_65544_and_past_2_31_elements(provider, backend):
    """x [2, 16384, 65544] bf16 (2^31 + 2^18 elements, seqlen past 32768): the last batch's last dims
    lie past 2^31; a 32768-long stretch of them is checked against float64, forward and backward."""
    kernels = _kernels(backend)
    batch, dim, seqlen, width = 2, 16384, 65544, 4
    x = provider.randn((batch, dim, seqlen), "bfloat16")
    weight, bias = provider.randn((dim, width), "bfloat16", scale=0.5), provider.randn((dim,), "bfloat16")
    dout = provider.randn((batch, dim, seqlen), "bfloat16")
    out, grads = _run_conv(kernels, provider, x, weight, bias, None, None, dout)
    rows, cols = slice(dim - 2, dim), slice(seqlen - 32768, seqlen)
    # the window's first outputs need the width - 1 inputs before it
    xs = provider.to_numpy(x[1:, rows, seqlen - 32768 - (width - 1):])
    ref_out = conv_reference(xs, provider.to_numpy(weight[rows]), provider.to_numpy(bias[rows]))
    assert_close("out tail", provider.to_numpy(out[1:, rows, cols]), ref_out[:, :, width - 1:], "bfloat16")
    _, ref_grads = conv_reference(provider.to_numpy(x[1:, rows]), provider.to_numpy(weight[rows]),
                                  provider.to_numpy(bias[rows]), dout=provider.to_numpy(dout[1:, rows]))
    assert_close("dx tail", provider.to_numpy(grads["dx"][1:, rows, cols]), ref_grads["dx"][:, :, cols], "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d_update_matches_reference(provider, backend):
    kernels = _kernels(backend)
    for dtype in DTYPES:
        for ring in (False, True):
            batch, dim, width, state_len, steps = 3, 70, 4, 5, 2
            state = provider.randn((batch, dim, state_len), dtype)
            state0 = provider.to_numpy(state)
            x = provider.randn((batch, dim, steps), dtype)
            weight, bias = provider.randn((dim, width), dtype), provider.randn((dim,), dtype)
            seqlens = np.array([4, 9, 13], dtype=np.int32)
            out = provider.poisoned((batch, dim, steps), dtype)
            kernels.causal_conv1d_update(x, state, weight, out, bias, activation="silu",
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


# ----------------------------------------------------------------------------------------------
# issue #18: seq_idx padding, deterministic backward, state caches, varlen states (Triton)


def _padded_ids(batch, seqlen):
    """Packed rows whose padding (-1) sits at the start, between sequences, across chunk edges and at
    the end."""
    ids = np.zeros((batch, seqlen), np.int64)
    for b in range(batch):
        cuts = np.sort(np.random.choice(np.arange(1, seqlen), size=6, replace=False))
        ids[b] = (np.arange(seqlen)[:, None] >= cuts[None, :]).sum(-1)
        ids[b][ids[b] % 2 == 1] = -1  # every other run is padding
        ids[b][:3 + b] = -1
        ids[b][seqlen - 5:] = -1
    return ids


def _padded_reference(x, weight, bias, ids, init, dout):
    """conv_reference with causal-conv1d's padding rule: out 0 at ids < 0 and no gradient from there."""
    mask = (ids >= 0)[:, None, :]
    out, _ = conv_reference(x, weight, bias, ids, init, True, dout)
    _, grads = conv_reference(x, weight, bias, ids, init, True, dout * mask)
    return out * mask, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["first", "last"])
def test_triton_seq_idx_padding(provider, dtype, layout):
    """seq_idx -1 (padding): output 0 there, nothing carried across, no gradient; odd shape, both
    layouts, initial states, int32/int64 ids; outputs poisoned."""
    batch, dim, seqlen, width = 3, 37, 1031, 4
    ids = _padded_ids(batch, seqlen)
    seq_idx = provider.from_numpy(ids, "int64" if dtype == "float16" else "int32")
    x = _layout(provider, (batch, dim, seqlen), dtype, layout)
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    init = provider.randn((batch, dim, width - 1), dtype)
    dout = _layout(provider, (batch, dim, seqlen), dtype, layout)
    out, grads = _run_conv(conv_kernels, provider, x, weight, bias, seq_idx, init, dout)
    ref_out, ref_grads = _padded_reference(provider.to_numpy(x), provider.to_numpy(weight), provider.to_numpy(bias),
                                           ids, provider.to_numpy(init), provider.to_numpy(dout))
    got = provider.to_numpy(out)
    assert (got.transpose(0, 2, 1)[ids < 0] == 0).all()
    assert_close("out", got, ref_out, dtype)
    for name, g in grads.items():
        assert_close(name, provider.to_numpy(g), ref_grads[name], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 37, 3001, 4, "first"), (3, 130, 1000, 3, "last"), (8, 256, 4096, 4, "first")],
                         ids=str)
def test_triton_deterministic_backward_bit_identical(provider, dtype, shape):
    """The workspace path (per-program partial sums, fixed-order sum): dweight/dbias within the bound
    of float64 and bit-identical over two runs; dx equal to the atomic path's."""
    batch, dim, seqlen, width, layout = shape
    x = _layout(provider, (batch, dim, seqlen), dtype, layout)
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    dout = _layout(provider, (batch, dim, seqlen), dtype, layout)
    runs = []
    for _ in range(2):
        dx = _poisoned_like(provider, x)
        dw, db = provider.zeros((dim, width), "float32"), provider.zeros((dim,), "float32")
        work = provider.poisoned(conv_kernels.bwd_workspace_shape(x, weight), "float32")  # contents ignored
        conv_kernels.causal_conv1d_bwd(x, weight, dout, dx, dw, bias, db, activation="silu", workspace=work)
        provider.synchronize()
        runs.append([provider.to_numpy(t) for t in (dx, dw, db)])
    _, ref = conv_reference(provider.to_numpy(x), provider.to_numpy(weight), provider.to_numpy(bias), dout=provider.to_numpy(dout))
    for name, got in zip(("dx", "dweight", "dbias"), runs[0]):
        assert_close(name, got, ref[name], dtype)
    for name, a, b in zip(("dx", "dweight", "dbias"), *runs):
        assert np.array_equal(a, b), f"{name}: two deterministic runs differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ring", [False, True])
def test_triton_update_conv_state_indices(provider, dtype, ring):
    """A state cache of 9 slots, 5 rows in any order with two padding rows (-1): output 0 there, the
    slots not named are bit-unchanged; odd dim; 3 new tokens; out poisoned."""
    slots, dim, width, state_len, steps = 9, 70, 4, 5, 3
    idx = np.array([7, -1, 0, 4, -1], np.int32)
    batch = len(idx)
    cache = provider.randn((slots, dim, state_len), dtype)
    cache0 = provider.to_numpy(cache)
    x = provider.randn((batch, dim, steps), dtype)
    weight, bias = provider.randn((dim, width), dtype), provider.randn((dim,), dtype)
    seqlens = np.array([4, 0, 13, 2, 1], dtype=np.int32)
    out = provider.poisoned((batch, dim, steps), dtype)
    conv_kernels.causal_conv1d_update(x, cache, weight, out, bias, activation="silu",
                                      cache_seqlens=provider.from_numpy(seqlens, "int32") if ring else None,
                                      conv_state_indices=provider.from_numpy(idx, "int32"))
    provider.synchronize()
    x64, w64, b64, got, after = (provider.to_numpy(t) for t in (x, weight, bias, out, cache))
    want_cache = cache0.copy()
    for b, slot in enumerate(idx):
        if slot < 0:
            assert (got[b] == 0).all()
            continue
        state0 = cache0[slot]
        if ring:
            window = state0[:, (np.arange(-(width - 1), 0) + seqlens[b]) % state_len]
            for i in range(steps):
                want_cache[slot][:, (seqlens[b] + i) % state_len] = x64[b][:, i]
        else:
            window = state0[:, state_len - (width - 1):]
            want_cache[slot] = np.concatenate([state0, x64[b]], axis=-1)[:, steps:]
        want = conv_reference(np.concatenate([window, x64[b]], axis=-1)[None], w64, b64)[0][:, width - 1:]
        assert_close(f"update out row {b}", got[b], want, dtype)
    np.testing.assert_array_equal(after, want_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_varlen_states(provider, dtype):
    """Final states of packed sequences (short, empty, long; tokens past the last sequence), a
    channel-last view of a wider buffer as x; states poisoned; exact copies."""
    bounds = np.array([0, 3, 3, 1000, 1700, 1701, 4000], np.int64)
    dim = 333
    wide = provider.randn((4100, 2 * dim), dtype)
    x = wide[:, dim:]  # row stride 2 * dim
    x64 = provider.to_numpy(x)
    for state_len in (3, 37):
        states = provider.poisoned((len(bounds) - 1, dim, state_len), dtype)
        conv_kernels.causal_conv1d_varlen_states(x, provider.from_numpy(bounds, "int64"), states)
        provider.synchronize()
        want = np.zeros((len(bounds) - 1, dim, state_len))
        for b in range(len(bounds) - 1):
            for k in range(state_len):
                t = bounds[b + 1] - state_len + k
                if t >= bounds[b]:
                    want[b, :, k] = x64[t]
        np.testing.assert_array_equal(provider.to_numpy(states), want)
