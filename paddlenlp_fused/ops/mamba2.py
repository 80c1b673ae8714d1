"""Mamba-2 inner path: ``mamba_split_conv1d_scan_combined`` and the multi-head decoding step.

``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
initial_states=None, seq_idx=None, dt_limit=(0.0, inf), return_final_states=False, activation="silu",
rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
norm_before_gate=False, checkpoint_lvl=1)`` (``mamba_ssm``'s semantics, plus ``backend=`` and
``deterministic=``):

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

Two paths compute the same thing:

* the composition (``backend="reference"``, and whenever no gradient is needed): conv, SSD and gated
  norm ops one after another, autograd through each, every intermediate kept for backward;
* one PyLayer (every other backend, when a gradient is needed) over that same composition: its
  forward runs without a graph and keeps only the inputs, its backward recomputes the path under
  autograd and back-propagates through it. ``checkpoint_lvl=0`` also keeps the conv output (and the
  conv's graph), so backward skips the conv's forward; ``1`` (default) recomputes it. Gradients are
  the same at both levels. Each piece runs on ``backend`` (conv and gated norm: Triton; SSD: the
  backend ``mamba_chunk_scan_combined`` takes for it).
* ``deterministic`` (None follows ``FLAGS_cudnn_deterministic``) goes to the conv (weight gradients
  summed in a fixed order) and to the SSD (the reference backend when a gradient is computed: the
  Triton SSD backward uses atomics; so ``backend="triton"`` with it raises).

``mamba2_state_update(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
dt_limit=(0.0, inf))``: one decoding step of the multi-head scan (see its docstring), on the Triton
kernel of ``kernels/triton/state_update.py`` or the pure-Paddle step.
"""

from __future__ import annotations

from typing import NamedTuple

import paddle

from ..kernels.triton.state_update import selective_state_update as state_update_launch
from ..reference.ssd import NO_DT_LIMIT, process_dt, selective_state_update_multihead_ref
from ..runtime.backend import resolve_backend
from ..runtime.determinism import deterministic_requested
from ..runtime.triton_paddle import triton_args, triton_scoped
from ._checks import check_eps, check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer, add, check_shape, empty_on, grads_for, mm, needs_grad, run_in_place
from .causal_conv1d import causal_conv1d_fn
from .norm import rmsnorm_gated_fn
from .ssd import choose_backend as ssd_backend
from .ssd import mamba_chunk_scan_combined

IMPLEMENTED = ("triton", "reference")

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


class _Options(NamedTuple):
    """The non-tensor arguments of one call."""
    dim: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    chunk_size: int
    dt_limit: tuple
    activation: object
    rmsnorm_eps: float
    norm_before_gate: bool
    return_final_states: bool
    checkpoint_lvl: int
    backend: str
    deterministic: bool


def _split_zxbcdt(zxbcdt, o):
    gdim = o.ngroups * o.dstate
    return paddle.split(zxbcdt, [o.dim, o.dim + 2 * gdim, o.nheads], axis=-1)  # z, xBC, dt


def _conv(xBC, conv1d_weight, conv1d_bias, seq_idx, o):
    """The depthwise causal conv + activation on xBC ``[batch, seqlen, conv_dim]``."""
    return causal_conv1d_fn(xBC.transpose([0, 2, 1]), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                            activation=o.activation, backend=o.backend,
                            deterministic=o.deterministic).transpose([0, 2, 1])


def _after_conv(xBC, z, dt, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight, outproj_bias, seq_idx,
                o):
    """Scan, gate / gated norm and output projection from the conv output; returns (out, final_states)."""
    batch, seqlen, _ = xBC.shape
    gdim = o.ngroups * o.dstate
    x, B, C = paddle.split(xBC, [o.dim, gdim, gdim], axis=-1)
    z4 = z.reshape([batch, seqlen, o.nheads, o.headdim])
    scan = mamba_chunk_scan_combined(
        x.reshape([batch, seqlen, o.nheads, o.headdim]), dt, A, B.reshape([batch, seqlen, o.ngroups, o.dstate]),
        C.reshape([batch, seqlen, o.ngroups, o.dstate]), o.chunk_size, D=D,
        z=None if rmsnorm_weight is not None else z4, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=True, dt_limit=o.dt_limit, return_final_states=o.return_final_states,
        backend=o.backend, deterministic=o.deterministic)
    y, final_states = scan if o.return_final_states else (scan, None)
    y = y.reshape([batch, seqlen, o.dim])
    if rmsnorm_weight is not None:
        y = rmsnorm_gated_fn(y, rmsnorm_weight, z, o.rmsnorm_eps, group_size=o.dim // o.ngroups,
                             norm_before_gate=o.norm_before_gate, backend=o.backend)
    if outproj_weight is not None:
        y = mm(y, outproj_weight.astype(y.dtype))
        if outproj_bias is not None:
            y = add(y, outproj_bias)
    return y, final_states


def _composition(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
                 outproj_bias, seq_idx, o):
    z, xBC, dt = _split_zxbcdt(zxbcdt, o)
    return _after_conv(_conv(xBC, conv1d_weight, conv1d_bias, seq_idx, o), z, dt, dt_bias, A, D, initial_states,
                       rmsnorm_weight, outproj_weight, outproj_bias, seq_idx, o)


def _leaves(tensors):
    """Detached copies that collect gradients (None stays None)."""
    leaves = []
    for t in tensors:
        leaf = None if t is None else t.detach()
        if leaf is not None:
            leaf.stop_gradient = False
        leaves.append(leaf)
    return leaves


class _SplitConv1dScanCombinedFunction(TritonPyLayer):
    """The whole path in one PyLayer: forward without a graph, backward by recomputation (the
    conv's output and graph kept from forward at ``checkpoint_lvl`` 0)."""
    op = "mamba_split_conv1d_scan_combined"

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
                outproj_weight, outproj_bias, seq_idx, o):
        inputs = [zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
                  outproj_weight, outproj_bias]
        ctx.o, ctx.seq_idx = o, seq_idx
        ctx.needs_grad = needs_grad(*inputs, seq_idx)
        if o.checkpoint_lvl == 0:
            with paddle.enable_grad():  # keep the conv's graph: backward starts from its output
                leaves = _leaves(inputs)
                z, xBC, dt = _split_zxbcdt(leaves[0], o)
                conv_out = _conv(xBC, leaves[1], leaves[2], seq_idx, o)
            ctx.leaves, ctx.conv_out = leaves, conv_out
            with paddle.no_grad():
                out, final_states = _after_conv(conv_out.detach(), z.detach(), dt.detach(), *inputs[3:], seq_idx, o)
        else:
            ctx.inputs = inputs
            with paddle.no_grad():
                out, final_states = _composition(*inputs, seq_idx, o)
        return (out, final_states) if o.return_final_states else out

    @staticmethod
    def backward(ctx, dout, dfinal_states=None):
        o = ctx.o
        with paddle.enable_grad():
            if o.checkpoint_lvl == 0:
                leaves = ctx.leaves
                conv_out = ctx.conv_out.detach()
                conv_out.stop_gradient = False
                z, _, dt = _split_zxbcdt(leaves[0], o)
            else:
                leaves = _leaves(ctx.inputs)
                z, xBC, dt = _split_zxbcdt(leaves[0], o)
                conv_out = _conv(xBC, leaves[1], leaves[2], ctx.seq_idx, o)
            out, final_states = _after_conv(conv_out, z, dt, *leaves[3:], ctx.seq_idx, o)
            outputs, grads = [out], [dout]
            if final_states is not None and dfinal_states is not None:
                outputs.append(final_states)
                grads.append(dfinal_states)
            paddle.autograd.backward(outputs, grads)
            if o.checkpoint_lvl == 0:
                paddle.autograd.backward([ctx.conv_out], [conv_out.grad])
                del ctx.leaves, ctx.conv_out
        grads = [leaf.grad if leaf.grad is not None else paddle.zeros_like(leaf) for leaf in leaves if leaf is not None]
        if ctx.seq_idx is not None:
            grads.append(None)
        return grads_for(ctx, grads)


@triton_scoped
def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=False, checkpoint_lvl: int = 1,
                                     backend: str = "auto", deterministic=None):
    """The Mamba-2 inner path (see the module docstring for shapes, results and the two paths)."""
    deterministic = deterministic_requested(deterministic)
    dim, nheads, headdim, dstate = _split_sizes(zxbcdt, conv1d_weight, A, D, headdim, ngroups)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    if isinstance(checkpoint_lvl, bool) or checkpoint_lvl not in (0, 1):
        raise ValueError(f"checkpoint_lvl: expected 0 (keep the conv output) or 1 (recompute it), "
                         f"got {checkpoint_lvl!r}")
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
    o = _Options(dim, nheads, headdim, dstate, ngroups, int(chunk_size), tuple(float(v) for v in dt_limit),
                 activation, check_eps("rmsnorm_eps", rmsnorm_eps), bool(norm_before_gate),
                 bool(return_final_states), int(checkpoint_lvl), backend, deterministic)
    tensors = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
               outproj_bias)
    chosen = resolve_backend("mamba_split_conv1d_scan_combined", backend, device_of(zxbcdt),
                             implemented=IMPLEMENTED)
    wants_grad = paddle.is_grad_enabled() and any(t is not None and not t.stop_gradient for t in tensors)
    if deterministic and wants_grad:  # the SSD's backend now: the PyLayer meets it only in its backward
        ssd_backend(backend, zxbcdt, chunk_size, deterministic=True)
    if chosen == "reference" or not wants_grad:
        out, final_states = _composition(*tensors, seq_idx, o)
        return (out, final_states) if return_final_states else out
    return _SplitConv1dScanCombinedFunction.apply(*tensors, seq_idx, o)


@triton_scoped
def mamba2_state_update(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                        dt_limit=NO_DT_LIMIT, backend: str = "auto"):
    """One decoding step, no autograd. ssm_state ``[batch, nheads, headdim, dstate]`` updated in
    place; x, z ``[batch, nheads, headdim]``; dt ``[batch, nheads]``; A, dt_bias ``[nheads]``; B, C
    ``[batch, ngroups, dstate]``; D ``[nheads]`` or ``[nheads, headdim]``. ``dt_limit`` clips dt as in
    the full scan (so prefill and decoding agree). Returns y ``[batch, nheads, headdim]`` in x's dtype.
    Backends: ``triton`` (``kernels/triton/state_update.py``) and ``reference`` (pure Paddle)."""
    check_tensor("ssm_state", ssm_state)
    if ssm_state.ndim != 4:
        raise ValueError(f"ssm_state: expected [batch, nheads, headdim, dstate], got {list(ssm_state.shape)}")
    batch, nheads, headdim, dstate = ssm_state.shape
    for name, t, shape in (("x", x, [batch, nheads, headdim]), ("dt", dt, [batch, nheads]), ("A", A, [nheads]),
                           ("z", z, [batch, nheads, headdim]), ("dt_bias", dt_bias, [nheads])):
        if t is not None or name in ("x", "dt", "A"):
            check_tensor(name, t)
            check_shape(name, t, shape)
    for name, t in (("B", B), ("C", C)):
        check_tensor(name, t)
        if t.ndim != 3 or t.shape[0] != batch or t.shape[2] != dstate or nheads % t.shape[1]:
            raise ValueError(f"{name}: expected [batch={batch}, ngroups dividing nheads={nheads}, dstate={dstate}], "
                             f"got {list(t.shape)}")
    if list(B.shape) != list(C.shape):
        raise ValueError(f"C: expected B's shape {list(B.shape)}, got {list(C.shape)}")
    if D is not None:
        check_tensor("D", D)
        if list(D.shape) not in ([nheads], [nheads, headdim]):
            raise ValueError(f"D: expected [nheads={nheads}] or [nheads, headdim={headdim}], got {list(D.shape)}")
    lo, hi = (float(v) for v in dt_limit)
    chosen = resolve_backend("mamba2_state_update", backend, device_of(x), implemented=IMPLEMENTED)
    with paddle.no_grad():
        if chosen == "reference" or x.size == 0:
            dt = process_dt(dt, dt_bias, dt_softplus, (lo, hi), "float32")
            return selective_state_update_multihead_ref(ssm_state, x, dt, A, B, C, D=D, z=z)
        x, dt, A, B, C, D, z, dt_bias = (contiguous(t) for t in (x, dt, A, B, C, D, z, dt_bias))
        out = empty_on(x.shape, x.dtype, x)
        run_in_place(ssm_state, lambda st: state_update_launch(
            *triton_args(st, x, dt, A, B, C, out, D, z, dt_bias), dt_softplus=bool(dt_softplus), dt_limit=(lo, hi)))
        return out


__all__ = ["mamba_split_conv1d_scan_combined", "mamba2_state_update"]
