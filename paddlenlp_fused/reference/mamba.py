"""Pure-Paddle Mamba-1 pieces: the ground truth and the CPU fallback.

Everything computes in float32 (float64 when given float64; complex64/128 for complex A) and casts
the outputs back to the input dtype: Paddle's CPU build lacks bfloat16 kernels for most ops.
Autograd goes through the casts, so the references are differentiable in every input.

* ``selective_scan_ref``: the recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t``,
  ``y_t = C_t h_t + D u_t`` (times ``silu(z_t)``), step by step: the decays and inputs of every step
  are computed at once (``[b, d, n, l]``), the loop only multiplies and adds, and ``y`` is one product
  with C over the stacked states. On the CPU (fwd + bwd at [8, 128, 16, 32] and [2, 256, 16, 512]) this
  was 2.5-9x faster than chunk by chunk (``[b, d, n, K, K]`` decay weights, K 4 and 16) and 5x faster
  than a log-depth doubling scan. Complex A (mamba_ssm's convention:
  input-dependent B/C given as real ``[..., n, 2 l]`` with (real, imag) pairs, output ``2 Re(C h)``)
  runs the same loop in complex arithmetic.
* ``causal_conv1d_ref``: depthwise causal conv as a sum of ``width`` shifted slices of the input
  padded on the left with ``initial_states`` (zeros by default), masked where ``seq_idx`` changes.
* ``causal_conv1d_update_ref`` / ``selective_state_update_ref``: decoding steps, state in place.
* ``mamba_inner_ref``: conv, projections, the optional B/C/dt RMSNorms, scan and output projection
  composed.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def _compute_dtype(*tensors) -> str:
    return "float64" if any(t is not None and t.dtype == paddle.float64 for t in tensors) else "float32"


def _cast(t, dtype):
    return None if t is None else t.astype(dtype)


def _is_complex(t) -> bool:
    return t is not None and t.dtype in (paddle.complex64, paddle.complex128)


def _dt(delta, delta_bias, delta_softplus, cdt):
    dt = delta.astype(cdt)
    if delta_bias is not None:
        dt = dt + delta_bias.astype(cdt)[:, None]
    return F.softplus(dt) if delta_softplus else dt


def _expand_bc(t, dim: int, cdt, complex_dtype=None):
    """B or C as a tensor broadcastable to [b, d, n, l]."""
    if t.ndim == 2:  # fixed [d, n]
        t = t.astype(complex_dtype) if complex_dtype and _is_complex(t) else t.astype(cdt)
        return t[None, :, :, None]
    t = t.astype(cdt)
    # [b, n, l] or [b, g, n, l]; the groups repeated before the pairs become complex (Paddle's
    # repeat_interleave has no complex kernel)
    t = t[:, None] if t.ndim == 3 else paddle.repeat_interleave(t, dim // t.shape[1], axis=1)
    if complex_dtype and not _is_complex(t):  # (real, imag) pairs along the last axis
        t = paddle.complex(t[..., 0::2], t[..., 1::2])
    return t


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    """Selective scan (see ``selective_scan_fn``). u, delta, z [b, d, l]; A [d, n]; B, C [d, n],
    [b, n, l] or [b, g, n, l]; D, delta_bias [d]. Returns out [b, d, l] in u's dtype, and with
    ``return_last_state`` also the final state [b, d, n] (float32, complex for complex A)."""
    cdt = _compute_dtype(u, delta, A, B, C)
    dim = u.shape[1]
    complex_dtype = ("complex128" if cdt == "float64" else "complex64") if _is_complex(A) else None
    uf = u.astype(cdt)
    dt = _dt(delta, delta_bias, delta_softplus, cdt)
    Bx = _expand_bc(B, dim, cdt, complex_dtype)
    Cx = _expand_bc(C, dim, cdt, complex_dtype)
    if complex_dtype:
        ys, h = _scan(uf.astype(complex_dtype), dt.astype(complex_dtype), A.astype(complex_dtype), Bx, Cx)
        y = paddle.real(ys) * 2
    else:
        y, h = _scan(uf, dt, A.astype(cdt), Bx, Cx)
    if D is not None:
        y = y + D.astype(cdt)[:, None] * uf
    if z is not None:
        y = y * F.silu(z.astype(cdt))
    out = y.astype(u.dtype)
    return (out, h.detach()) if return_last_state else out


def _scan(u, dt, A, Bx, Cx):
    """(y before D and z [b, d, l], last state [b, d, n]) of the recurrence; Bx, Cx broadcast to [b, d, n, l]."""
    decay = paddle.exp(dt[:, :, None, :] * A[None, :, :, None])  # [b, d, n, l]
    inp = (dt * u)[:, :, None, :] * Bx
    if u.shape[-1] == 0:  # no step: y empty, the state zero
        return paddle.zeros_like(u), paddle.zeros(decay.shape[:3], dtype=decay.dtype)
    states, h = [], None
    # unbind (not indexing): its backward stacks the step gradients once instead of adding a
    # zero-padded full-size gradient per step
    for decay_t, inp_t in zip(paddle.unbind(decay, axis=-1), paddle.unbind(inp, axis=-1)):
        h = inp_t if h is None else decay_t * h + inp_t
        states.append(h)
    return (paddle.stack(states, axis=-1) * Cx).sum(axis=2), h


def _silu_or_identity(x, activation):
    return F.silu(x) if activation in ("silu", "swish") else x


def permuted(t, perm):
    """``t.transpose(perm)`` as a contiguous tensor. Through einsum: on the CPU Paddle's transpose is a
    strided view, and materialising one of rank 4 or more (as the next op does), or its gradient, is
    far slower than einsum's transpose kernel; the values are the same."""
    letters = "abcdefgh"[:t.ndim]
    return paddle.einsum(f"{letters}->{''.join(letters[i] for i in perm)}", t)


def causal_conv1d_ref(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                      final_states_out=None, activation=None):
    """Depthwise causal conv (see ``causal_conv1d_fn``): x [b, d, l], weight [d, w], bias [d],
    seq_idx [b, l] (int; a negative id is padding: out 0 there), initial_states [b, d, w-1]. Returns out
    (x's dtype), and with
    ``return_final_states`` also the last w-1 inputs [b, d, w-1] (written into
    ``final_states_out`` when given)."""
    cdt = _compute_dtype(x, weight)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    # length-major [l, b, d] inside: the windows are split off the leading axis, whose backward (a
    # concat) is far cheaper on the CPU than slicing's or a split along the last axis
    xf = permuted(x.astype(cdt), [2, 0, 1])
    if initial_states is not None:
        pad = permuted(initial_states.astype(cdt), [2, 0, 1])
    else:
        pad = paddle.zeros([width - 1, batch, dim], dtype=cdt)
    padded = paddle.concat([pad, xf], axis=0) if width > 1 else xf
    wf = weight.astype(cdt)
    out = paddle.zeros([seqlen, batch, dim], dtype=cdt)
    if bias is not None:
        out = out + bias.astype(cdt)
    if seq_idx is not None:  # the initial states continue the sequence of position 0
        padded_idx = paddle.concat([seq_idx[:, :1].expand([batch, width - 1]), seq_idx], axis=-1)
    for k, tap in enumerate(paddle.unbind(wf, axis=1)):
        window = paddle.split(padded, [k, seqlen, width - 1 - k], axis=0)[1]  # x at t - (w - 1) + k
        if seq_idx is not None:
            same = (padded_idx[:, k:k + seqlen] == seq_idx).astype(cdt).t()[:, :, None]
            window = window * same
        out = out + window * tap
    out = _silu_or_identity(out, activation)
    if seq_idx is not None:  # padding positions output 0 (their inputs reach no other id's outputs)
        out = out * (seq_idx >= 0).astype(cdt).t()[:, :, None]
    out = permuted(out, [1, 2, 0]).astype(x.dtype)
    if not return_final_states:
        return out
    final = permuted(paddle.split(padded, [padded.shape[0] - (width - 1), width - 1], axis=0)[1],
                     [1, 2, 0]).astype(x.dtype)
    if final_states_out is not None:
        paddle.assign(final.detach(), output=final_states_out)
        final = final_states_out
    return out, final


def _slot_rows(indices):
    """(slots of the live rows, their rows) of a state-index tensor [b] (negative: a padding row)."""
    idx = indices.numpy().astype("int64")
    rows = np.nonzero(idx >= 0)[0]
    return paddle.to_tensor(idx[rows]), paddle.to_tensor(rows)


def _with_slots(states, indices, batch, step):
    """``step(state [batch, ...])`` on the slots ``states[indices]`` (in place there, padding rows left
    alone) -> step's output with padding rows zeroed. Gathers and scatters in float32 (exact for every
    float dtype; Paddle's CPU scatter has no 16-bit kernel)."""
    slots, rows = _slot_rows(indices)
    wide = states.astype("float32")
    view = paddle.zeros([batch] + list(states.shape[1:]), dtype="float32")
    if rows.shape[0]:
        view = paddle.scatter(view, rows, paddle.gather(wide, slots))
    view = view.astype(states.dtype)
    out = step(view)
    live = np.zeros([batch] + [1] * (out.ndim - 1), np.float32)
    live[rows.numpy()] = 1.0
    if rows.shape[0]:
        wide = paddle.scatter(wide, slots, paddle.gather(view.astype("float32"), rows))
        paddle.assign(wide.astype(states.dtype), output=states)
    return (out.astype("float32") * paddle.to_tensor(live, place=out.place)).astype(out.dtype)


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None):
    """Decoding step(s) of the causal conv. x [b, d] or [b, d, s] (s new tokens), conv_state
    [b, d, state_len >= w - 1] updated in place: the last state_len inputs, or with
    ``cache_seqlens`` [b] (int) a circular buffer where token i of x goes to position
    ``(cache_seqlens + i) % state_len``. With ``conv_state_indices`` [b] (int) conv_state is
    [slots, d, state_len] and row b uses slot ``conv_state_indices[b]``; a negative index is a padding
    row (output 0, no slot touched). Returns out shaped like x."""
    if conv_state_indices is not None:
        return _with_slots(conv_state, conv_state_indices, x.shape[0], lambda state: causal_conv1d_update_ref(
            x, state, weight, bias, activation, cache_seqlens))
    cdt = _compute_dtype(x, weight)
    squeeze = x.ndim == 2
    x3 = (x[:, :, None] if squeeze else x).astype(cdt)
    batch, dim, steps = x3.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    state = conv_state.astype(cdt)
    if cache_seqlens is None:
        history = paddle.concat([state, x3], axis=-1)
        new_state = history[:, :, -state_len:]
    else:
        seqlens = cache_seqlens.astype("int64")[:, None]
        window_idx = (paddle.arange(-(width - 1), 0, dtype="int64")[None, :] + seqlens) % state_len
        window = paddle.take_along_axis(state, window_idx[:, None, :].expand([batch, dim, width - 1]), axis=2)
        history = paddle.concat([window, x3], axis=-1)
        kept = min(steps, state_len)  # later tokens overwrite earlier ones in a short buffer
        write_idx = (paddle.arange(steps - kept, steps, dtype="int64")[None, :] + seqlens) % state_len
        new_state = paddle.put_along_axis(state, write_idx[:, None, :].expand([batch, dim, kept]),
                                          x3[:, :, steps - kept:], axis=2)
    wf = weight.astype(cdt)
    offset = history.shape[-1] - steps - (width - 1)
    out = paddle.zeros([batch, dim, steps], dtype=cdt)
    if bias is not None:
        out = out + bias.astype(cdt)[:, None]
    for k in range(width):
        out = out + history[:, :, offset + k:offset + k + steps] * wf[:, k:k + 1]
    out = _silu_or_identity(out, activation).astype(x.dtype)
    paddle.assign(new_state.astype(conv_state.dtype), output=conv_state)
    return out[:, :, 0] if squeeze else out


def causal_conv1d_varlen_states_ref(x, cu_seqlens, state_len: int):
    """The last ``state_len`` inputs of each sequence of a packed batch: x [total_tokens, dim],
    cu_seqlens [batch + 1] (int, sorted, from 0) -> states [batch, dim, state_len] in x's dtype, zeros
    before a sequence's first token."""
    bounds = cu_seqlens.numpy().astype("int64")
    states = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        first = max(int(start), int(end) - state_len)
        take = x[first:int(end)].T if end > first else paddle.zeros([x.shape[1], 0], dtype=x.dtype)
        pad = paddle.zeros([x.shape[1], state_len - take.shape[1]], dtype=x.dtype)
        states.append(paddle.concat([pad, take], axis=1))
    if not states:
        return paddle.zeros([0, x.shape[1], state_len], dtype=x.dtype)
    return paddle.stack(states)


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                               state_batch_indices=None):
    """One decoding step of the scan: state [b, d, n] updated in place; x, dt, z [b, d]; A [d, n];
    B, C [b, n] or [b, g, n]; D, dt_bias [d]. With ``state_batch_indices`` [b] (int) state is
    [slots, d, n] and row b uses slot ``state_batch_indices[b]``; a negative index is a padding row
    (output 0, no slot touched). Returns out [b, d] in x's dtype."""
    if state_batch_indices is not None:
        return _with_slots(state, state_batch_indices, x.shape[0], lambda view: selective_state_update_ref(
            view, x, dt, A, B, C, D, z, dt_bias, dt_softplus))
    cdt = _compute_dtype(x, state, A)
    dim = x.shape[1]
    dtf = dt.astype(cdt)
    if dt_bias is not None:
        dtf = dtf + dt_bias.astype(cdt)
    if dt_softplus:
        dtf = F.softplus(dtf)

    def per_dim(t):
        t = t.astype(cdt)
        return t[:, None, :] if t.ndim == 2 else paddle.repeat_interleave(t, dim // t.shape[1], axis=1)

    xf = x.astype(cdt)
    new_state = state.astype(cdt) * paddle.exp(dtf[:, :, None] * A.astype(cdt)) + \
        (dtf * xf)[:, :, None] * per_dim(B)
    y = (new_state * per_dim(C)).sum(axis=-1)
    if D is not None:
        y = y + D.astype(cdt) * xf
    if z is not None:
        y = y * F.silu(z.astype(cdt))
    paddle.assign(new_state.astype(state.dtype), output=state)
    return y.astype(x.dtype)


def paddle_linear_weights(x_proj_weight, delta_proj_weight, out_proj_weight, is_paddle_linear: bool):
    """The three projection weights in Paddle's ``[in, out]`` layout (torch's is ``[out, in]``)."""
    if is_paddle_linear:
        return x_proj_weight, delta_proj_weight, out_proj_weight
    return x_proj_weight.T, delta_proj_weight.T, out_proj_weight.T


def conv_weight_2d(conv1d_weight):
    """A Conv1D weight [d, 1, w] (or already [d, w]) as [d, w]."""
    return conv1d_weight.reshape([conv1d_weight.shape[0], conv1d_weight.shape[-1]])


def rms_norm_axis(t, weight, eps, axis):
    """RMSNorm of t over ``axis`` (weight laid along it), in t's dtype (float32 or float64)."""
    rstd = paddle.rsqrt((t * t).mean(axis=axis, keepdim=True) + eps)
    shape = [1] * t.ndim
    shape[axis] = t.shape[axis]
    return t * rstd * weight.astype(t.dtype).reshape(shape)


def mamba_inner_ref(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None,
                    C_proj_bias=None, delta_softplus=True, is_paddle_linear=True, b_rms_weight=None,
                    c_rms_weight=None, dt_rms_weight=None, b_c_dt_rms_eps=1e-6):
    """Mamba-1 inner block composed from the references: xz [b, 2d, l] -> out [b, l, d_model].

    x, z = split(xz); x = silu(conv(x)); x_dbl = x^T @ x_proj; delta = x_dbl[:, :r] @ delta_proj;
    B = x_dbl's dstate columns after r, C = its last dstate columns (each unless given, mamba_ssm's
    layout: x_proj has no columns for a given B or C, or 2 dstate of which the given one's go unused);
    B, C, delta RMS-normalised over dstate (dim for delta) with ``b/c/dt_rms_weight`` (Jamba);
    y = scan(x, delta, A, B, C, D, z); out = y^T @ out_proj + out_proj_bias."""
    cdt = _compute_dtype(xz)
    batch, two_dim, seqlen = xz.shape
    dim = two_dim // 2
    x_proj, delta_proj, out_proj = (w.astype(cdt) for w in paddle_linear_weights(
        x_proj_weight, delta_proj_weight, out_proj_weight, is_paddle_linear))
    rank = delta_proj.shape[0]
    dstate = A.shape[1] * (2 if _is_complex(A) else 1)
    xzf = xz.astype(cdt)
    x, z = xzf[:, :dim], xzf[:, dim:]
    conv_out = causal_conv1d_ref(x, conv_weight_2d(conv1d_weight).astype(cdt), _cast(conv1d_bias, cdt),
                                 activation="silu")
    x_dbl = paddle.matmul(conv_out.transpose([0, 2, 1]).reshape([batch * seqlen, dim]), x_proj)
    delta = paddle.matmul(x_dbl[:, :rank], delta_proj).reshape([batch, seqlen, dim]).transpose([0, 2, 1])
    if dt_rms_weight is not None:
        delta = rms_norm_axis(delta, dt_rms_weight, b_c_dt_rms_eps, 1)

    def projected(start, bias):
        t = x_dbl[:, start:start + dstate]
        if bias is not None:
            t = t + bias.astype(cdt)
        t = t.reshape([batch, seqlen, dstate])
        if _is_complex(A):  # [b, l, (n two)] -> [b, n, (l two)]
            t = t.reshape([batch, seqlen, dstate // 2, 2]).transpose([0, 2, 1, 3])
            return t.reshape([batch, dstate // 2, 2 * seqlen])
        return t.transpose([0, 2, 1])

    B = projected(rank, B_proj_bias) if B is None else B
    C = projected(x_dbl.shape[1] - dstate, C_proj_bias) if C is None else C
    if b_rms_weight is not None:  # over dstate: axis -2 of [b, (g,) n, l]
        B = rms_norm_axis(B.astype(cdt), b_rms_weight, b_c_dt_rms_eps, B.ndim - 2)
    if c_rms_weight is not None:
        C = rms_norm_axis(C.astype(cdt), c_rms_weight, b_c_dt_rms_eps, C.ndim - 2)
    y = selective_scan_ref(conv_out, delta, A, B, C, D, z, delta_bias, delta_softplus)
    out = paddle.matmul(y.transpose([0, 2, 1]), out_proj)
    if out_proj_bias is not None:
        out = out + out_proj_bias.astype(cdt)
    return out.astype(xz.dtype)
