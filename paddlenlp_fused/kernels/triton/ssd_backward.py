"""Mamba-2 SSD (state-space duality) chunked scan: the backward kernels.

Forward (see ``reference/ssd.py``, the spec), per batch b, head h (group g = h // (nheads/ngroups)),
chunk c of K = chunk_size tokens, cs = dA_cumsum (inclusive cumsum of dt*A inside the chunk), S_c
the state entering chunk c [headdim, dstate]:

    y_t   = sum_{s<=t, same run} CB_ts exp(cs_t - cs_s) dt_s x_s      (intra-chunk)
          + [t in the run entering c] exp(cs_t) S_c C_t                (inter-chunk)
          + D x_t                  ;  out = y * silu(z) when z is given (out_x = y)
    S_c+1 = carry_c S_c + sum_{s in the run ending c} exp(cs_end - cs_s) dt_s x_s B_s^T
    carry_c = exp(cs_end) when chunk c ends in the run that entered it, else 0

"Runs" are the stretches of equal ``seq_idx``; the kernels number them inside each chunk, counting
the changes since the token before the chunk (run 0 = the run entering the chunk), so any seq_idx
values work, as in the reference.

Backward stages (one launch each, in order):

1. ``_gate_bwd_kernel`` (only with z): dz, and dy = dout * silu(z) into the ``dy`` workspace.
2. ``_prep_kernel``: per chunk, the run numbers (with seq_idx) and a zeroed ``ddA_cumsum`` workspace.
3. ``_dstates_kernel``: G_c = sum_t [t in run entering c] exp(cs_t) dy_t C_t^T  [headdim, dstate].
4. ``_state_passing_bwd_kernel``: reverse over chunks, dS_c = G_c + carry_c dS_c+1 (dS_nchunks =
   dfinal_states); writes dS_c+1 (the gradient of chunk c's end state) in x's dtype to the
   ``dstates_next`` workspace, dinitial_states = dS_0, and adds carry_c <dS_c+1, S_c> to d cs_end.
   (``_dstates_passing_kernel`` does 3 and 4 in one launch, computing G_c inside the chunk loop.)
5. ``_chunk_dx_kernel`` per (chunk, block of tokens s, head): dx, the part of d dt_s that multiplies
   dt_s directly, the D gradient, and the chunk-state term of d cs.
6. ``_chunk_dcb_kernel`` per (chunk, (t, s) tile of token blocks, group, split of its heads): per head
   dcb_ts = exp(cs_t - cs_s) dt_s <dy_t, x_s> (s <= t, same run), whose product with CB_ts is the
   intra-chunk term of d cs; dCB = sum over the group's heads, then dC_t += dCB B_s, dB_s += dCB^T C_t.
7. ``_chunk_state_dbdc_kernel`` per (chunk, block of tokens, group, split of its heads): the
   inter-chunk dC_t += exp(cs_t) dy_t S_c (and its d cs term) and the chunk-state dB_s += e_s dt_s
   x_s dS_c+1, each a product whose reduction runs over heads x headdim.
8. ``_dt_bwd_kernel``: d dt_out = direct part + A * reverse-cumsum(d cs) inside the chunk, dA, then
   through the clip (zero gradient where clipped), softplus and dt_bias to ddt, ddt_bias.

Shapes: x, z, dout, out_x, dx, dz ``[batch, seqlen, nheads, headdim]``; dt, ddt ``[batch, seqlen,
nheads]``; A, dA, dt_bias, ddt_bias ``[nheads]``; B, C, dB, dC ``[batch, seqlen, ngroups, dstate]``;
D, dD ``[nheads]`` or ``[nheads, headdim]``; initial/final states and their gradients ``[batch,
nheads, headdim, dstate]``; seq_idx ``[batch, seqlen]`` int32/int64; dt_out, dA_cumsum ``[batch, nheads,
nchunks, chunk_size]`` fp32; states ``[batch, nchunks, nheads, headdim, dstate]`` fp32 or x's dtype; CB ``[batch,
nchunks, ngroups, chunk_size, chunk_size]`` fp32 (CB[..., t, s] = C_t . B_s). Every tensor contiguous.

Matrix products take operands in x's dtype (fp32 intermediates cast down, as on the forward) with
fp32 accumulation; fp32 inputs use ``input_precision="tf32x3"`` (three tf32 products: fp32 accuracy on
the tensor cores, where exact fp32 dots compile to huge unrolled FMA code). dA, dD, ddt_bias, dB, dC
and the d cs workspace take atomic adds (the caller zeroes the first five), relaxed: pure accumulation
needs no ordering, and the default acq_rel fences stall every program's memory traffic.
"""

from __future__ import annotations

import contextlib
import math

import triton
import triton.language as tl

from ...runtime import tensor as T
from .interpreter_compat import dot_operand

_INT_DTYPES = ("int32", "int64")


def workspace_shapes(batch: int, seqlen: int, nheads: int, headdim: int, dstate: int, chunk_size: int,
                     has_z: bool, dout_dtype: str, states_dtype: str = "float32"):
    """The scratch ``ssd_chunked_bwd`` needs, as ``{name: (shape, dtype)}``; the caller allocates each
    (contents need not be initialised) and passes the dict as ``workspace=``. ``dy`` only with z;
    ``dstates`` (G_c, fp32) only when stages 3-4 run as two kernels (``TUNING`` at this call);
    ``states_lp`` only for fp32 ``states`` (of dtype ``states_dtype``) with 16-bit dout."""
    nchunks = max(1, -(-seqlen // chunk_size))
    shapes = {
        "ddA_cumsum": ((batch, nheads, nchunks, chunk_size), "float32"),
        "ddt_direct": ((batch, nheads, nchunks, chunk_size), "float32"),
        "runs": ((batch, nchunks, chunk_size), "int32"),
        "dstates_next": ((batch, nchunks, nheads, headdim, dstate), dout_dtype),
    }
    if _fused_passing_config(batch, nheads, chunk_size, headdim, dstate) is None:
        shapes["dstates"] = ((batch, nchunks, nheads, headdim, dstate), "float32")
    if dout_dtype != "float32" and states_dtype == "float32":  # states in x's dtype for the dC product
        shapes["states_lp"] = ((batch, nchunks, nheads, headdim, dstate), dout_dtype)
    if has_z:
        shapes["dy"] = ((batch, seqlen, nheads, headdim), dout_dtype)
    return shapes


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with operands cast to DOT_DTYPE, fp32 accumulation."""
    return tl.dot(dot_operand(a.to(DOT_DTYPE)), dot_operand(b.to(DOT_DTYPE)), input_precision=PRECISION,
                  out_dtype=tl.float32)


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _gate_bwd_kernel(dout_ptr, z_ptr, out_x_ptr, dz_ptr, dy_ptr, n_rows, P,
                     BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rows = (batch, token, head), P = headdim: dy = dout silu(z), dz = dout out_x silu'(z)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_P)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < P)
    offs = rows.to(tl.int64)[:, None] * P + cols[None, :]
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(out_x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(z)
    tl.store(dy_ptr + offs, (dout * z * sig).to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptr + offs, (dout * y * sig * (1.0 + z * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prep_kernel(seq_idx_ptr, runs_ptr, ddA_ptr, ddt_direct_ptr, seqlen, nheads, nchunks, K,
                 HAS_SEQ: tl.constexpr, ZERO_DIRECT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (chunk, batch): run numbers inside the chunk (changes of seq_idx since the token
    before it; padded tokens stay in the last run) and zeros in d cs (and, when the dx stage
    accumulates it, the direct part of d dt) for every head."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    in_chunk = k < K
    if HAS_SEQ:
        pos = c * K + k
        cur_ok = in_chunk & (pos < seqlen) & (pos > 0)
        cur = tl.load(seq_idx_ptr + b * seqlen + pos, mask=cur_ok, other=0)
        prev = tl.load(seq_idx_ptr + b * seqlen + pos - 1, mask=cur_ok, other=0)
        runs = tl.cumsum((cur != prev).to(tl.int32), axis=0)
        tl.store(runs_ptr + (b * nchunks + c) * K + k, runs, mask=in_chunk)
    zeros = tl.zeros([BLOCK_K], dtype=tl.float32)
    for h in range(nheads):
        tl.store(ddA_ptr + ((b * nheads + h) * nchunks + c) * K + k, zeros, mask=in_chunk)
        if ZERO_DIRECT:
            tl.store(ddt_direct_ptr + ((b * nheads + h) * nchunks + c) * K + k, zeros, mask=in_chunk)


@triton.jit
def _token_info(dt_out_ptr, dA_cs_ptr, runs_ptr, b, h, c, t, seqlen, nheads, nchunks, K,
                HAS_SEQ: tl.constexpr):
    """For chunk tokens t [BLOCK]: valid, dt, cs, run number (0 without seq_idx) and, per chunk,
    cs_end and the run of the chunk's last token."""
    valid = (t < K) & (c * K + t < seqlen)
    row = ((b * nheads + h) * nchunks + c) * K
    dt = tl.load(dt_out_ptr + row + t, mask=valid, other=0.0).to(tl.float32)
    cs = tl.load(dA_cs_ptr + row + t, mask=t < K, other=0.0).to(tl.float32)
    cs_end = tl.load(dA_cs_ptr + row + K - 1).to(tl.float32)
    if HAS_SEQ:
        run = tl.load(runs_ptr + (b * nchunks + c) * K + t, mask=t < K, other=-1)
        run_end = tl.load(runs_ptr + (b * nchunks + c) * K + K - 1)
    else:
        run = tl.zeros(t.shape, dtype=tl.int32)
        run_end = 0
    return valid, dt, cs, cs_end, run, run_end


@triton.jit
def _chunk_G(dy_ptr, C_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, b, c, h, g, p, n, seqlen, nheads, ngroups, nchunks,
             K, P, N, HAS_SEQ: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """G_c[p, n] = sum_t w_t dy_t[p] C_t[n] over chunk c, w_t = exp(cs_t) for the tokens of the run
    entering the chunk: the gradient of the state entering c through this chunk's outputs [P, N]."""
    DOT_DTYPE = dy_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for t0 in range(0, K, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        valid, dt, cs, cs_end, run, run_end = _token_info(dt_out_ptr, dA_cs_ptr, runs_ptr, b, h, c, t, seqlen,
                                                          nheads, nchunks, K, HAS_SEQ)
        w = tl.where(valid & (run == 0), tl.exp(cs), 0.0)
        tok = (b * seqlen + c * K + t).to(tl.int64)
        dyT = tl.load(dy_ptr + (tok[None, :] * nheads + h) * P + p[:, None],
                      mask=valid[None, :] & (p[:, None] < P), other=0.0)
        Ct = tl.load(C_ptr + (tok[:, None] * ngroups + g) * N + n[None, :],
                     mask=valid[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)
        acc += _mm(dyT, Ct * w[:, None], DOT_DTYPE, DOT_PRECISION)
    return acc


@triton.jit
def _dstates_kernel(dy_ptr, C_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, G_ptr,
                    seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group,
                    HAS_SEQ: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (batch * chunk, P block * N block, head): G_c (``_chunk_G``) into G_ptr [b, c, h, P, N]."""
    n_pb = tl.cdiv(P, BLOCK_P)
    pb = tl.program_id(1) % n_pb
    nb = tl.program_id(1) // n_pb
    b = (tl.program_id(0) // nchunks).to(tl.int64)
    c = tl.program_id(0) % nchunks
    h = tl.program_id(2)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _chunk_G(dy_ptr, C_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, b, c, h, h // heads_per_group, p, n, seqlen,
                   nheads, ngroups, nchunks, K, P, N, HAS_SEQ, BLOCK_P, BLOCK_N, BLOCK_T, DOT_PRECISION)
    out = ((b * nchunks + c) * nheads + h) * P * N
    tl.store(G_ptr + out + p[:, None] * N + n[None, :], acc, mask=(p[:, None] < P) & (n[None, :] < N))


@triton.jit
def _dstates_passing_kernel(dy_ptr, C_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, states_ptr, dfinal_ptr, dinit_ptr,
                            ddA_ptr, dSn_ptr, S_lp_ptr, seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group,
                            HAS_SEQ: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr,
                            WRITE_S_LP: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """Stages 3 and 4 in one (no G round trip). Program (P block * N block, batch, head): reverse over
    chunks, dS_c = G_c + carry_c dS_c+1 with G_c computed in place (``_chunk_G``); writes dS_c+1 to
    dSn_ptr (x's dtype), carry_c <dS_c+1, S_c> to d cs_end, and dinitial_states = dS_0."""
    n_pb = tl.cdiv(P, BLOCK_P)
    pb = tl.program_id(0) % n_pb
    nb = tl.program_id(0) // n_pb
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    pn_mask = (p[:, None] < P) & (n[None, :] < N)
    pn = p[:, None] * N + n[None, :]
    bh = (b * nheads + h) * P * N
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + bh + pn, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k in range(nchunks):
        c = nchunks - 1 - k
        state = ((b * nchunks + c) * nheads + h) * P * N
        tl.store(dSn_ptr + state + pn, dS.to(dSn_ptr.dtype.element_ty), mask=pn_mask)
        S = tl.load(states_ptr + state + pn, mask=pn_mask, other=0.0).to(tl.float32)
        if WRITE_S_LP:
            tl.store(S_lp_ptr + state + pn, S.to(S_lp_ptr.dtype.element_ty), mask=pn_mask)
        end = ((b * nheads + h) * nchunks + c) * K + K - 1
        carry = tl.exp(tl.load(dA_cs_ptr + end))
        if HAS_SEQ:
            carry = tl.where(tl.load(runs_ptr + (b * nchunks + c) * K + K - 1) == 0, carry, 0.0)
        tl.atomic_add(ddA_ptr + end, carry * tl.sum(tl.sum(dS * S, axis=1), axis=0), sem="relaxed")
        G = _chunk_G(dy_ptr, C_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, b, c, h, h // heads_per_group, p, n, seqlen,
                     nheads, ngroups, nchunks, K, P, N, HAS_SEQ, BLOCK_P, BLOCK_N, BLOCK_T, DOT_PRECISION)
        dS = G + carry * dS
    if HAS_DINIT:
        tl.store(dinit_ptr + bh + pn, dS, mask=pn_mask)


@triton.jit
def _state_passing_bwd_kernel(G_ptr, states_ptr, dA_cs_ptr, runs_ptr, dfinal_ptr, dinit_ptr, ddA_ptr, dSn_ptr,
                              S_lp_ptr, nheads, nchunks, K, PN,
                              HAS_SEQ: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr,
                              WRITE_S_LP: tl.constexpr,
                              BLOCK: tl.constexpr):
    """Program (block of headdim*dstate, batch, head): reverse over chunks, dS_c = G_c + carry_c dS_c+1.
    Writes dS_c+1 (gradient of chunk c's end state) to dSn_ptr in its dtype (x's: the matrix products
    take it in that dtype anyway) and adds carry_c <dS_c+1, S_c> to d cs_end."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    mask = i < PN
    bh = (b * nheads + h) * PN
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + bh + i, mask=mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BLOCK], dtype=tl.float32)
    head = (b * nchunks * nheads + h) * PN + i                                   # slot of chunk 0
    step = tl.cast(nheads, tl.int64) * PN                                        # chunk to chunk
    G_next = tl.load(G_ptr + head + (nchunks - 1) * step, mask=mask, other=0.0)
    S_next = tl.load(states_ptr + head + (nchunks - 1) * step, mask=mask, other=0.0)
    for k in range(nchunks):
        c = nchunks - 1 - k
        G = G_next
        S = S_next.to(tl.float32)
        # the next chunk's loads go out before this one's reduction and atomic (the loop is latency-bound)
        more = mask & (c > 0)
        G_next = tl.load(G_ptr + head + (c - 1) * step, mask=more, other=0.0)
        S_next = tl.load(states_ptr + head + (c - 1) * step, mask=more, other=0.0)
        tl.store(dSn_ptr + head + c * step, dS.to(dSn_ptr.dtype.element_ty), mask=mask)
        if WRITE_S_LP:
            tl.store(S_lp_ptr + head + c * step, S.to(S_lp_ptr.dtype.element_ty), mask=mask)
        end = ((b * nheads + h) * nchunks + c) * K + K - 1
        carry = tl.exp(tl.load(dA_cs_ptr + end).to(tl.float32))
        if HAS_SEQ:
            carry = tl.where(tl.load(runs_ptr + (b * nchunks + c) * K + K - 1) == 0, carry, 0.0)
        tl.atomic_add(ddA_ptr + end, carry * tl.sum(dS * S, axis=0), sem="relaxed")
        dS = G + carry * dS
    if HAS_DINIT:
        tl.store(dinit_ptr + bh + i, dS, mask=mask)


@triton.jit
def _chunk_dx_kernel(x_ptr, dy_ptr, B_ptr, CB_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, dSn_ptr, D_ptr,
                     dx_ptr, ddt_direct_ptr, ddA_ptr, dD_ptr,
                     seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group,
                     HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT_P: tl.constexpr, HEADS_FIRST: tl.constexpr, S_LOOP: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Program (batch * chunk, tile, head), or (head, tile, batch * chunk) with HEADS_FIRST (the
    programs running together share the chunk's B and CB in L2). A tile is a block of tokens s x
    BLOCK_P of headdim; with S_LOOP it is BLOCK_P of headdim and the program walks the chunk's token
    blocks, loading dS_c+1 once (BLOCK_N >= dstate). SPLIT_P: headdim in several blocks, whose parts
    of d dt are added atomically. Per token s:
    dx_s = dt_s acc_s + D dy_s with acc_s = e_s dS_c+1 B_s + sum_{t>=s} L_ts dy_t, L_ts = CB_ts
    exp(cs_t - cs_s) (same run), e_s = exp(cs_end - cs_s) (s in the run ending the chunk); <acc_s, x_s>
    is the direct part of d dt_s. d cs here: the chunk-state term Q_s = e_s dt_s <x_s, dS_c+1 B_s>
    (- at s, + at the end); the intra and inter terms come from the dC/dB kernels."""
    if HEADS_FIRST:
        h, tile, bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        bc, tile, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = (bc // nchunks).to(tl.int64)
    c = bc % nchunks
    n_pb = tl.cdiv(P, BLOCK_P)
    p = (tile % n_pb) * BLOCK_P + tl.arange(0, BLOCK_P)
    if S_LOOP:
        s_first, s_end = 0, K
    else:
        s_first = (tile // n_pb) * BLOCK_S
        s_end = s_first + 1
    g = h // heads_per_group
    DOT_DTYPE = x_ptr.dtype.element_ty
    state = ((b * nchunks + c) * nheads + h) * P * N
    row = ((b * nheads + h) * nchunks + c) * K
    cb_base = ((b * nchunks + c) * ngroups + g) * K * K
    if S_LOOP:  # dS_c+1^T [N, P], once per program
        n_all = tl.arange(0, BLOCK_N)
        dSnT_all = tl.load(dSn_ptr + state + p[None, :] * N + n_all[:, None],
                           mask=(n_all[:, None] < N) & (p[None, :] < P), other=0.0)
    if HAS_D:
        if D_PER_CHANNEL:
            Dv = tl.load(D_ptr + h * P + p, mask=p < P, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
    for s0 in range(s_first, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        valid_s, dt_s, cs_s, cs_end, run_s, run_end = _token_info(dt_out_ptr, dA_cs_ptr, runs_ptr, b, h, c, s,
                                                                  seqlen, nheads, nchunks, K, HAS_SEQ)
        tok_s = (b * seqlen + c * K + s).to(tl.int64)
        sp_mask = valid_s[:, None] & (p[None, :] < P)
        xs_offs = (tok_s[:, None] * nheads + h) * P + p[None, :]
        # chunk-state term: B_s dS_c+1^T (N in slices of BLOCK_N without S_LOOP)
        if S_LOOP:
            B_s = tl.load(B_ptr + (tok_s[:, None] * ngroups + g) * N + n_all[None, :],
                          mask=valid_s[:, None] & (n_all[None, :] < N), other=0.0)
            acc = _mm(B_s, dSnT_all, DOT_DTYPE, DOT_PRECISION)
        else:
            acc = tl.zeros([BLOCK_S, BLOCK_P], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                B_s = tl.load(B_ptr + (tok_s[:, None] * ngroups + g) * N + n[None, :],
                              mask=valid_s[:, None] & (n[None, :] < N), other=0.0)
                dSnT = tl.load(dSn_ptr + state + p[None, :] * N + n[:, None],
                               mask=(n[:, None] < N) & (p[None, :] < P), other=0.0)      # [N, P]
                acc += _mm(B_s, dSnT, DOT_DTYPE, DOT_PRECISION)
        e_s = tl.where(valid_s & (run_s == run_end), tl.exp(cs_end - cs_s), 0.0)
        acc = acc * e_s[:, None]
        x_s = tl.load(x_ptr + xs_offs, mask=sp_mask, other=0.0)
        Q = dt_s * tl.sum(acc * x_s.to(tl.float32), axis=1)

        # intra-chunk term, tokens t >= s
        for t0 in range(s0 // BLOCK_T * BLOCK_T, K, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            valid_t = (t < K) & (c * K + t < seqlen)
            cs_t = tl.load(dA_cs_ptr + row + t, mask=t < K, other=0.0)
            tok_t = (b * seqlen + c * K + t).to(tl.int64)
            dy_t = tl.load(dy_ptr + (tok_t[:, None] * nheads + h) * P + p[None, :],
                           mask=valid_t[:, None] & (p[None, :] < P), other=0.0)
            keep = (t[None, :] >= s[:, None]) & valid_t[None, :] & valid_s[:, None]
            if HAS_SEQ:
                run_t = tl.load(runs_ptr + (b * nchunks + c) * K + t, mask=t < K, other=-1)
                keep = keep & (run_t[None, :] == run_s[:, None])
            # a rectangular mask keeps the load vectorised; the triangle and runs are applied after
            CBT = tl.load(CB_ptr + cb_base + t[None, :] * K + s[:, None], mask=(t[None, :] < K) & (s[:, None] < K),
                          other=0.0)                                                 # [S, T]
            LT = tl.where(keep, CBT * tl.exp(cs_t[None, :] - cs_s[:, None]), 0.0)
            acc += _mm(LT, dy_t, DOT_DTYPE, DOT_PRECISION)

        x_s = x_s.to(tl.float32)
        dx = acc * dt_s[:, None]
        if HAS_D:
            dy_s = tl.load(dy_ptr + xs_offs, mask=sp_mask, other=0.0).to(tl.float32)
            dx += Dv * dy_s
            if D_PER_CHANNEL:
                tl.atomic_add(dD_ptr + h * P + p, tl.sum(dy_s * x_s, axis=0), mask=p < P, sem="relaxed")
            else:
                tl.atomic_add(dD_ptr + h, tl.sum(tl.sum(dy_s * x_s, axis=1), axis=0), sem="relaxed")
        tl.store(dx_ptr + xs_offs, dx.to(dx_ptr.dtype.element_ty), mask=sp_mask)
        if SPLIT_P:
            tl.atomic_add(ddt_direct_ptr + row + s, tl.sum(acc * x_s, axis=1), mask=s < K, sem="relaxed")
        else:
            tl.store(ddt_direct_ptr + row + s, tl.sum(acc * x_s, axis=1), mask=s < K)
        tl.atomic_add(ddA_ptr + row + s, -Q, mask=s < K, sem="relaxed")
        tl.atomic_add(ddA_ptr + row + K - 1, tl.sum(Q, axis=0), sem="relaxed")


@triton.jit
def _chunk_dcb_kernel(x_ptr, dy_ptr, B_ptr, C_ptr, CB_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, ddA_ptr, dB_ptr, dC_ptr,
                      seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group, heads_per_split, n_splits,
                      HAS_SEQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Program (batch * chunk, tile (tb, sb) of the nblk x nblk token blocks, group * split); tiles with
    sb > tb exit. Over this split's heads: dcb_ts = [s<=t, same run] exp(cs_t - cs_s) dt_s <dy_t, x_s>;
    per head, W_ts = CB_ts dcb_ts gives the intra d cs (+ at t, - at s); summed over the heads
    dCB gives dC_t += dCB B_s and dB_s += dCB^T C_t (atomic adds into the fp32 dB, dC)."""
    nblk = tl.cdiv(K, BLOCK)
    b = (tl.program_id(0) // nchunks).to(tl.int64)
    c = tl.program_id(0) % nchunks
    tb = tl.program_id(1) // nblk
    sb = tl.program_id(1) % nblk
    if sb > tb:
        return
    g = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    h_begin = g * heads_per_group + split * heads_per_split
    h_end = tl.minimum(h_begin + heads_per_split, (g + 1) * heads_per_group)
    DOT_DTYPE = x_ptr.dtype.element_ty
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    t = tb * BLOCK + tl.arange(0, BLOCK)
    s = sb * BLOCK + tl.arange(0, BLOCK)
    tok_t = (b * seqlen + c * K + t).to(tl.int64)
    tok_s = (b * seqlen + c * K + s).to(tl.int64)
    cb_base = ((b * nchunks + c) * ngroups + g) * K * K
    CB = tl.load(CB_ptr + cb_base + t[:, None] * K + s[None, :], mask=(t[:, None] < K) & (s[None, :] < K),
                 other=0.0)
    dCB = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    valid_t, dt_t, cs_t, cs_end, run_t, run_end = _token_info(
        dt_out_ptr, dA_cs_ptr, runs_ptr, b, h_begin, c, t, seqlen, nheads, nchunks, K, HAS_SEQ)
    valid_s, dt_s, cs_s, cs_end, run_s, run_end = _token_info(
        dt_out_ptr, dA_cs_ptr, runs_ptr, b, h_begin, c, s, seqlen, nheads, nchunks, K, HAS_SEQ)
    keep = (t[:, None] >= s[None, :]) & valid_t[:, None] & valid_s[None, :] & (run_t[:, None] == run_s[None, :])
    for h in range(h_begin, h_end):
        # the next head's cs and dt go out now: their latency hides behind this head's product
        row_next = ((b * nheads + tl.minimum(h + 1, h_end - 1)) * nchunks + c) * K
        cs_t_next = tl.load(dA_cs_ptr + row_next + t, mask=t < K, other=0.0)
        cs_s_next = tl.load(dA_cs_ptr + row_next + s, mask=s < K, other=0.0)
        dt_s_next = tl.load(dt_out_ptr + row_next + s, mask=valid_s, other=0.0)
        dy_t = tl.load(dy_ptr + (tok_t[:, None] * nheads + h) * P + p[None, :],
                       mask=valid_t[:, None] & (p[None, :] < P), other=0.0)
        xT = tl.load(x_ptr + (tok_s[None, :] * nheads + h) * P + p[:, None],
                     mask=valid_s[None, :] & (p[:, None] < P), other=0.0)
        dyx = _mm(dy_t, xT, DOT_DTYPE, DOT_PRECISION)                          # [T, S]
        dcb = dyx * tl.exp(tl.where(keep, cs_t[:, None] - cs_s[None, :], float("-inf"))) * dt_s[None, :]
        dCB += dcb
        W = tl.where(keep, dcb * CB, 0.0)  # whatever CB holds past the sequence's end
        row = ((b * nheads + h) * nchunks + c) * K
        tl.atomic_add(ddA_ptr + row + t, tl.sum(W, axis=1), mask=t < K, sem="relaxed")
        tl.atomic_add(ddA_ptr + row + s, -tl.sum(W, axis=0), mask=s < K, sem="relaxed")
        cs_t, cs_s, dt_s = cs_t_next, cs_s_next, dt_s_next
    n_mask = n[None, :] < N
    B_s = tl.load(B_ptr + (tok_s[:, None] * ngroups + g) * N + n[None, :], mask=valid_s[:, None] & n_mask, other=0.0)
    C_t = tl.load(C_ptr + (tok_t[:, None] * ngroups + g) * N + n[None, :], mask=valid_t[:, None] & n_mask, other=0.0)
    dC_t = _mm(dCB, B_s, DOT_DTYPE, DOT_PRECISION)
    dB_s = _mm(tl.trans(dCB), C_t, DOT_DTYPE, DOT_PRECISION)
    tl.atomic_add(dC_ptr + (tok_t[:, None] * ngroups + g) * N + n[None, :], dC_t, mask=valid_t[:, None] & n_mask,
                  sem="relaxed")
    tl.atomic_add(dB_ptr + (tok_s[:, None] * ngroups + g) * N + n[None, :], dB_s, mask=valid_s[:, None] & n_mask,
                  sem="relaxed")


@triton.jit
def _chunk_state_dbdc_kernel(x_ptr, dy_ptr, C_ptr, dt_out_ptr, dA_cs_ptr, runs_ptr, states_ptr, dSn_ptr, ddA_ptr,
                             dB_ptr, dC_ptr, seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group,
                             heads_per_split, n_splits,
                             HAS_SEQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             SLICE_P: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (batch * chunk, (token block, dstate block, which), group * split); over this split's
    heads (a GEMM whose reduction runs over heads x headdim):
    which 0: dC_t += sum_h w_t dy_t S_c with w_t = exp(cs_t) for the run entering the chunk, and per
             head the inter d cs_t += w_t <C_t, dy_t S_c>;
    which 1: dB_s += sum_h e_s dt_s x_s dS_c+1 (s in the run ending the chunk)."""
    n_nb = tl.cdiv(N, BLOCK_N)
    b = (tl.program_id(0) // nchunks).to(tl.int64)
    c = tl.program_id(0) % nchunks
    which = tl.program_id(1) % 2
    nb = (tl.program_id(1) // 2) % n_nb
    mb = tl.program_id(1) // (2 * n_nb)
    g = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    h_begin = g * heads_per_group + split * heads_per_split
    h_end = tl.minimum(h_begin + heads_per_split, (g + 1) * heads_per_group)
    DOT_DTYPE = x_ptr.dtype.element_ty
    t = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tok = (b * seqlen + c * K + t).to(tl.int64)
    valid = (t < K) & (c * K + t < seqlen)
    tn_mask = valid[:, None] & (n[None, :] < N)
    out = (tok[:, None] * ngroups + g) * N + n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    _, dt, cs, cs_end, run, run_end = _token_info(
        dt_out_ptr, dA_cs_ptr, runs_ptr, b, h_begin, c, t, seqlen, nheads, nchunks, K, HAS_SEQ)
    if which == 0:
        C_t = tl.load(C_ptr + out, mask=tn_mask, other=0.0).to(tl.float32)
        for h in range(h_begin, h_end):
            # the next head's cs goes out now: its latency hides behind this head's product
            row_next = ((b * nheads + tl.minimum(h + 1, h_end - 1)) * nchunks + c) * K
            cs_next = tl.load(dA_cs_ptr + row_next + t, mask=t < K, other=0.0)
            w_in = tl.where(valid & (run == 0), tl.exp(cs), 0.0)
            state = ((b * nchunks + c) * nheads + h) * P * N
            dyS = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for p0 in range(0, P, SLICE_P):
                q = p0 + tl.arange(0, SLICE_P)
                dy_t = tl.load(dy_ptr + (tok[:, None] * nheads + h) * P + q[None, :],
                               mask=valid[:, None] & (q[None, :] < P), other=0.0)
                S = tl.load(states_ptr + state + q[:, None] * N + n[None, :], mask=(q[:, None] < P) & (n[None, :] < N),
                            other=0.0)
                dyS += _mm(dy_t, S, DOT_DTYPE, DOT_PRECISION)
            row = ((b * nheads + h) * nchunks + c) * K
            tl.atomic_add(ddA_ptr + row + t, w_in * tl.sum(dyS * C_t, axis=1), mask=t < K, sem="relaxed")
            acc += dyS * w_in[:, None]
            cs = cs_next
        tl.atomic_add(dC_ptr + out, acc, mask=tn_mask, sem="relaxed")
    else:
        for h in range(h_begin, h_end):
            # the next head's cs and dt go out now: their latency hides behind this head's product
            row_next = ((b * nheads + tl.minimum(h + 1, h_end - 1)) * nchunks + c) * K
            cs_next = tl.load(dA_cs_ptr + row_next + t, mask=t < K, other=0.0)
            dt_next = tl.load(dt_out_ptr + row_next + t, mask=valid, other=0.0)
            cs_end_next = tl.load(dA_cs_ptr + row_next + K - 1)
            w_end = tl.where(valid & (run == run_end), tl.exp(cs_end - cs), 0.0) * dt
            state = ((b * nchunks + c) * nheads + h) * P * N
            for p0 in range(0, P, SLICE_P):
                q = p0 + tl.arange(0, SLICE_P)
                x_t = tl.load(x_ptr + (tok[:, None] * nheads + h) * P + q[None, :],
                              mask=valid[:, None] & (q[None, :] < P), other=0.0).to(tl.float32)
                dSn = tl.load(dSn_ptr + state + q[:, None] * N + n[None, :], mask=(q[:, None] < P) & (n[None, :] < N),
                              other=0.0)
                acc += _mm(x_t * w_end[:, None], dSn, DOT_DTYPE, DOT_PRECISION)
            cs, dt, cs_end = cs_next, dt_next, cs_end_next
        tl.atomic_add(dB_ptr + out, acc, mask=tn_mask, sem="relaxed")


@triton.jit
def _dt_bwd_kernel(dt_ptr, dt_bias_ptr, A_ptr, dt_out_ptr, ddt_direct_ptr, ddA_ptr, ddt_ptr, dA_ptr, ddt_bias_ptr,
                   seqlen, nheads, nchunks, K, dt_min, dt_max,
                   HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (chunk, batch, head): d dt_out_k = ddt_direct_k + A sum_{t>=k} d cs_t; dA += dt_out_k *
    that sum; then back through the clip, softplus and bias to the raw dt."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    k = tl.arange(0, BLOCK_K)
    in_chunk = k < K
    valid = in_chunk & (c * K + k < seqlen)
    row = ((b * nheads + h) * nchunks + c) * K
    ddA = tl.load(ddA_ptr + row + k, mask=in_chunk, other=0.0)
    r = tl.cumsum(ddA, axis=0, reverse=True) + 0.0  # + 0.0: a fresh array for the interpreter's atomics
    dt_out = tl.load(dt_out_ptr + row + k, mask=valid, other=0.0)
    A = tl.load(A_ptr + h).to(tl.float32)
    tl.atomic_add(dA_ptr + h, tl.sum(dt_out * r, axis=0), sem="relaxed")
    grad = tl.load(ddt_direct_ptr + row + k, mask=valid, other=0.0) + A * r
    tok = (b * seqlen + c * K + k) * nheads + h
    v = tl.load(dt_ptr + tok, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:  # F.softplus: linear above 20
        processed = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
        grad = grad * tl.where(v > 20.0, 1.0, _sigmoid(v))
    else:
        processed = v
    if HAS_LIMIT:  # paddle.clip passes the gradient on [min, max]
        grad = tl.where((processed >= dt_min) & (processed <= dt_max), grad, 0.0)
    grad = tl.where(valid, grad, 0.0)
    tl.store(ddt_ptr + tok, grad.to(ddt_ptr.dtype.element_ty), mask=valid)
    if HAS_BIAS:
        tl.atomic_add(ddt_bias_ptr + h, tl.sum(grad, axis=0), sem="relaxed")


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def _check(name, t, expected, dtypes=None, optional=False):
    if t is None:
        if optional:
            return
        raise ValueError(f"{name}: required, got None")
    T.check_same_shape(name, t, expected)
    T.check_contiguous(name, t)
    if dtypes is not None and T.dtype_name(t) not in dtypes:
        raise TypeError(f"{name}: expected dtype in {dtypes}, got {T.dtype_name(t)}")


# Launch configurations, None for the defaults below (the device sweep sets them):
#   "dx" (BLOCK_S, BLOCK_T, BLOCK_N, BLOCK_P, num_warps, num_stages, heads first, token-block loop); "dcb" (BLOCK,
#   heads per split, num_warps, num_stages); "state_dbdc" (BLOCK_M, BLOCK_N, SLICE_P, heads per split, num_warps,
#   num_stages); "fused_passing" (BLOCK_P, BLOCK_N, BLOCK_T, num_warps, num_stages) for stages 3-4 in one kernel,
#   False for two (default: fused when that gives enough programs); "dstates" (BLOCK_P, BLOCK_N, BLOCK_T,
#   num_warps, num_stages) and "passing" (BLOCK, num_warps) for the two; "states_lp": False keeps the chunk-state
#   dC product on the fp32 states (default: the passing stage copies them to x's dtype, half the bytes).
TUNING = {"dx": None, "dcb": None, "state_dbdc": None, "dstates": None, "passing": None, "fused_passing": None,
          "states_lp": None}


def _dx_config(K, N, P, dtype):
    if TUNING["dx"] is not None:
        return TUNING["dx"]
    if dtype == "float32":  # tf32x3 products take three times the registers: half of headdim 128 per program
        return min(_pow2(K), 64), min(_pow2(K), 64), min(_pow2(N), 64), min(_pow2(P), 64), 8, 2, True, False
    # the H200's pick at headdim 128, dstate 128, chunk 256 (bf16; benchmarks/NOTES.md): 128-token blocks
    # despite a small spill (fewer re-reads of dS_c+1, B and dy), 4 warps spill more; heads first shares
    # CB/B in L2; 32-token t steps 3 deep
    return min(_pow2(K), 128), min(_pow2(K), 32), min(_pow2(N), 64), min(_pow2(P), 128), 8, 3, True, False


def _dcb_config(K, P, heads_per_group, batch_chunks, dtype):
    if TUNING["dcb"] is not None:
        return TUNING["dcb"]
    # all heads of a group in one program (fewest atomics) unless that leaves too few programs; the head
    # loop pipelined 3 deep (2 past headdim 128, for shared memory); 16-bit: 4 warps (faster than 8 on the
    # H200 at the benchmark shape), fp32 (tf32x3 products): 8
    per_split = heads_per_group if batch_chunks >= 32 else min(heads_per_group, 8)
    return min(_pow2(K), 64), per_split, 8 if dtype == "float32" else 4, 3 if _pow2(P) <= 128 else 2


def _state_dbdc_config(K, P, N, heads_per_group, dtype):
    if TUNING["state_dbdc"] is not None:
        return TUNING["state_dbdc"]
    if dtype == "float32":  # tf32x3 products: 64-token blocks
        return min(_pow2(K), 64), min(_pow2(N), 128), min(_pow2(P), 64), min(heads_per_group, 32), 8, 3
    # H200, benchmark shape (bf16): 128-token blocks 2 deep beat 64 x 3
    return min(_pow2(K), 128), min(_pow2(N), 128), min(_pow2(P), 64), min(heads_per_group, 32), 8, 2


def _dstates_config(K, P, N):
    if TUNING["dstates"] is not None:
        return TUNING["dstates"]
    return min(_pow2(P), 128), min(_pow2(N), 128), min(_pow2(K), 64), 8, 2


def _fused_passing_config(batch, nheads, K, P, N):
    """Stages 3-4 fused when that leaves enough programs (each walks all chunks in turn), else None."""
    if TUNING["fused_passing"] is not None:
        return TUNING["fused_passing"] or None
    bp, bn = min(_pow2(P), 64), min(_pow2(N), 128)
    if batch * nheads * triton.cdiv(P, bp) * triton.cdiv(N, bn) < 256:
        return None
    return bp, bn, min(_pow2(K), 32), 4, 3


def ssd_chunked_bwd(dout, x, dt, A, B, C, dt_out, dA_cumsum, states, CB, dx, ddt, dA, dB, dC, *, chunk_size,
                    D=None, z=None, out_x=None, dt_bias=None, initial_states=None, seq_idx=None,
                    dfinal_states=None, dD=None, dz=None, ddt_bias=None, dinitial_states=None,
                    dt_softplus=False, dt_limit=(0.0, float("inf")), workspace=None) -> None:
    """Gradients of the SSD chunked scan, written into the caller's buffers (shapes in the module
    docstring): dx (x's dtype), ddt (dt's dtype), dz (z's dtype), dinitial_states (fp32, written when
    given), and the fp32 atomically-accumulated dA, dB, dC, dD, ddt_bias, which the caller zeroes.
    ``workspace``: the tensors of ``workspace_shapes(...)`` (allocated, uninitialised).
    ``dinitial_states`` is the gradient of the state entering chunk 0 (initial_states or zeros)."""
    batch, seqlen, nheads, headdim = T.shape(x)
    K = int(chunk_size)
    if K < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    if len(T.shape(B)) != 4 or T.shape(B)[:2] != (batch, seqlen) or nheads % max(T.shape(B)[2], 1):
        raise ValueError(f"B: expected [batch={batch}, seqlen={seqlen}, ngroups dividing {nheads}, dstate], "
                         f"got {T.shape(B)}")
    ngroups, dstate = T.shape(B)[2], T.shape(B)[3]
    nchunks = max(1, -(-seqlen // K))
    xs = (batch, seqlen, nheads, headdim)
    bs = (batch, seqlen, ngroups, dstate)
    hs = (batch, nheads, headdim, dstate)
    cs_shape = (batch, nheads, nchunks, K)
    for name, t, shape in (("dout", dout, xs), ("x", x, xs), ("dx", dx, xs), ("dt", dt, xs[:3]),
                           ("ddt", ddt, xs[:3]), ("B", B, bs), ("C", C, bs), ("dB", dB, bs), ("dC", dC, bs),
                           ("A", A, (nheads,)), ("dA", dA, (nheads,)), ("dt_out", dt_out, cs_shape),
                           ("dA_cumsum", dA_cumsum, cs_shape), ("states", states, (batch, nchunks) + hs[1:]),
                           ("CB", CB, (batch, nchunks, ngroups, K, K))):
        _check(name, t, shape)
    for name, t in (("dA", dA), ("dB", dB), ("dC", dC), ("dt_out", dt_out), ("dA_cumsum", dA_cumsum),
                    ("CB", CB)):
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")
    if T.dtype_name(states) not in ("float32", T.dtype_name(x)):
        raise TypeError(f"states: expected float32 or x's dtype {T.dtype_name(x)}, got {T.dtype_name(states)}")
    if (z is None) != (dz is None) or (z is None) != (out_x is None):
        raise ValueError("z, dz, out_x: give all three or none")
    _check("z", z, xs, optional=True)
    _check("dz", dz, xs, optional=True)
    _check("out_x", out_x, xs, optional=True)
    if (D is None) != (dD is None):
        raise ValueError("D, dD: give both or neither")
    if D is not None:
        if T.shape(D) not in ((nheads,), (nheads, headdim)):
            raise ValueError(f"D: expected [nheads={nheads}] or [nheads, headdim={headdim}], got {T.shape(D)}")
        _check("dD", dD, T.shape(D), ("float32",))
    if (dt_bias is None) != (ddt_bias is None):
        raise ValueError("dt_bias, ddt_bias: give both or neither")
    _check("dt_bias", dt_bias, (nheads,), optional=True)
    _check("ddt_bias", ddt_bias, (nheads,), ("float32",), optional=True)
    _check("initial_states", initial_states, hs, optional=True)
    _check("dinitial_states", dinitial_states, hs, ("float32",), optional=True)
    _check("dfinal_states", dfinal_states, hs, optional=True)
    _check("seq_idx", seq_idx, (batch, seqlen), _INT_DTYPES, optional=True)
    lo, hi = (float(v) for v in dt_limit)
    if workspace is None:
        raise ValueError("workspace: expected the dict of tensors described by workspace_shapes(...), got None")
    for name, (shape, dtype) in workspace_shapes(batch, seqlen, nheads, headdim, dstate, K, z is not None,
                                                 T.dtype_name(dout), T.dtype_name(states)).items():
        _check(f"workspace[{name!r}]", workspace.get(name), shape, (dtype,))
    if batch == 0 or seqlen == 0 or nheads == 0 or headdim == 0 or dstate == 0:
        return

    ddA = workspace["ddA_cumsum"]
    ddt_direct = workspace["ddt_direct"]
    runs = workspace["runs"]
    heads_per_group = nheads // ngroups
    has_seq = seq_idx is not None
    precision = "tf32x3" if T.dtype_name(x) == "float32" else "tf32"
    P, N = headdim, dstate
    BP, BN, BK = _pow2(P), _pow2(N), _pow2(K)

    dy = dout
    if z is not None:
        dy = workspace["dy"]
        rows = batch * seqlen * nheads
        block_r = max(1, 4096 // BP)
        _gate_bwd_kernel[(triton.cdiv(rows, block_r),)](dout, z, out_x, dz, dy, rows, P,
                                                        BLOCK_R=block_r, BLOCK_P=BP, num_warps=4)

    dx_config = _dx_config(K, N, P, T.dtype_name(x))
    split_p = dx_config[3] < P  # headdim in several dx programs: they add up the direct part of d dt
    _prep_kernel[(nchunks, batch)](seq_idx, runs, ddA, ddt_direct, seqlen, nheads, nchunks, K,
                                   HAS_SEQ=has_seq, ZERO_DIRECT=split_p, BLOCK_K=BK, num_warps=4)

    dSn = workspace["dstates_next"]
    # fp32 states: copied to x's dtype for the chunk-state dC product by the passing stage (unless
    # TUNING says not); states already in x's dtype (``ssd.states_dtype``) serve as they are
    s_lp = TUNING["states_lp"] is not False and "states_lp" in workspace
    S_lp = workspace["states_lp"] if s_lp else None
    fused_config = _fused_passing_config(batch, nheads, K, P, N)
    if fused_config is not None:
        bp, bn, bt, warps, stages = fused_config
        _dstates_passing_kernel[(triton.cdiv(P, bp) * triton.cdiv(N, bn), batch, nheads)](
            dy, C, dt_out, dA_cumsum, runs, states, dfinal_states, dinitial_states, ddA, dSn, S_lp,
            seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group,
            HAS_SEQ=has_seq, HAS_DFINAL=dfinal_states is not None, HAS_DINIT=dinitial_states is not None,
            WRITE_S_LP=s_lp,
            BLOCK_P=bp, BLOCK_N=bn, BLOCK_T=bt, DOT_PRECISION=precision, num_warps=warps, num_stages=stages)
    else:
        bp, bn, bt, warps, stages = _dstates_config(K, P, N)
        _dstates_kernel[(batch * nchunks, triton.cdiv(P, bp) * triton.cdiv(N, bn), nheads)](
            dy, C, dt_out, dA_cumsum, runs, workspace["dstates"], seqlen, nheads, ngroups, nchunks, K, P, N,
            heads_per_group,
            HAS_SEQ=has_seq, BLOCK_P=bp, BLOCK_N=bn, BLOCK_T=bt, DOT_PRECISION=precision,
            num_warps=warps, num_stages=stages)
        block, warps = TUNING["passing"] or (1024, 4)
        _state_passing_bwd_kernel[(triton.cdiv(P * N, block), batch, nheads)](
            workspace["dstates"], states, dA_cumsum, runs, dfinal_states, dinitial_states, ddA, dSn, S_lp, nheads,
            nchunks, K, P * N,
            HAS_SEQ=has_seq, HAS_DFINAL=dfinal_states is not None, HAS_DINIT=dinitial_states is not None,
            WRITE_S_LP=s_lp,
            BLOCK=block, num_warps=warps)

    bs_, bt, bn, bp, warps, stages, heads_first, s_loop = dx_config
    s_loop = s_loop and bn >= N
    heads_first = heads_first and batch * nchunks < 65536  # grid axes 1 and 2 stop at 65535
    tiles = (1 if s_loop else triton.cdiv(K, bs_)) * triton.cdiv(P, bp)
    _chunk_dx_kernel[(nheads, tiles, batch * nchunks) if heads_first else (batch * nchunks, tiles, nheads)](
        x, dy, B, CB, dt_out, dA_cumsum, runs, dSn, D, dx, ddt_direct, ddA, dD,
        seqlen, nheads, ngroups, nchunks, K, P, N, heads_per_group,
        HAS_SEQ=has_seq, HAS_D=D is not None, D_PER_CHANNEL=D is not None and len(T.shape(D)) == 2,
        BLOCK_S=bs_, BLOCK_T=bt, BLOCK_P=bp, BLOCK_N=bn, SPLIT_P=split_p, HEADS_FIRST=heads_first, S_LOOP=s_loop,
        DOT_PRECISION=precision,
        num_warps=warps, num_stages=stages)

    blk, per_split, warps, stages = _dcb_config(K, P, heads_per_group, batch * nchunks, T.dtype_name(x))
    per_split = min(per_split, heads_per_group)
    n_splits = -(-heads_per_group // per_split)
    nblk = triton.cdiv(K, blk)
    _chunk_dcb_kernel[(batch * nchunks, nblk * nblk, ngroups * n_splits)](
        x, dy, B, C, CB, dt_out, dA_cumsum, runs, ddA, dB, dC, seqlen, nheads, ngroups, nchunks, K, P, N,
        heads_per_group, per_split, n_splits,
        HAS_SEQ=has_seq, BLOCK=blk, BLOCK_P=BP, BLOCK_N=BN, DOT_PRECISION=precision,
        num_warps=warps, num_stages=stages)

    bm, bn, slice_p, per_split, warps, stages = _state_dbdc_config(K, P, N, heads_per_group, T.dtype_name(x))
    per_split = min(per_split, heads_per_group)
    n_splits = -(-heads_per_group // per_split)
    _chunk_state_dbdc_kernel[(batch * nchunks, triton.cdiv(K, bm) * triton.cdiv(N, bn) * 2, ngroups * n_splits)](
        x, dy, C, dt_out, dA_cumsum, runs, S_lp if s_lp else states, dSn, ddA, dB, dC,
        seqlen, nheads, ngroups, nchunks, K, P, N,
        heads_per_group, per_split, n_splits,
        HAS_SEQ=has_seq, BLOCK_M=bm, BLOCK_N=bn, SLICE_P=slice_p, DOT_PRECISION=precision,
        num_warps=warps, num_stages=stages)

    _dt_bwd_kernel[(nchunks, batch, nheads)](
        dt, dt_bias, A, dt_out, ddt_direct, ddA, ddt, dA, ddt_bias, seqlen, nheads, nchunks, K, lo, hi,
        HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_LIMIT=lo > 0.0 or hi < math.inf,
        BLOCK_K=BK, num_warps=4)


@contextlib.contextmanager
def _tuned(tuning):
    """Some ``TUNING`` entries set inside the block."""
    saved = dict(TUNING)
    TUNING.update(tuning)
    try:
        yield
    finally:
        TUNING.update(saved)


def _launch_with(tuning, *args, **kwargs):
    with _tuned(tuning):
        ssd_chunked_bwd(*args, **kwargs)


def compile_cases():
    """Compile-only cases: every dtype on the benchmark shape (chunk 256, headdim 128, dstate 128) with
    all options and the states in x's dtype (as the forward leaves them there), the same with fp32
    states through the launch paths the defaults do not take there, and an odd small shape (chunk 16,
    headdim 24, dstate 40, 2 groups) without options."""
    other_paths = dict(fused_passing=False, states_lp=False, dx=(64, 32, 128, 64, 4, 3, False, True))
    # (label, batch, seqlen, nheads, headdim, ngroups, dstate, chunk, all options, states in x's dtype, TUNING)
    cases = (("bench", 2, 512, 64, 128, 1, 128, 256, True, True, {}),
             ("bench_other_paths", 2, 512, 64, 128, 1, 128, 256, True, False, other_paths),
             ("odd", 1, 37, 4, 24, 2, 40, 16, False, False, {}))
    for dtype in T.FLOAT_DTYPES:
        for label, batch, seqlen, nheads, P, ngroups, N, K, full, lp_states, tuning in cases:
            nchunks = -(-seqlen // K)

            def spec(shape, dt=dtype):
                return T.SpecTensor(shape, dt)

            xs, bs = (batch, seqlen, nheads, P), (batch, seqlen, ngroups, N)
            hs = (batch, nheads, P, N)
            f32 = "float32"
            args = [spec(xs), spec(xs), spec(xs[:3]), spec((nheads,), f32), spec(bs), spec(bs),
                    spec((batch, nheads, nchunks, K), f32), spec((batch, nheads, nchunks, K), f32),
                    spec((batch, nchunks, nheads, P, N), dtype if lp_states else f32),
                    spec((batch, nchunks, ngroups, K, K), f32),
                    spec(xs), spec(xs[:3]), spec((nheads,), f32), spec(bs, f32), spec(bs, f32)]
            with _tuned(tuning):
                ws = {name: spec(shape, dt) for name, (shape, dt) in
                      workspace_shapes(batch, seqlen, nheads, P, N, K, full, dtype,
                                       dtype if lp_states else f32).items()}
            opts = {}
            if full:
                opts = dict(D=spec((nheads, P), f32), dD=spec((nheads, P), f32), z=spec(xs), dz=spec(xs),
                            out_x=spec(xs), dt_bias=spec((nheads,), f32), ddt_bias=spec((nheads,), f32),
                            initial_states=spec(hs, f32), dinitial_states=spec(hs, f32),
                            dfinal_states=spec(hs, f32), seq_idx=spec((batch, seqlen), "int32"),
                            dt_softplus=True, dt_limit=(0.001, 0.1))
            yield f"ssd_chunked_bwd[{dtype},{label}]", \
                lambda args=args, opts=opts, ws=ws, K=K, tuning=tuning: _launch_with(tuning, *args, chunk_size=K,
                                                                                    workspace=ws, **opts)
