"""Pure-Paddle Mamba-2 (SSD, state-space duality): the ground truth and the CPU fallback.

The multi-head scan with a scalar decay per head:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        h [nheads, headdim, dstate]
    y_t = h_t C_t + D x_t          (then y_t * silu(z_t) when z is given)

with ``dt = clip(softplus?(dt + dt_bias), *dt_limit)`` and B, C shared by the ``nheads / ngroups``
heads of a group. ``seq_idx`` [batch, seqlen] packs several sequences in one row: the state restarts
from zero wherever ``seq_idx`` changes value (``initial_states`` continue the sequence at position 0).

Shapes: x, z ``[batch, seqlen, nheads, headdim]``; dt ``[batch, seqlen, nheads]``; A, dt_bias
``[nheads]``; B, C ``[batch, seqlen, ngroups, dstate]``; D ``[nheads]`` or ``[nheads, headdim]``;
states ``[batch, nheads, headdim, dstate]``.

Everything computes in float32 (float64 when any main input is float64) and casts y back to x's dtype;
states stay in the compute dtype. Autograd goes through the casts, so every input gets a gradient.

* ``ssd_chunked_ref``: the SSD algorithm chunk by chunk (what the Triton kernels do): cumulative sum
  of dt*A inside each chunk, the intra-chunk output ``(C B^T * decay mask) (dt x)``, each chunk's own
  end state, the state passed from chunk to chunk, and the inter-chunk output ``C h_start``.
* ``ssd_recurrence_ref``: the token-by-token recurrence above.
* ``varlen_states_ref``: each packed sequence's final state as a weighted ``x^T B`` per sequence
  (differentiable; the Triton backend's varlen states when they need a gradient).
* ``selective_state_update_multihead_ref``: one decoding step, state updated in place.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F

from .mamba import permuted

NO_DT_LIMIT = (0.0, math.inf)


def _compute_dtype(*tensors) -> str:
    return "float64" if any(t is not None and t.dtype == paddle.float64 for t in tensors) else "float32"


def process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt):
    """dt [..., nheads] after bias, softplus (linear above 20, as F.softplus) and the clip."""
    dt = dt.astype(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(cdt)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = paddle.clip(dt, min=lo, max=hi)
    return dt


def _heads(t, nheads, cdt):
    """B or C [..., ngroups, dstate] -> [..., nheads, dstate] (each group serves nheads/ngroups heads)."""
    t = t.astype(cdt)
    groups = t.shape[-2]
    return t if groups == nheads else paddle.repeat_interleave(t, nheads // groups, axis=t.ndim - 2)


def segment_ids(seq_idx, batch, seqlen):
    """[batch, seqlen] int64 numbering of the runs of equal ``seq_idx`` (0 at position 0), or None:
    two positions share a state exactly when they share a run, whatever values seq_idx uses."""
    if seq_idx is None:
        return None
    seq_idx = seq_idx.astype("int64")
    changes = (seq_idx[:, 1:] != seq_idx[:, :-1]).astype("int64")
    return paddle.concat([paddle.zeros([batch, 1], dtype="int64"), paddle.cumsum(changes, axis=1)], axis=1)


def _skip_and_gate(y, xf, D, z, cdt):
    """y + D x, times silu(z); y, xf [..., nheads, headdim]."""
    if D is not None:
        Df = D.astype(cdt)
        y = y + (Df[:, None] if Df.ndim == 1 else Df) * xf
    if z is not None:
        y = y * F.silu(z.astype(cdt))
    return y


def ssd_chunked_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                    dt_softplus=False, dt_limit=NO_DT_LIMIT, states_at=None):
    """SSD chunk by chunk. Returns ``(y, final_states)``: y ``[batch, seqlen, nheads, headdim]`` in x's
    dtype, final_states ``[batch, nheads, headdim, dstate]`` (compute dtype), the state after the last
    token. ``states_at``: optional list of token positions; then also returns the states right after
    each, ``[batch, len(states_at), nheads, headdim, dstate]`` (per-sequence final states of a packed
    row). Memory: ``[batch, nchunks, nheads, chunk, chunk]`` for the decay mask."""
    cdt = _compute_dtype(x, dt, A, B, C)
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    K = int(chunk_size)
    nchunks = max(1, -(-seqlen // K))
    pad = nchunks * K - seqlen

    xf = x.astype(cdt)
    dtf = process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    Bf, Cf = _heads(B, nheads, cdt), _heads(C, nheads, cdt)
    seg = segment_ids(seq_idx, batch, seqlen)
    if pad:  # padded tokens have dt = 0 and x = B = C = 0: the state passes through them unchanged
        xp = paddle.concat([xf, paddle.zeros([batch, pad, nheads, headdim], cdt)], axis=1)
        dtp = paddle.concat([dtf, paddle.zeros([batch, pad, nheads], cdt)], axis=1)
        Bp = paddle.concat([Bf, paddle.zeros([batch, pad, nheads, dstate], cdt)], axis=1)
        Cp = paddle.concat([Cf, paddle.zeros([batch, pad, nheads, dstate], cdt)], axis=1)
        if seg is not None:
            seg = paddle.concat([seg, seg[:, -1:].expand([batch, pad])], axis=1)
    else:
        xp, dtp, Bp, Cp = xf, dtf, Bf, Cf

    # chunk-major, heads before tokens: [b, c, h, K, ...]
    xk = permuted(xp.reshape([batch, nchunks, K, nheads, headdim]), [0, 1, 3, 2, 4])
    Bk = permuted(Bp.reshape([batch, nchunks, K, nheads, dstate]), [0, 1, 3, 2, 4])
    Ck = permuted(Cp.reshape([batch, nchunks, K, nheads, dstate]), [0, 1, 3, 2, 4])
    dtk = permuted(dtp.reshape([batch, nchunks, K, nheads]), [0, 1, 3, 2])    # [b, c, h, K]
    cs = paddle.cumsum(dtk * A.astype(cdt)[:, None], axis=-1)                  # log decay from chunk start
    segk = None if seg is None else seg.reshape([batch, nchunks, K])
    # run of the token just before each chunk (run 0 before the first: the initial states)
    prev_seg = None if segk is None else paddle.concat(
        [paddle.zeros([batch, 1], dtype="int64"), segk[:, :-1, -1]], axis=1)   # [b, c]
    neg_inf = paddle.full([], float("-inf"), dtype=cdt)

    # intra-chunk: y_t += sum_{s<=t, same run} (C_t . B_s) exp(cs_t - cs_s) dt_s x_s
    causal = paddle.tril(paddle.ones([K, K], dtype="bool"))
    if segk is not None:
        causal = causal & (segk[:, :, :, None] == segk[:, :, None, :])[:, :, None]  # [b, c, 1, K, K]
    # masked before exp: above the diagonal cs_t - cs_s > 0 and may overflow
    decay = paddle.exp(paddle.where(causal, cs[..., :, None] - cs[..., None, :], neg_inf))  # [b, c, h, K, K]
    scores = paddle.matmul(Ck, Bk, transpose_y=True) * decay * dtk[..., None, :]
    y = paddle.matmul(scores, xk)                                                # [b, c, h, K, p]

    # each chunk's own contribution to its end state: sum_s exp(cs_end - cs_s) dt_s x_s B_s^T
    to_end = cs[..., -1:] - cs
    if segk is not None:
        to_end = paddle.where((segk == segk[:, :, -1:])[:, :, None], to_end, neg_inf)
    weights = paddle.exp(to_end) * dtk                                           # [b, c, h, K]
    chunk_states = paddle.matmul(xk * weights[..., None], Bk, transpose_x=True)  # [b, c, h, p, n]

    # state passing, sequential over chunks: h_end = exp(cs_end) h_start + chunk_state
    if initial_states is not None:
        h = initial_states.astype(cdt)
    else:
        h = paddle.zeros([batch, nheads, headdim, dstate], dtype=cdt)
    carries = paddle.exp(cs[..., -1])                                            # [b, c, h]
    if segk is not None:  # a new run ends the chunk: nothing carries over
        carries = carries * (segk[:, :, -1] == prev_seg).astype(cdt)[:, :, None]
    # per-chunk views by unbind: slicing one chunk at a time costs a strided copy of the whole
    # gradient per chunk in the backward
    starts = []
    for carry, chunk_state in zip(paddle.unbind(carries, axis=1), paddle.unbind(chunk_states, axis=1)):
        starts.append(h)
        h = carry[:, :, None, None] * h + chunk_state
    h_start = paddle.stack(starts, axis=1)                                       # [b, c, h, p, n]

    # inter-chunk: y_t += exp(cs_t) C_t h_start, for tokens still in the run that entered the chunk
    from_start = cs
    if segk is not None:
        from_start = paddle.where((segk == prev_seg[:, :, None])[:, :, None], cs, neg_inf)
    y = y + paddle.matmul(Ck, h_start, transpose_y=True) * paddle.exp(from_start)[..., None]

    y = permuted(y, [0, 1, 3, 2, 4]).reshape([batch, nchunks * K, nheads, headdim])[:, :seqlen]
    y = _skip_and_gate(y, xf, D, z, cdt).astype(x.dtype)
    if states_at is None:
        return y, h
    at = []
    for pos in states_at:  # the state after token pos: its chunk's start state plus the chunk's tokens so far
        c, t = divmod(int(pos), K)
        w = decay[:, c, :, t, :] * dtk[:, c]                                     # [b, h, K]
        own = paddle.matmul(xk[:, c] * w[..., None], Bk[:, c], transpose_x=True)
        at.append(own + paddle.exp(from_start[:, c, :, t])[:, :, None, None] * h_start[:, c])
    return y, h, paddle.stack(at, axis=1)


def varlen_states_ref(x, dt, A, B, bounds, dt_bias=None, initial_states=None, dt_softplus=False,
                      dt_limit=NO_DT_LIMIT):
    """Each packed sequence's final state, differentiable: x [1, total, nheads, headdim], dt
    [1, total, nheads], B [1, total, ngroups, dstate], ``bounds`` the offsets [num_seqs + 1] (ints).
    Sequence s ending at token e: ``sum_t exp(sum_{t < u <= e} dt_u A) dt_t x_t B_t^T`` over its
    tokens, plus the decayed initial states for the first. Returns [num_seqs, nheads, headdim,
    dstate] in the compute dtype; memory of one sequence's [nheads, headdim, dstate] products."""
    cdt = _compute_dtype(x, dt, A, B)
    nheads = x.shape[2]
    Af = A.astype(cdt)
    out = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        start, end = int(start), int(end)
        dtf = process_dt(dt[0, start:end], dt_bias, dt_softplus, dt_limit, cdt)  # [L, h]
        dA = dtf * Af
        # log decay from each token to the end, summed from the end: exact where the weight is not tiny
        total = paddle.flip(paddle.cumsum(paddle.flip(dA, [0]), axis=0), [0])  # sum_{u >= t} dA_u
        w = paddle.exp(total - dA) * dtf
        xw = x[0, start:end].astype(cdt) * w[..., None]  # [L, h, p]
        h = paddle.matmul(xw.transpose([1, 2, 0]), _heads(B[0, start:end], nheads, cdt).transpose([1, 0, 2]))
        if i == 0 and initial_states is not None:  # the initial states continue the first sequence
            h = h + paddle.exp(total[0])[:, None, None] * initial_states[0].astype(cdt)
        out.append(h)
    return paddle.stack(out)


def ssd_recurrence_ref(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, initial_states=None,
                       seq_idx=None, dt_softplus=False, dt_limit=NO_DT_LIMIT, states_at=None):
    """The token-by-token recurrence; same arguments and results as ``ssd_chunked_ref``
    (``chunk_size`` is accepted and ignored). A may also be ``[batch, seqlen, nheads]``, one value per
    token: tests read dA's per-token terms from its gradient."""
    cdt = _compute_dtype(x, dt, A, B, C)
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    xf = x.astype(cdt)
    dtf = process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    Af = A.astype(cdt)
    Bf, Cf = _heads(B, nheads, cdt), _heads(C, nheads, cdt)
    seg = segment_ids(seq_idx, batch, seqlen)
    if initial_states is not None:
        h = initial_states.astype(cdt)
    else:
        h = paddle.zeros([batch, nheads, headdim, dstate], dtype=cdt)
    wanted = {int(p): i for i, p in enumerate(states_at or [])}
    ys, at = [], [None] * len(wanted)
    for t in range(seqlen):
        decay = paddle.exp(dtf[:, t] * (Af[:, t] if Af.ndim == 3 else Af))      # [b, h]
        if seg is not None and t > 0:
            decay = decay * (seg[:, t] == seg[:, t - 1]).astype(cdt)[:, None]
        h = decay[:, :, None, None] * h + \
            (dtf[:, t, :, None] * xf[:, t])[..., None] * Bf[:, t, :, None, :]
        ys.append((h * Cf[:, t, :, None, :]).sum(axis=-1))
        if t in wanted:
            at[wanted[t]] = h
    y = _skip_and_gate(paddle.stack(ys, axis=1), xf, D, z, cdt).astype(x.dtype)
    if states_at is None:
        return y, h
    return y, h, paddle.stack(at, axis=1)


def selective_state_update_multihead_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decoding step. state ``[batch, nheads, headdim, dstate]`` (updated in place); x, z
    ``[batch, nheads, headdim]``; dt ``[batch, nheads]``; A, dt_bias ``[nheads]``; B, C
    ``[batch, ngroups, dstate]``; D ``[nheads]`` or ``[nheads, headdim]``. Returns y
    ``[batch, nheads, headdim]`` in x's dtype."""
    cdt = _compute_dtype(x, state, A)
    nheads = x.shape[1]
    xf = x.astype(cdt)
    dtf = process_dt(dt, dt_bias, dt_softplus, NO_DT_LIMIT, cdt)
    Bf, Cf = _heads(B, nheads, cdt), _heads(C, nheads, cdt)
    new_state = paddle.exp(dtf * A.astype(cdt))[:, :, None, None] * state.astype(cdt) + \
        (dtf[:, :, None] * xf)[..., None] * Bf[:, :, None, :]
    y = _skip_and_gate((new_state * Cf[:, :, None, :]).sum(axis=-1), xf, D, z, cdt)
    paddle.assign(new_state.astype(state.dtype), output=state)
    return y.astype(x.dtype)
