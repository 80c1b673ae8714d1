"""Mamba-2 SSD op: ``mamba_chunk_scan_combined`` (``mamba_ssm``'s signature, plus ``backend=``).

``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, inf),
return_final_states=False, return_varlen_states=False)``:

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

Backends: ``reference`` (pure Paddle SSD in float32, differentiable by autograd). The Triton SSD
kernels are not written yet: ``backend="triton"`` raises ``BackendUnavailableError``.
"""

from __future__ import annotations

import math

import numpy as np
import paddle

from ..reference import ssd as ref
from ..runtime.backend import resolve_backend
from ._checks import check_tensor, device_of

IMPLEMENTED = ("reference",)
_INT_DTYPES = ("int32", "int64")


def _check_shape(name, t, expected, what):
    if list(t.shape) != list(expected):
        raise ValueError(f"{name}: expected {what} = {list(expected)}, got {list(t.shape)}")


def _check_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
                return_varlen_states):
    check_tensor("x", x)
    if x.ndim != 4:
        raise ValueError(f"x: expected [batch, seqlen, nheads, headdim], got shape {list(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    check_tensor("dt", dt)
    _check_shape("dt", dt, [batch, seqlen, nheads], "[batch, seqlen, nheads]")
    check_tensor("A", A)
    _check_shape("A", A, [nheads], "[nheads]")
    check_tensor("B", B)
    if B.ndim != 4 or B.shape[:2] != [batch, seqlen] or B.shape[2] < 1 or nheads % B.shape[2] != 0:
        raise ValueError(f"B: expected [batch={batch}, seqlen={seqlen}, ngroups dividing nheads={nheads}, dstate], "
                         f"got {list(B.shape)}")
    check_tensor("C", C)
    _check_shape("C", C, B.shape, "B's shape [batch, seqlen, ngroups, dstate]")
    dstate = B.shape[3]
    if D is not None:
        check_tensor("D", D)
        if list(D.shape) not in ([nheads], [nheads, headdim]):
            raise ValueError(f"D: expected [nheads={nheads}] or [nheads, headdim={headdim}], got {list(D.shape)}")
    if z is not None:
        check_tensor("z", z)
        _check_shape("z", z, x.shape, "x's shape [batch, seqlen, nheads, headdim]")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias)
        _check_shape("dt_bias", dt_bias, [nheads], "[nheads]")
    if initial_states is not None:
        check_tensor("initial_states", initial_states)
        _check_shape("initial_states", initial_states, [batch, nheads, headdim, dstate],
                     "[batch, nheads, headdim, dstate]")
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, float_dtypes=_INT_DTYPES)
        _check_shape("seq_idx", seq_idx, [batch, seqlen], "[batch, seqlen]")
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


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, backend: str = "auto"):
    """The Mamba-2 SSD scan (see the module docstring for shapes and results)."""
    bounds = _check_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
                         return_varlen_states)
    resolve_backend("mamba_chunk_scan_combined", backend, device_of(x), implemented=IMPLEMENTED)
    if bounds is not None:
        seq_idx = cu_seqlens_to_seq_idx(bounds, x.shape[1])
    states_at = (bounds[1:] - 1).tolist() if return_varlen_states else None
    out = ref.ssd_chunked_ref(x, dt, A, B, C, int(chunk_size), D=D, z=z, dt_bias=dt_bias,
                              initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                              dt_limit=tuple(float(v) for v in dt_limit), states_at=states_at)
    y, final_states = out[0], out[1].astype("float32")
    results = [y]
    if return_final_states:
        results.append(final_states)
    if return_varlen_states:
        results.append(out[2][0].astype("float32"))  # batch 1: [num_seqs, nheads, headdim, dstate]
    return results[0] if len(results) == 1 else tuple(results)
