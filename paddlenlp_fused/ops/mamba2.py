"""Mamba-2 inner path: ``mamba_split_conv1d_scan_combined`` and the multi-head decoding step.

``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
initial_states=None, seq_idx=None, dt_limit=(0.0, inf), return_final_states=False, activation="silu",
rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
norm_before_gate=False)`` (``mamba_ssm``'s semantics, plus ``backend=``):

* zxbcdt ``[batch, seqlen, 2 * dim + 2 * ngroups * dstate + nheads]`` split as ``z [dim]``,
  ``xBC [dim + 2 * ngroups * dstate]``, ``dt [nheads]`` with ``dim = nheads * headdim``;
* xBC goes through the depthwise causal conv (conv1d_weight ``[conv_dim, width]`` or Conv1D's
  ``[conv_dim, 1, width]``, conv1d_bias ``[conv_dim]``) and the activation, then splits into
  x ``[dim]``, B, C ``[ngroups * dstate]``;
* the SSD scan with ``dt = clip(softplus(dt + dt_bias), *dt_limit)``, A, dt_bias ``[nheads]``, D
  ``[nheads]`` (then ``headdim`` is required) or ``[nheads, headdim]``, initial_states
  ``[batch, nheads, headdim, dstate]``, ``seq_idx`` ``[batch, seqlen]`` (restarts conv and scan);
* the gate: ``y * silu(z)`` without ``rmsnorm_weight``; with it the gated RMSNorm over groups of
  ``dim / ngroups`` columns (``norm_before_gate`` as in ``mamba_ssm``'s ``RMSNormGated``);
* the output projection with Paddle's ``[in, out]`` layout: ``outproj_weight [dim, d_out]``,
  ``outproj_bias [d_out]``.

Returns out ``[batch, seqlen, d_out or dim]`` in zxbcdt's dtype, and with ``return_final_states``
also the final SSM state ``[batch, nheads, headdim, dstate]`` (float32).

The composition runs each op on its own backend (conv and gated norm: Triton or reference; SSD:
reference until its Triton kernels land); autograd flows through every piece. The single-PyLayer
version that recomputes the conv in backward (``checkpoint_lvl``) is not written yet.

``mamba2_state_update(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
dt_limit=(0.0, inf))``: one decoding step of the multi-head scan (see its docstring).
"""

from __future__ import annotations

import paddle

from ..reference.ssd import NO_DT_LIMIT, process_dt, selective_state_update_multihead_ref
from ._checks import check_tensor
from .causal_conv1d import causal_conv1d_fn
from .norm import rmsnorm_gated_fn
from .ssd import mamba_chunk_scan_combined

_ACTIVATIONS = (None, "silu", "swish")


def _split_sizes(zxbcdt, conv1d_weight, A, D, headdim, ngroups):
    """(dim, nheads, headdim, dstate) from the shapes, checking them; raises naming the argument."""
    check_tensor("zxbcdt", zxbcdt)
    if zxbcdt.ndim != 3:
        raise ValueError(f"zxbcdt: expected [batch, seqlen, d_in_proj], got shape {list(zxbcdt.shape)}")
    check_tensor("A", A)
    if A.ndim != 1:
        raise ValueError(f"A: expected [nheads], got shape {list(A.shape)}")
    nheads = A.shape[0]
    check_tensor("D", D)
    if D.ndim == 1:
        if headdim is None:
            raise ValueError("headdim: required when D has shape [nheads]")
        if D.shape[0] != nheads:
            raise ValueError(f"D: expected [nheads={nheads}] or [nheads, headdim], got {list(D.shape)}")
    elif D.ndim == 2 and D.shape[0] == nheads and (headdim is None or D.shape[1] == headdim):
        headdim = D.shape[1]
    else:
        raise ValueError(f"D: expected [nheads={nheads}] or [nheads, headdim={headdim}], got {list(D.shape)}")
    if isinstance(ngroups, bool) or not isinstance(ngroups, int) or ngroups < 1 or nheads % ngroups:
        raise ValueError(f"ngroups: expected a positive int dividing nheads={nheads}, got {ngroups!r}")
    dim = nheads * int(headdim)
    check_tensor("conv1d_weight", conv1d_weight)
    conv_dim = conv1d_weight.shape[0]
    if conv_dim <= dim or (conv_dim - dim) % (2 * ngroups):
        raise ValueError(f"conv1d_weight: expected [dim + 2 * ngroups * dstate, (1,) width] with dim={dim}, "
                         f"ngroups={ngroups}, got {list(conv1d_weight.shape)}")
    dstate = (conv_dim - dim) // (2 * ngroups)
    expected = 2 * dim + 2 * ngroups * dstate + nheads
    if zxbcdt.shape[-1] != expected:
        raise ValueError(f"zxbcdt: expected last axis 2 * dim + 2 * ngroups * dstate + nheads = {expected} "
                         f"(dim={dim}, ngroups={ngroups}, dstate={dstate}, nheads={nheads}), "
                         f"got {zxbcdt.shape[-1]}")
    return dim, nheads, int(headdim), dstate


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=False, backend: str = "auto"):
    """The Mamba-2 inner path (see the module docstring for shapes and results)."""
    dim, nheads, headdim, dstate = _split_sizes(zxbcdt, conv1d_weight, A, D, headdim, ngroups)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    if rmsnorm_weight is not None:
        check_tensor("rmsnorm_weight", rmsnorm_weight)
        if list(rmsnorm_weight.shape) != [dim]:
            raise ValueError(f"rmsnorm_weight: expected [dim={dim}], got {list(rmsnorm_weight.shape)}")
    if outproj_weight is not None:
        check_tensor("outproj_weight", outproj_weight)
        if outproj_weight.ndim != 2 or outproj_weight.shape[0] != dim:
            raise ValueError(f"outproj_weight: expected Paddle's [in=dim={dim}, out] layout, "
                             f"got {list(outproj_weight.shape)}")
    if outproj_bias is not None:
        if outproj_weight is None:
            raise ValueError("outproj_bias: given without outproj_weight")
        check_tensor("outproj_bias", outproj_bias)
        if list(outproj_bias.shape) != [outproj_weight.shape[1]]:
            raise ValueError(f"outproj_bias: expected [{outproj_weight.shape[1]}], got {list(outproj_bias.shape)}")
    batch, seqlen, _ = zxbcdt.shape
    gdim = ngroups * dstate
    z, xBC, dt = paddle.split(zxbcdt, [dim, dim + 2 * gdim, nheads], axis=-1)
    xBC = causal_conv1d_fn(xBC.transpose([0, 2, 1]), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation, backend=backend).transpose([0, 2, 1])
    x, B, C = paddle.split(xBC, [dim, gdim, gdim], axis=-1)
    z4 = z.reshape([batch, seqlen, nheads, headdim])
    scan = mamba_chunk_scan_combined(
        x.reshape([batch, seqlen, nheads, headdim]), dt, A, B.reshape([batch, seqlen, ngroups, dstate]),
        C.reshape([batch, seqlen, ngroups, dstate]), chunk_size, D=D, z=None if rmsnorm_weight is not None else z4,
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states, backend=backend)
    y, final_states = scan if return_final_states else (scan, None)
    y = y.reshape([batch, seqlen, dim])
    if rmsnorm_weight is not None:
        y = rmsnorm_gated_fn(y, rmsnorm_weight, z, rmsnorm_eps, group_size=dim // ngroups,
                             norm_before_gate=norm_before_gate, backend=backend)
    if outproj_weight is not None:
        y = paddle.matmul(y, outproj_weight.astype(y.dtype))
        if outproj_bias is not None:
            y = y + outproj_bias.astype(y.dtype)
    return (y, final_states) if return_final_states else y


def mamba2_state_update(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                        dt_limit=NO_DT_LIMIT):
    """One decoding step, no autograd. ssm_state ``[batch, nheads, headdim, dstate]`` updated in
    place; x, z ``[batch, nheads, headdim]``; dt ``[batch, nheads]``; A, dt_bias ``[nheads]``; B, C
    ``[batch, ngroups, dstate]``; D ``[nheads]`` or ``[nheads, headdim]``. ``dt_limit`` clips dt as in
    the full scan (so prefill and decoding agree). Returns y ``[batch, nheads, headdim]`` in x's dtype.
    Runs the pure-Paddle step (a Triton multi-head step is not written yet)."""
    check_tensor("ssm_state", ssm_state)
    if ssm_state.ndim != 4:
        raise ValueError(f"ssm_state: expected [batch, nheads, headdim, dstate], got {list(ssm_state.shape)}")
    batch, nheads, headdim, dstate = ssm_state.shape
    check_tensor("x", x)
    if list(x.shape) != [batch, nheads, headdim]:
        raise ValueError(f"x: expected [batch, nheads, headdim] = {[batch, nheads, headdim]}, got {list(x.shape)}")
    check_tensor("dt", dt)
    if list(dt.shape) != [batch, nheads]:
        raise ValueError(f"dt: expected [batch, nheads] = {[batch, nheads]}, got {list(dt.shape)}")
    for name, t in (("B", B), ("C", C)):
        check_tensor(name, t)
        if t.ndim != 3 or t.shape[0] != batch or t.shape[2] != dstate or nheads % t.shape[1]:
            raise ValueError(f"{name}: expected [batch={batch}, ngroups dividing nheads={nheads}, dstate={dstate}], "
                             f"got {list(t.shape)}")
    lo, hi = (float(v) for v in dt_limit)
    with paddle.no_grad():
        dt = process_dt(dt, dt_bias, dt_softplus, (lo, hi), "float32")
        return selective_state_update_multihead_ref(ssm_state, x, dt, A, B, C, D=D, z=z)


__all__ = ["mamba_split_conv1d_scan_combined", "mamba2_state_update"]
