"""Causal depthwise conv1d on the CUDA kernels of ``csrc/causal_conv1d.cu`` (ctypes over the C ABI).

The launchers take the tensors of ``kernels/triton/causal_conv1d.py``'s ``causal_conv1d_fwd`` /
``causal_conv1d_bwd`` (same shapes, strides and accumulation contract: dweight/dbias are float32
contiguous and accumulated, the caller zeroes them) and run on the tensors' current stream. Widths 2
to 4 only (the Triton kernels take any width). ``causal_conv1d_update`` mirrors the Triton
decoding step (one thread per channel). Channel-first rows (seqlen contiguous) take 16-byte
vector accesses along seqlen; other strides, channel-last included, walk positions with 8-byte
channel groups when dim is contiguous, element-wise otherwise.

Not here, so the ops route to Triton for them: a negative ``seq_idx`` id is one more sequence id to
these kernels (not causal-conv1d's padding), the backward always adds dweight/dbias with fp32
atomics (no deterministic mode), and the decoding step has no ``conv_state_indices``.
"""

from __future__ import annotations

import ctypes

from ...runtime import tensor as T
from ..triton.causal_conv1d import check_activation, check_grad_buffers, conv_args, update_args
from . import library

MIN_WIDTH, MAX_WIDTH = 2, 4
# Channel-first rows take one block per 1024 (fp32) or 2048 (16-bit) positions, at most 65535 a row.
MAX_SEQLEN_CHANNEL_FIRST = 65535 * 1024
_c_ptr, _c_i64, _c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_STRIDES = ctypes.c_int64 * 19  # x, out (dx), weight, seq_idx, initial_states, dout, dinitial (csrc order)
_UPDATE_STRIDES = ctypes.c_int64 * 11  # x, conv_state, weight, out
_SIGNATURES = {
    "pnf_causal_conv1d_fwd": [_c_ptr] * 6 + [_c_i64] * 3 + [_c_int, _STRIDES] + [_c_int] * 6 + [_c_ptr],
    "pnf_causal_conv1d_bwd": [_c_ptr] * 10 + [_c_i64] * 3 + [_c_int, _STRIDES] + [_c_int] * 6 + [_c_ptr],
    "pnf_causal_conv1d_update": [_c_ptr] * 6 + [_c_i64] * 4 + [_c_int, _UPDATE_STRIDES] + [_c_int] * 6 + [_c_ptr],
}
_lib = library.bound(_SIGNATURES)


def _ptr(t):
    return None if t is None else t.data_ptr()


def _code(t) -> int:
    return 0 if t is None else library.dtype_code(T.dtype_name(t))


def _st(t, n: int):
    return T.strides(t) if t is not None else (0,) * n


def check_width(width: int) -> None:
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(f"weight: the CUDA causal conv takes width {MIN_WIDTH} to {MAX_WIDTH}, got width {width} "
                         "(use backend='triton' for other widths)")


def _check_same_dtype(x, named) -> None:
    for name, t in named:
        if t is not None and T.dtype_name(t) != T.dtype_name(x):
            raise TypeError(f"{name}: expected x's dtype {T.dtype_name(x)}, got {T.dtype_name(t)}")


def _strides(x, out, weight, seq_idx, initial_states, dout=None, dinitial_states=None):
    return _STRIDES(*T.strides(x), *T.strides(out), *T.strides(weight), *_st(seq_idx, 2), *_st(initial_states, 3),
                    *_st(dout, 3), *_st(dinitial_states, 3))


def _seq_idx_int64(ids) -> int:
    """1 for int64 ids (seq_idx, cache_seqlens), 0 for int32 or none."""
    return int(ids is not None and T.dtype_name(ids) == "int64")


def causal_conv1d_fwd(x, weight, out, bias=None, seq_idx=None, initial_states=None, activation=None) -> None:
    """out [b, d, l] = act(causal depthwise conv of x [b, d, l]), written in place."""
    silu = check_activation(activation)
    batch, dim, seqlen, width = conv_args(x, weight, bias, seq_idx, initial_states)[:4]
    check_width(width)
    T.check_same_shape("out", out, (batch, dim, seqlen))
    _check_same_dtype(x, (("out", out),))
    library.check(_lib().pnf_causal_conv1d_fwd(
        _ptr(x), _ptr(weight), _ptr(bias), _ptr(seq_idx), _ptr(initial_states), _ptr(out), batch, dim, seqlen,
        width, _strides(x, out, weight, seq_idx, initial_states), _code(x), _code(weight), _code(bias),
        _code(initial_states), _seq_idx_int64(seq_idx), int(silu), library.stream_of(x)), "causal_conv1d_fwd")


def causal_conv1d_bwd(x, weight, dout, dx, dweight, bias=None, dbias=None, seq_idx=None, initial_states=None,
                      dinitial_states=None, activation=None) -> None:
    """Gradients of the conv: dx [b, d, l] and dinitial_states [b, d, w-1] (when initial_states is
    given) written; dweight [d, w] and dbias [d] (when bias is given; float32 contiguous) accumulated."""
    silu = check_activation(activation)
    batch, dim, seqlen, width = conv_args(x, weight, bias, seq_idx, initial_states)[:4]
    check_width(width)
    check_grad_buffers(dout, dx, dweight, bias, dbias, batch, dim, seqlen, width)
    _check_same_dtype(x, (("dout", dout), ("dx", dx)))
    if dweight is None:
        raise ValueError("dweight: expected a float32 [dim, width] accumulator, got None")
    if (initial_states is None) != (dinitial_states is None):
        raise ValueError("dinitial_states: expected exactly when initial_states is given")
    if dinitial_states is not None:
        T.check_same_shape("dinitial_states", dinitial_states, (batch, dim, width - 1))
        if T.dtype_name(dinitial_states) != T.dtype_name(initial_states):
            raise TypeError(f"dinitial_states: expected initial_states' dtype {T.dtype_name(initial_states)}, "
                            f"got {T.dtype_name(dinitial_states)}")
    library.check(_lib().pnf_causal_conv1d_bwd(
        _ptr(x), _ptr(weight), _ptr(bias), _ptr(seq_idx), _ptr(initial_states), _ptr(dout), _ptr(dx),
        _ptr(dweight), _ptr(dbias), _ptr(dinitial_states), batch, dim, seqlen, width,
        _strides(x, dx, weight, seq_idx, initial_states, dout, dinitial_states), _code(x), _code(weight), _code(bias),
        _code(initial_states), _seq_idx_int64(seq_idx), int(silu), library.stream_of(x)), "causal_conv1d_bwd")


def causal_conv1d_update(x, conv_state, weight, out, bias=None, activation=None, cache_seqlens=None) -> None:
    """Decoding: out (x's shape, [b, d] or [b, d, s]) from the new tokens x and conv_state
    [b, d, state_len >= w - 1], updated in place (shifted, or a ring buffer indexed by
    ``cache_seqlens`` [b])."""
    silu = check_activation(activation)
    batch, dim, steps, width, state_len, x_st, o_st = update_args(x, conv_state, weight, out, bias, cache_seqlens)
    check_width(width)
    _check_same_dtype(x, (("out", out),))
    library.check(_lib().pnf_causal_conv1d_update(
        _ptr(x), _ptr(conv_state), _ptr(weight), _ptr(bias), _ptr(cache_seqlens), _ptr(out), batch, dim, steps,
        state_len, width, _UPDATE_STRIDES(*x_st, *T.strides(conv_state), *T.strides(weight), *o_st), _code(x),
        _code(conv_state), _code(weight), _code(bias), _seq_idx_int64(cache_seqlens), int(silu),
        library.stream_of(x)), "causal_conv1d_update")
