"""One decoding step of the selective scan, Mamba-1 and Mamba-2 (multi-head) alike.

Layouts (``b`` batch, ``h`` nheads, ``p`` headdim, ``n`` dstate, ``g`` groups, ``d`` dim):

    Mamba-1                                 Mamba-2
    state  [b, d, n]   (in place)           state  [b, h, p, n]   (in place)
    x, z, out [b, d]                        x, z, out [b, h, p]
    dt     [b, d]                           dt     [b, h]  (with A [h])  or [b, h, p] (with A [h, p, n])
    A      [d, n]                           A      [h]  (tied over p, n)  or [h, p, n]
    dt_bias, D [d]                          dt_bias [h] (or [h, p] untied); D [h] or [h, p]
    B, C   [b, n] or [b, g, n]              B, C   [b, g, n], g dividing h

Mamba-1 is the multi-head step with one head of ``d`` channels, so one kernel serves both. Channel
``c = head * p + row`` reads group ``c // (h * p / g)``: in Mamba-2 that is ``head // (h / g)``.

Per (b, channel, n), in fp32:
    dt = clip(softplus?(dt + dt_bias), dt_min, dt_max)
    state = exp(dt A) state + dt x B;   out = sum_n C state + D x;   out *= silu(z) when z is given.

Grid: (row blocks of ``BLOCK_P``, heads, batch). With A tied over the head (Mamba-2) dt and the
decay are one scalar per program and B, C one row of ``dstate``; untied (Mamba-1) they are per row.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ...runtime import tensor as T

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dt_transform(dt, DT_SOFTPLUS: tl.constexpr, DT_CLIP: tl.constexpr, dt_min, dt_max):
    if DT_SOFTPLUS:  # linear above 20, as torch / paddle softplus
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if DT_CLIP:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def _state_update_kernel(
        state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr,
        headdim, dstate, channels_per_group, dt_min, dt_max,
        s_st_b, s_st_h, s_st_p, s_st_n, s_x_b, s_x_h, s_x_p, s_dt_b, s_dt_h, s_dt_p,
        s_A_h, s_A_p, s_A_n, s_B_b, s_B_g, s_B_n, s_C_b, s_C_g, s_C_n, s_D_h, s_D_p,
        s_z_b, s_z_h, s_z_p, s_db_h, s_db_p, s_o_b, s_o_h, s_o_p,
        TIE_HDIM: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
        DT_SOFTPLUS: tl.constexpr, DT_CLIP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        state_indices_ptr=None, HAS_STATE_INDICES: tl.constexpr = False):
    head = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    h64 = head.to(tl.int64)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p64 = p.to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    mask_p = p < headdim
    mask_n = n < dstate
    mask = mask_p[:, None] & mask_n[None, :]

    if HAS_STATE_INDICES:  # row b's state is state[state_batch_indices[b]]; a negative index is a padding
        # row: its state is neither read nor written and its output is 0
        slot = tl.load(state_indices_ptr + b64).to(tl.int64)
        st_ptrs = state_ptr + tl.maximum(slot, 0) * s_st_b + h64 * s_st_h + p64[:, None] * s_st_p + n[None, :] * s_st_n
        live = slot >= 0
        mask_st = mask & live
    else:
        st_ptrs = state_ptr + b64 * s_st_b + h64 * s_st_h + p64[:, None] * s_st_p + n[None, :] * s_st_n
        mask_st = mask
    state = tl.load(st_ptrs, mask=mask_st, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b64 * s_x_b + h64 * s_x_h + p64 * s_x_p, mask=mask_p, other=0.0).to(tl.float32)
    if TIE_HDIM:  # Mamba-2: one dt and one A per head, the whole head in one group
        dt = tl.load(dt_ptr + b64 * s_dt_b + h64 * s_dt_h).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + h64 * s_db_h).to(tl.float32)
        dt = _dt_transform(dt, DT_SOFTPLUS, DT_CLIP, dt_min, dt_max)
        decay = tl.exp2(dt * tl.load(A_ptr + h64 * s_A_h).to(tl.float32) * _LOG2E)
        group = (h64 * headdim) // channels_per_group
        Bv = tl.load(B_ptr + b64 * s_B_b + group * s_B_g + n * s_B_n, mask=mask_n, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + b64 * s_C_b + group * s_C_g + n * s_C_n, mask=mask_n, other=0.0).to(tl.float32)
        state = state * decay + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], axis=1)
    else:  # Mamba-1 (or untied Mamba-2): dt per row, A per (row, n), rows of a block may span groups
        dt = tl.load(dt_ptr + b64 * s_dt_b + h64 * s_dt_h + p64 * s_dt_p, mask=mask_p, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + h64 * s_db_h + p64 * s_db_p, mask=mask_p, other=0.0).to(tl.float32)
        dt = _dt_transform(dt, DT_SOFTPLUS, DT_CLIP, dt_min, dt_max)
        A = tl.load(A_ptr + h64 * s_A_h + p64[:, None] * s_A_p + n[None, :] * s_A_n, mask=mask,
                    other=0.0).to(tl.float32)
        group = ((h64 * headdim + p64) // channels_per_group)[:, None]
        Bv = tl.load(B_ptr + b64 * s_B_b + group * s_B_g + n[None, :] * s_B_n, mask=mask, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + b64 * s_C_b + group * s_C_g + n[None, :] * s_C_n, mask=mask, other=0.0).to(tl.float32)
        state = state * tl.exp2(dt[:, None] * A * _LOG2E) + (dt * x)[:, None] * Bv
        y = tl.sum(state * Cv, axis=1)
    tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_st)
    if HAS_D:
        y += tl.load(D_ptr + h64 * s_D_h + p64 * s_D_p, mask=mask_p, other=0.0).to(tl.float32) * x
    if HAS_Z:
        zv = tl.load(z_ptr + b64 * s_z_b + h64 * s_z_h + p64 * s_z_p, mask=mask_p, other=0.0).to(tl.float32)
        y = y * zv * tl.sigmoid(zv)
    if HAS_STATE_INDICES:
        y = tl.where(live, y, 0.0)
    tl.store(out_ptr + b64 * s_o_b + h64 * s_o_h + p64 * s_o_p, y.to(out_ptr.dtype.element_ty), mask=mask_p)


# ----------------------------------------------------------------------------------------------
# launcher


def _heads_view(name, t, lead, nheads, headdim, per_row):
    """Strides (lead..., head, row) of ``t``: shape ``lead + [h, p]`` (or ``lead + [h]`` when not
    ``per_row``) in the multi-head layout; ``lead + [d]`` in Mamba-1's (nheads None: head stride 0)."""
    if t is None:
        return (0,) * (len(lead) + 2)
    st = T.strides(t)
    if nheads is None:  # Mamba-1: one head of `headdim` channels
        T.check_same_shape(name, t, tuple(lead) + (headdim,))
        return st[:-1] + (0, st[-1])
    if per_row:
        T.check_same_shape(name, t, tuple(lead) + (nheads, headdim))
        return st
    T.check_same_shape(name, t, tuple(lead) + (nheads,))
    return st + (0,)


def _D_view(D, nheads, headdim):
    """D [h] or [h, p] (multi-head), [d] (Mamba-1) -> strides (head, row)."""
    if D is None:
        return 0, 0
    dims, st = T.shape(D), T.strides(D)
    if nheads is None:
        T.check_same_shape("D", D, (headdim,))
        return 0, st[0]
    if dims == (nheads,):
        return st[0], 0
    T.check_same_shape("D", D, (nheads, headdim))
    return st


def _bc_view(name, t, batch, nheads, dstate):
    """(groups, strides (b, g, n)) of B or C: [b, n] (one group) or [b, g, n] with g dividing the
    head count (Mamba-1: the dim)."""
    dims, st = T.shape(t), T.strides(t)
    if len(dims) == 2:
        T.check_same_shape(name, t, (batch, dstate))
        return 1, (st[0], 0, st[1])
    if len(dims) == 3 and dims[0] == batch and dims[2] == dstate and dims[1] >= 1 and nheads % dims[1] == 0:
        return dims[1], st
    raise ValueError(f"{name}: expected [batch={batch}, dstate={dstate}] or [batch, groups dividing {nheads}, "
                     f"dstate], got shape {dims}")


def _default_blocks(headdim, dstate):
    """(BLOCK_P, num_warps): about 2048 state elements a program (16 fp32 a thread at 4 warps)."""
    block_n = triton.next_power_of_2(dstate)
    block_p = max(1, min(triton.next_power_of_2(headdim), 2048 // block_n))
    return block_p, 4


def selective_state_update(state, x, dt, A, B, C, out, D=None, z=None, dt_bias=None, dt_softplus: bool = False,
                           dt_limit=(0.0, math.inf), block_p=None, num_warps=None, state_batch_indices=None) -> None:
    """One decoding step; ``state`` is updated in place (any float dtype; fp32 math) and ``out``
    written. Mamba-1 when state is [b, d, n], multi-head when [b, h, p, n] (module docstring). With
    ``state_batch_indices`` [b] (int32/int64) state holds any number of slots and row b uses slot
    ``state_batch_indices[b]`` (indices < slots: the caller's check); a negative index is a padding row
    (output 0, no state touched)."""
    dims = T.shape(state)
    if state_batch_indices is not None:
        if len(T.shape(state_batch_indices)) != 1:
            raise ValueError(f"state_batch_indices: expected [batch], got shape {T.shape(state_batch_indices)}")
        if T.dtype_name(state_batch_indices) not in ("int32", "int64"):
            raise TypeError(f"state_batch_indices: expected int32 or int64, got {T.dtype_name(state_batch_indices)}")
        T.check_contiguous("state_batch_indices", state_batch_indices)
        if dims:  # the rows are x's; the state's leading axis holds the slots
            dims = (T.shape(state_batch_indices)[0],) + tuple(dims[1:])
    if len(dims) == 3:  # Mamba-1: one head of `dim` channels
        batch, headdim, dstate = dims
        nheads, heads_arg = 1, None
        sst = T.strides(state)
        st_state = (sst[0], 0, sst[1], sst[2])
        T.check_same_shape("A", A, (headdim, dstate))
        tie, sA = False, (0,) + T.strides(A)
        group_units = headdim  # groups divide the channels
    elif len(dims) == 4:
        batch, nheads, headdim, dstate = dims
        heads_arg = nheads
        st_state = T.strides(state)
        tie = len(T.shape(A)) == 1
        if tie:
            T.check_same_shape("A", A, (nheads,))
            sA = (T.strides(A)[0], 0, 0)
        else:
            T.check_same_shape("A", A, (nheads, headdim, dstate))
            sA = T.strides(A)
        group_units = nheads  # groups divide the heads
    else:
        raise ValueError(f"state: expected [batch, dim, dstate] or [batch, nheads, headdim, dstate], got shape {dims}")
    sx = _heads_view("x", x, (batch,), heads_arg, headdim, True)
    so = _heads_view("out", out, (batch,), heads_arg, headdim, True)
    sz = _heads_view("z", z, (batch,), heads_arg, headdim, True)
    sdt = _heads_view("dt", dt, (batch,), heads_arg, headdim, not tie)
    sdb = _heads_view("dt_bias", dt_bias, (), heads_arg, headdim, not tie)
    sD = _D_view(D, heads_arg, headdim)
    gB, sB = _bc_view("B", B, batch, group_units, dstate)
    gC, sC = _bc_view("C", C, batch, group_units, dstate)
    if gB != gC:
        raise ValueError(f"B, C: expected the same number of groups, got {gB} and {gC}")
    lo, hi = (float(v) for v in dt_limit)
    if batch * nheads * headdim == 0:
        return
    default_p, default_warps = _default_blocks(headdim, dstate)
    block_p = block_p or default_p
    grid = (triton.cdiv(headdim, block_p), nheads, batch)
    _state_update_kernel[grid](
        state, x, dt, A, B, C, D, z, dt_bias, out,
        headdim, dstate, nheads * headdim // gB, lo, hi if math.isfinite(hi) else 3.0e38,
        *st_state, *sx, *sdt, *sA, *sB, *sC, *sD, *sz, *sdb, *so,
        TIE_HDIM=tie, HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus), DT_CLIP=lo > 0.0 or math.isfinite(hi),
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(dstate), num_warps=num_warps or default_warps,
        **({} if state_batch_indices is None else
           {"state_indices_ptr": state_batch_indices, "HAS_STATE_INDICES": True}))


def compile_cases():
    """Mamba-1's step (canonical dim 4096, dstate 16, grouped B/C) and Mamba-2's (64 heads of 64,
    dstate 128, one group, D per head, dt_limit) in each dtype; Mamba-2 untied (A [h, p, n]) in bf16."""
    S = T.SpecTensor
    batch, dim, dstate1, nheads, headdim, dstate2 = 8, 4096, 16, 64, 64, 128
    for dtype in T.FLOAT_DTYPES:
        state, x1, B1 = S((batch, dim, dstate1), dtype), S((batch, dim), dtype), S((batch, 4, dstate1), dtype)
        vec, A = S((dim,), "float32"), S((dim, dstate1), "float32")
        yield f"selective_state_update[mamba1,{dtype}]", lambda a=(state, x1, x1, A, B1, B1, x1, vec, x1, vec): \
            selective_state_update(*a, dt_softplus=True)
        state, xh = S((batch, nheads, headdim, dstate2), dtype), S((batch, nheads, headdim), dtype)
        dth, hv, Bh = S((batch, nheads), dtype), S((nheads,), "float32"), S((batch, 1, dstate2), dtype)
        yield f"selective_state_update[mamba2,{dtype}]", lambda a=(state, xh, dth, hv, Bh, Bh, xh, hv, xh, hv): \
            selective_state_update(*a, dt_softplus=True, dt_limit=(0.0, 0.1))
    state, xh = S((batch, nheads, headdim, dstate2), "bfloat16"), S((batch, nheads, headdim), "bfloat16")
    A3, hp, Bh = S((nheads, headdim, dstate2), "float32"), S((nheads, headdim), "float32"), \
        S((batch, 1, dstate2), "bfloat16")
    yield "selective_state_update[mamba2-untied,bfloat16]", \
        lambda a=(state, xh, xh, A3, Bh, Bh, xh, hp, None, hp): selective_state_update(*a, dt_softplus=True)
    slots, x1, B1 = S((3 * batch, dim, dstate1), "bfloat16"), S((batch, dim), "bfloat16"), \
        S((batch, 4, dstate1), "bfloat16")
    vec, A, idx = S((dim,), "float32"), S((dim, dstate1), "float32"), S((batch,), "int32")
    yield "selective_state_update[mamba1,bfloat16,state_batch_indices]", \
        lambda a=(slots, x1, x1, A, B1, B1, x1, vec, x1, vec): selective_state_update(
            *a, dt_softplus=True, state_batch_indices=idx)
