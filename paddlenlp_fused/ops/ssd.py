"""Mamba-2 SSD op: ``mamba_chunk_scan_combined`` (``mamba_ssm``'s signature, plus ``backend=``).

``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, inf),
return_final_states=False, return_varlen_states=False, state_dtype=None, deterministic=None)``:

* x, z ``[batch, seqlen, nheads, headdim]``; dt ``[batch, seqlen, nheads]``; A, dt_bias ``[nheads]``;
  B, C ``[batch, seqlen, ngroups, dstate]`` with ngroups dividing nheads; D ``[nheads]`` or
  ``[nheads, headdim]``; initial_states ``[batch, nheads, headdim, dstate]``.
* ``seq_idx`` ``[batch, seqlen]`` (int): the state restarts wherever it changes value; the initial
  states continue the sequence at position 0.
* ``cu_seqlens`` ``[num_seqs + 1]`` (int, batch 1): the packed sequences' boundaries, 0 first and
  seqlen last, every sequence at least one token; turned into ``seq_idx`` (do not pass both).
* Returns y in x's dtype; with ``return_final_states`` also the state after the last token
  ``[batch, nheads, headdim, dstate]`` (float32); with ``return_varlen_states`` (needs cu_seqlens)
  also each sequence's final state ``[num_seqs, nheads, headdim, dstate]`` (float32). Order:
  ``y``, ``(y, final_states)``, ``(y, varlen_states)`` or ``(y, final_states, varlen_states)``.
* ``state_dtype`` (the option of vLLM's copy of mamba_ssm's kernels; mamba_ssm stores C's dtype): the
  dtype of the chunk-boundary states kept between the forward's stages and for the backward, never of
  the returned states. ``None``: the backend's choice (Triton: x's 16-bit dtype where stages 3+4 run
  fused, float32 otherwise); ``float32``: float32 (the backward's decay term and the varlen states
  then read unrounded states); x's own 16-bit dtype: as ``None`` (float32 where the unfused state
  passing sums the stored states). The reference keeps its states in the compute dtype either way.

Backends: ``reference`` (pure Paddle SSD in float32, differentiable by autograd) and ``triton``
(``kernels/triton/ssd.py``: the chunked forward in five stages inside a PyLayer whose backward runs
``kernels/triton/ssd_backward.py``). The Triton kernels take chunk sizes that are powers of two
(>= 16 on the GPU); ``auto`` falls back to the reference for other sizes. On the Triton backend
final_states are differentiable through the backward kernels; the varlen states, when a gradient can
reach them, come from ``reference.ssd.varlen_states_ref`` (a per-sequence weighted ``x^T B``, Paddle
autograd adding its gradients to the kernels'), else from the forward kernels (``ssd_states_at``).

``deterministic`` (None follows ``FLAGS_cudnn_deterministic``, see ``runtime/determinism.py``): the
Triton backward adds its gradients (dA, dB, dC, dD, ddt, ddt_bias) with fp32 atomics, so a call that
asks for bit-reproducible gradients, and can be differentiated, runs on the reference backend:
``auto`` takes it (warning once on the GPU), an explicit ``backend="triton"`` raises
``BackendUnavailableError``. The reference is pure Paddle autograd in float32: slower, and it keeps
every intermediate for the backward.
"""

from __future__ import annotations

import math

import numpy as np
import paddle

from ..kernels.triton import ssd as K
from ..reference import ssd as ref
from ..runtime import tensor as T
from ..runtime.backend import resolve_backend
from ..runtime.determinism import deterministic_requested
from ..runtime.triton_paddle import triton_args
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer, cast_like, check_shape, empty_on, grads_for, needs_grad, zeros32_on

IMPLEMENTED = ("reference", "triton")
_INT_DTYPES = ("int32", "int64")


def _state_dtype_name(state_dtype, x):
    """``state_dtype`` as a dtype name (None kept): float32, or x's own 16-bit dtype."""
    if state_dtype is None:
        return None
    dtype_class = type(paddle.float32)
    if not isinstance(state_dtype, (str, dtype_class)):
        raise TypeError(f"state_dtype: expected None, a dtype or its name, got {state_dtype!r}")
    name = T.dtype_name(paddle.empty([0], dtype=state_dtype)) if isinstance(state_dtype, dtype_class) else state_dtype
    if name not in ("float32", T.dtype_name(x)) or name not in T.FLOAT_DTYPES:
        raise ValueError(f"state_dtype: expected None, float32 or x's dtype ({T.dtype_name(x)}), got {state_dtype!r}")
    return name


def _check_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
                return_varlen_states):
    check_tensor("x", x)
    if x.ndim != 4:
        raise ValueError(f"x: expected [batch, seqlen, nheads, headdim], got shape {list(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    check_tensor("dt", dt)
    check_shape("dt", dt, [batch, seqlen, nheads], "[batch, seqlen, nheads]")
    check_tensor("A", A)
    check_shape("A", A, [nheads], "[nheads]")
    check_tensor("B", B)
    if B.ndim != 4 or B.shape[:2] != [batch, seqlen] or B.shape[2] < 1 or nheads % B.shape[2] != 0:
        raise ValueError(f"B: expected [batch={batch}, seqlen={seqlen}, ngroups dividing nheads={nheads}, dstate], "
                         f"got {list(B.shape)}")
    check_tensor("C", C)
    check_shape("C", C, B.shape, "B's shape [batch, seqlen, ngroups, dstate]")
    dstate = B.shape[3]
    if D is not None:
        check_tensor("D", D)
        if list(D.shape) not in ([nheads], [nheads, headdim]):
            raise ValueError(f"D: expected [nheads={nheads}] or [nheads, headdim={headdim}], got {list(D.shape)}")
    if z is not None:
        check_tensor("z", z)
        check_shape("z", z, x.shape, "x's shape [batch, seqlen, nheads, headdim]")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias)
        check_shape("dt_bias", dt_bias, [nheads], "[nheads]")
    if initial_states is not None:
        check_tensor("initial_states", initial_states)
        check_shape("initial_states", initial_states, [batch, nheads, headdim, dstate],
                     "[batch, nheads, headdim, dstate]")
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, float_dtypes=_INT_DTYPES)
        check_shape("seq_idx", seq_idx, [batch, seqlen], "[batch, seqlen]")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit: expected a pair (min, max) of floats, got {dt_limit!r}") from None
    if not (0.0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(f"dt_limit: expected 0 <= min <= max, got {dt_limit!r}")
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states: needs cu_seqlens")
    if cu_seqlens is None:
        return None
    check_tensor("cu_seqlens", cu_seqlens, float_dtypes=_INT_DTYPES)
    if seq_idx is not None:
        raise ValueError("cu_seqlens: give either cu_seqlens or seq_idx, not both")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch 1 (x of shape [1, total_tokens, ...]), "
                         f"got batch {batch}")
    bounds = cu_seqlens.numpy().astype(np.int64)
    if bounds.ndim != 1 or bounds.size < 2 or bounds[0] != 0 or bounds[-1] != seqlen or np.any(np.diff(bounds) < 1):
        raise ValueError(f"cu_seqlens: expected increasing offsets from 0 to seqlen={seqlen} (each sequence at least "
                         f"one token), got {bounds.tolist()}")
    return bounds


def cu_seqlens_to_seq_idx(bounds, seqlen):
    """[1, seqlen] int32 sequence number of each token, from the offsets ``bounds`` [num_seqs + 1]."""
    lengths = np.diff(np.asarray(bounds, dtype=np.int64))
    return paddle.to_tensor(np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)[None, :seqlen])


def _triton_unsupported(chunk_size, deterministic=False):
    def why(name):
        if name != "triton":
            return None
        if deterministic:
            return ("deterministic (the Triton SSD backward adds its gradients with fp32 atomics; the reference "
                    "backend is pure Paddle autograd: slower, and it keeps every intermediate)")
        try:
            K.check_chunk_size(int(chunk_size))
        except ValueError as exc:
            return str(exc)
        return None
    return why


def choose_backend(backend, x, chunk_size, deterministic=False):
    """The SSD's backend for one call (``resolve_backend``); ``deterministic``: a backward follows that
    must be bit-reproducible."""
    return resolve_backend("mamba_chunk_scan_combined", backend, device_of(x), implemented=IMPLEMENTED,
                           unsupported=_triton_unsupported(chunk_size, deterministic))


class SSDChunkedFunction(TritonPyLayer):
    """Triton forward (stages of ``kernels/triton/ssd.py``) and backward (``ssd_chunked_bwd``).
    Outputs y, final_states and, with ``positions``, the states after those tokens."""
    op = "mamba_chunk_scan_combined"

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, positions, chunk_size, dt_softplus,
                dt_limit, final_differentiable, state_dtype=None):
        ctx.needs_grad = needs_grad(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, positions)
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = (
            contiguous(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx))
        batch, seqlen, nheads, headdim = x.shape
        shapes = K.buffer_shapes(batch, seqlen, nheads, headdim, B.shape[2], B.shape[3], chunk_size)
        buf = {name: empty_on(shape, "float32", x) for name, shape in shapes.items() if name != "states"}
        # x's dtype where the kernels allow it (half the bytes); fp32 when the varlen states read them or
        # when asked for
        states_dtype = "float32" if positions is not None or state_dtype == "float32" else \
            K.states_dtype(T.dtype_name(x), batch, nheads)
        buf["states"] = empty_on(shapes["states"], states_dtype, x)
        out = empty_on(x.shape, x.dtype, x)
        out_x = empty_on(x.shape, x.dtype, x) if z is not None else None
        args = triton_args(x, dt, A, B, C, out, buf["dt_out"], buf["dA_cumsum"], buf["states"], buf["CB"],
                           buf["final_states"], D, z, out_x, dt_bias, initial_states, seq_idx)
        K.ssd_chunked_fwd(*args[:11], chunk_size=chunk_size, D=args[11], z=args[12], out_x=args[13],
                          dt_bias=args[14], initial_states=args[15], seq_idx=args[16], dt_softplus=dt_softplus,
                          dt_limit=dt_limit)
        results = [out, buf["final_states"]]
        if positions is not None:
            states_at = empty_on([batch, positions.shape[0], nheads, headdim, B.shape[3]], "float32", x)
            a = triton_args(x, dt, A, B, buf["dt_out"], buf["dA_cumsum"], buf["states"], positions, states_at,
                            seq_idx)
            K.ssd_states_at(*a[:9], chunk_size=chunk_size, seq_idx=a[9])
            ctx.mark_non_differentiable(states_at)
            results.append(states_at)
        if not final_differentiable:
            ctx.mark_non_differentiable(buf["final_states"])
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, buf["dt_out"],
                              buf["dA_cumsum"], buf["states"], buf["CB"], out_x)
        ctx.has_positions = positions is not None
        ctx.options = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit)
        return tuple(results)

    @staticmethod
    def backward(ctx, dout, dfinal=None, dstates_at=None):
        from ..kernels.triton.ssd_backward import ssd_chunked_bwd, workspace_shapes

        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_out, dA_cumsum, states, CB, out_x = \
            ctx.saved_tensor()
        dout = contiguous(dout)
        dfinal = contiguous(dfinal) if dfinal is not None else None
        dx, ddt = empty_on(x.shape, x.dtype, x), empty_on(dt.shape, dt.dtype, x)
        dA, dB, dC = zeros32_on(A.shape, x), zeros32_on(B.shape, x), zeros32_on(C.shape, x)
        dD = zeros32_on(D.shape, x) if D is not None else None
        dz = empty_on(z.shape, z.dtype, x) if z is not None else None
        ddt_bias = zeros32_on(dt_bias.shape, x) if dt_bias is not None else None
        dinit = zeros32_on(initial_states.shape, x) if initial_states is not None else None
        names, work = [], []
        for name, (shape, dtype) in workspace_shapes(*x.shape, B.shape[3], ctx.options["chunk_size"], z is not None,
                                                     T.dtype_name(dout), T.dtype_name(states)).items():
            names.append(name)
            work.append(empty_on(shape, dtype, x))
        a = triton_args(dout, x, dt, A, B, C, dt_out, dA_cumsum, states, CB, dx, ddt, dA, dB, dC, D, z, out_x,
                        dt_bias, initial_states, seq_idx, dfinal, dD, dz, ddt_bias, dinit, *work)
        ssd_chunked_bwd(*a[:15], D=a[15], z=a[16], out_x=a[17], dt_bias=a[18], initial_states=a[19],
                        seq_idx=a[20], dfinal_states=a[21], dD=a[22], dz=a[23], ddt_bias=a[24],
                        dinitial_states=a[25], workspace=dict(zip(names, a[26:])), **ctx.options)
        grads = [(dx, x), (ddt, dt), (cast_like(dA, A), A), (cast_like(dB, B), B), (cast_like(dC, C), C),
                 (cast_like(dD, D), D), (dz, z), (cast_like(ddt_bias, dt_bias), dt_bias),
                 (cast_like(dinit, initial_states), initial_states), (None, seq_idx)]
        return grads_for(ctx, [g for g, t in grads if t is not None] + ([None] if ctx.has_positions else []))


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, state_dtype=None,
                              backend: str = "auto", deterministic=None):
    """The Mamba-2 SSD scan (see the module docstring for shapes and results). ``deterministic``: None
    follows ``FLAGS_cudnn_deterministic``; True (with a gradient to compute) takes the reference."""
    bounds = _check_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
                         return_varlen_states)
    state_dtype = _state_dtype_name(state_dtype, x)
    # the forward kernels are deterministic: only a call with a backward to follow needs the reference
    deterministic = deterministic_requested(deterministic) and paddle.is_grad_enabled() and any(
        needs_grad(x, dt, A, B, C, D, z, dt_bias, initial_states))
    chosen = choose_backend(backend, x, chunk_size, deterministic)
    if bounds is not None:
        seq_idx = cu_seqlens_to_seq_idx(bounds, x.shape[1])
    states_at = (bounds[1:] - 1).tolist() if return_varlen_states else None
    dt_limit = tuple(float(v) for v in dt_limit)
    if chosen == "triton" and x.size:  # (no tokens: nothing to launch, the reference returns the empty results)
        runs = None if seq_idx is None else ref.segment_ids(seq_idx, x.shape[0], x.shape[1])
        # varlen states a gradient can reach: a differentiable composition instead of ssd_states_at
        varlen_grad = states_at is not None and paddle.is_grad_enabled() and any(
            t is not None and not t.stop_gradient for t in (x, dt, A, B, dt_bias, initial_states))
        positions = None if states_at is None or varlen_grad else \
            paddle.to_tensor(np.asarray(states_at, np.int64), place=x.place)
        out = SSDChunkedFunction.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, runs, positions,
                                       int(chunk_size), bool(dt_softplus), dt_limit, bool(return_final_states),
                                       state_dtype)
        y, final_states = out[0], out[1]
        if varlen_grad:
            varlen = ref.varlen_states_ref(x, dt, A, B, bounds, dt_bias, initial_states, dt_softplus,
                                           dt_limit).astype("float32")
        else:
            varlen = out[2][0] if states_at is not None else None
    else:
        out = ref.ssd_chunked_ref(x, dt, A, B, C, int(chunk_size), D=D, z=z, dt_bias=dt_bias,
                                  initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                                  dt_limit=dt_limit, states_at=states_at)
        y, final_states = out[0], out[1].astype("float32")
        varlen = out[2][0].astype("float32") if states_at is not None else None  # batch 1
    results = [y]
    if return_final_states:
        results.append(final_states)
    if return_varlen_states:
        results.append(varlen)  # [num_seqs, nheads, headdim, dstate]
    return results[0] if len(results) == 1 else tuple(results)
