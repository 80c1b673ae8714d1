"""float64 numpy selective scan (Mamba-1) with a hand-written adjoint: the GPU tests' reference for real
and complex A (mamba_ssm's conventions).

u, delta, z, dout [batch, dim, seqlen]; A [dim, dstate] (real, or complex); D, delta_bias [dim]; B and C
fixed [dim, dstate] or input-dependent [batch, (groups,) dstate, seqlen], for complex A real (re, im)
pairs [batch, (groups,) dstate, 2 * seqlen]. h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t and
y_t = w Re(sum_n C_t h_t) + D u_t, with w = 2 for complex A (the conjugate half) and 1 for real A. The
adjoint g_t = dL/dh_t = w dy_t conj(C_t) + conj(exp(dt_{t+1} A)) g_{t+1}; a real input x gets
Re(conj(g_t) dh_t/dx). Gradients of complex tensors are dL/dre + i dL/dim.
"""

import numpy as np

from .numerics import dsilu, silu


def pairs_to_complex(P):
    return P[..., 0::2] + 1j * P[..., 1::2]


def complex_to_pairs(M):
    P = np.empty(M.shape[:-1] + (2 * M.shape[-1],))
    P[..., 0::2], P[..., 1::2] = M.real, M.imag
    return P


def _bc_per_dim(M, dim, is_complex):
    """B or C as a function t -> [batch or 1, dim, dstate] (complex for complex A), and how to fold a
    per-dim gradient [batch, dim, dstate, seqlen] back to M's shape and kind."""
    if M.ndim == 2:
        return (lambda t: M[None]), (lambda g: g.sum(axis=(0, 3)))
    Mv = pairs_to_complex(M) if is_complex else M
    groups = 1 if M.ndim == 3 else M.shape[1]
    M4 = Mv[:, None] if M.ndim == 3 else Mv
    index = np.arange(dim) // (dim // groups)

    def fold(g):
        out = np.zeros(M4.shape, complex if is_complex else float)
        np.add.at(out, (slice(None), index), g)
        out = out[:, 0] if M.ndim == 3 else out
        return complex_to_pairs(out) if is_complex else out
    return (lambda t: M4[..., t][:, index]), fold


def selective_scan_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, softplus=False, dout=None):
    """(out, last state) and, with dout, also the gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)
    and, for those that sum one term per token (dA, fixed dB/dC, dD, ddelta_bias), the sum of their
    terms' magnitudes."""
    batch, dim, seqlen = u.shape
    is_complex = np.iscomplexobj(A)
    w = 2 if is_complex else 1
    raw = delta + (delta_bias[:, None] if delta_bias is not None else 0)
    dt = np.where(raw > 20, raw, np.log1p(np.exp(np.minimum(raw, 20)))) if softplus else raw
    B_at, fold_B = _bc_per_dim(B, dim, is_complex)
    C_at, fold_C = _bc_per_dim(C, dim, is_complex)
    state_type = complex if is_complex else float
    hs = np.zeros((seqlen, batch, dim, A.shape[1]), state_type)
    h = np.zeros((batch, dim, A.shape[1]), state_type)
    y = np.zeros((batch, dim, seqlen))
    for t in range(seqlen):
        h = np.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[:, :, None] * B_at(t)
        hs[t] = h
        y[:, :, t] = w * (h * C_at(t)).sum(-1).real
    if D is not None:
        y = y + D[:, None] * u
    out = y * silu(z) if z is not None else y
    if dout is None:
        return out, h
    dy = dout * silu(z) if z is not None else dout
    dz = dout * y * dsilu(z) if z is not None else None
    du = dy * D[:, None] if D is not None else np.zeros_like(u)
    ddt = np.zeros_like(u)
    dA = np.zeros_like(A)
    dA_terms = np.zeros(A.shape)
    dB_full = np.zeros((batch, dim, A.shape[1], seqlen), state_type)
    dC_full = np.zeros_like(dB_full)
    g = np.zeros_like(h)
    for t in reversed(range(seqlen)):
        if t + 1 < seqlen:
            g = g * np.conj(np.exp(dt[:, :, t + 1, None] * A))
        g = g + w * dy[:, :, t, None] * np.conj(C_at(t))
        decayed_prev = np.exp(dt[:, :, t, None] * A) * (hs[t - 1] if t > 0 else 0)
        du[:, :, t] += dt[:, :, t] * (np.conj(g) * B_at(t)).real.sum(-1)
        ddt[:, :, t] = (np.conj(g) * (B_at(t) * u[:, :, t, None] + A * decayed_prev)).real.sum(-1)
        dA_term = dt[:, :, t, None] * g * np.conj(decayed_prev)
        dA += dA_term.sum(0)
        dA_terms += np.abs(dA_term).sum(0)
        dB_full[..., t] = g * (dt[:, :, t] * u[:, :, t])[:, :, None]
        dC_full[..., t] = w * dy[:, :, t, None] * np.conj(hs[t])
    ddelta = ddt * (1 / (1 + np.exp(-raw))) * (raw <= 20) + ddt * (raw > 20) if softplus else ddt
    grads = dict(du=du, ddelta=ddelta, dA=dA, dB=fold_B(dB_full), dC=fold_C(dC_full))
    grads["dD"] = (dy * u).sum(axis=(0, 2)) if D is not None else None
    grads["dz"] = dz
    grads["ddelta_bias"] = ddelta.sum(axis=(0, 2)) if delta_bias is not None else None
    term_sums = dict(dA=dA_terms, dD=np.abs(dy * u).sum(axis=(0, 2)), ddelta_bias=np.abs(ddelta).sum(axis=(0, 2)))
    for name, M, full in (("dB", B, dB_full), ("dC", C, dC_full)):
        if M.ndim == 2:
            term_sums[name] = np.abs(full).sum(axis=(0, 3))
    return out, h, grads, term_sums
