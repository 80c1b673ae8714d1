"""Mamba-1 selective scan on the CUDA kernels of ``csrc/selective_scan.cu`` (ctypes over the C ABI).

The launchers mirror ``kernels/triton/selective_scan.py`` (same tensors, shapes, accumulate-into-zeroed
fp32 gradient contract; see that module's docstring), with the CUDA kernels' own plan: the forward
saves the fp32 state at the end of every ``state_interval()`` steps (``states_shape``) and the
backward needs no workspace (``workspace_shape`` is None). dstate up to 256, batch up to 65535.

Complex A (mamba_ssm's convention, which the Triton kernels lack): A ``[dim, dstate]`` complex64;
fixed B/C ``[dim, dstate]`` complex64; input-dependent B/C real ``[batch, (groups,) dstate,
2 * seqlen]`` holding (re, im) pairs; the output is ``2 Re(sum_n C h) + D u`` (times silu(z)). Then
``states`` and ``last_state`` are complex64 and so are the accumulators dA and fixed dB/dC (zeroed by
the caller); input-dependent dB/dC are float32 shaped like B/C. Gradients of complex tensors are
``dL/dre + i dL/dim`` (Paddle's and torch's convention).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from ...runtime import tensor as T
from ..triton.selective_scan import bc_layout, check_optional_grads
from . import library

_c_ptr, _c_i64, _c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_NUM_STRIDES = 52
_SIGNATURES = {
    "pnf_selective_scan_state_interval": [],
    "pnf_selective_scan_fwd": [_c_ptr] * 11 + [_c_i64] * 5 + [ctypes.POINTER(_c_i64), ctypes.POINTER(_c_int)] +
                              [_c_int] * 5 + [_c_ptr],
    "pnf_selective_scan_bwd": [_c_ptr] * 19 + [_c_i64] * 5 + [ctypes.POINTER(_c_i64), ctypes.POINTER(_c_int)] +
                              [_c_int] * 5 + [_c_ptr],
}
_NO_BC = (False, 1, (0,) * 5)  # the B/C layout of an absent tensor
_COMPLEX = "complex64"  # complex A and what goes with it, passed to the kernels as float32 pairs
_lib = library.bound(_SIGNATURES)


class ScanPlan(NamedTuple):
    """Saved states: one every ``interval`` steps (the backward's chunk), ``n_states`` of them."""
    interval: int
    n_states: int


def state_interval() -> int:
    return _lib().pnf_selective_scan_state_interval()


def scan_plan(seqlen: int) -> ScanPlan:
    interval = state_interval()
    return ScanPlan(interval, max(1, -(-seqlen // interval)))


def states_shape(batch: int, dim: int, dstate: int, plan: ScanPlan):
    """The float32 (complex A: complex64) states the forward saves for the backward (contiguous)."""
    return (batch, dim, plan.n_states, dstate)


def workspace_shape(batch: int, dim: int, dstate: int, plan: ScanPlan):
    """The CUDA backward needs no workspace."""
    return None


def is_complex(t) -> bool:
    return t is not None and T.dtype_name(t) == _COMPLEX


def _float_strides(t):
    """Strides in float32 units: a complex64 element is two floats (re, im)."""
    return tuple(2 * s for s in T.strides(t)) if is_complex(t) else T.strides(t)


def _bc(name, t, batch, dim, dstate, seqlen, complex_A):
    """The (variable, groups, strides (b, g, d, n, l) in the kernel's units) of B, C, dB or dC. With
    complex A a fixed one is complex64 and an input-dependent one real, [..., dstate, 2 * seqlen]."""
    variable = len(T.shape(t)) > 2
    if complex_A and variable and T.shape(t)[-1] != 2 * seqlen:
        raise ValueError(f"{name}: expected [batch, (groups,) dstate, 2 * seqlen = {2 * seqlen}] (re, im) pairs "
                         f"with complex A, got shape {T.shape(t)}")
    lay = bc_layout(name, t, batch, dim, dstate, 2 * seqlen if complex_A and variable else seqlen)
    if is_complex(t) != (complex_A and not variable):
        want = _COMPLEX if complex_A and not variable else "a real float dtype"
        raise TypeError(f"{name}: expected {want} ({'complex' if complex_A else 'real'} A, "
                        f"{'input-dependent' if variable else 'fixed'}), got {T.dtype_name(t)}")
    return lay if not is_complex(t) else (lay[0], lay[1], tuple(2 * s for s in lay[2]))


def _scan_args(u, delta, A, B, C, D, z, delta_bias):
    """Shapes checked; (batch, dim, seqlen, dstate, groups, complex A, B layout, C layout)."""
    if len(T.shape(u)) != 3:
        raise ValueError(f"u: expected [batch, dim, seqlen], got shape {T.shape(u)}")
    batch, dim, seqlen = T.shape(u)
    if len(T.shape(A)) != 2 or T.shape(A)[0] != dim:
        raise ValueError(f"A: expected [dim={dim}, dstate], got shape {T.shape(A)}")
    dstate = T.shape(A)[1]
    complex_A = is_complex(A)
    dtype = T.dtype_name(u)
    for name, t in (("delta", delta), ("z", z)):
        if t is not None:
            T.check_same_shape(name, t, (batch, dim, seqlen))
            if T.dtype_name(t) != dtype:
                raise TypeError(f"{name}: expected u's dtype {dtype}, got {T.dtype_name(t)}")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            T.check_same_shape(name, t, (dim,))
    B_lay = _bc("B", B, batch, dim, dstate, seqlen, complex_A)
    C_lay = _bc("C", C, batch, dim, dstate, seqlen, complex_A)
    groups = {lay[1] for lay in (B_lay, C_lay) if lay[0]}
    if len(groups) > 1:
        raise ValueError(f"B, C: input-dependent B and C must have the same number of groups, got {sorted(groups)}")
    return batch, dim, seqlen, dstate, (groups.pop() if groups else 1), complex_A, B_lay, C_lay


def _check_f32(name, t, shape=None, complex_A=False):
    """A float32 tensor (complex64 when ``complex_A``: the states and accumulators that go with A)."""
    if shape is not None:
        T.check_same_shape(name, t, shape)
    want = _COMPLEX if complex_A else "float32"
    if T.dtype_name(t) != want:
        raise TypeError(f"{name}: expected {want}, got {T.dtype_name(t)}")


def _checked_plan(seqlen, plan):
    """The one plan the CUDA kernels take for seqlen (``plan`` None: that plan)."""
    if plan is not None and plan != scan_plan(seqlen):
        raise ValueError(f"plan: expected {scan_plan(seqlen)} for seqlen {seqlen}, got {plan}")
    return scan_plan(seqlen)


def _seq(name, t, batch, dim, seqlen, dtype):
    if t is None:
        return (0, 0, 0)
    T.check_same_shape(name, t, (batch, dim, seqlen))
    if T.dtype_name(t) != dtype:
        raise TypeError(f"{name}: expected u's dtype {dtype}, got {T.dtype_name(t)}")
    return T.strides(t)


def _code(t) -> int:
    """The PnfDtype code; complex64 goes as its float32 parts."""
    if t is None:
        return 0
    return library.dtype_code("float32" if is_complex(t) else T.dtype_name(t))


def _ptr(t):
    return None if t is None else t.data_ptr()


def _arrays(seq_strides, A, B_lay, C_lay, dB_lay, dC_lay, last_strides, codes):
    strides = [s for st in seq_strides for s in st] + list(_float_strides(A)) + list(B_lay[2]) + list(C_lay[2]) + \
        list(dB_lay[2]) + list(dC_lay[2]) + list(last_strides)
    assert len(strides) == _NUM_STRIDES
    return (_c_i64 * _NUM_STRIDES)(*strides), (_c_int * len(codes))(*codes)


def selective_scan_fwd(u, delta, A, B, C, out, D=None, z=None, delta_bias=None, states=None, last_state=None,
                       delta_softplus: bool = False, plan: ScanPlan | None = None, warps: int = 0) -> None:
    """out [b, d, l] = the scan (times silu(z) when z is given), written in place; also the float32
    (complex A: complex64) ``states`` (``states_shape(..., plan)``) the backward needs and
    ``last_state`` [b, d, n] (any float dtype; complex A: complex64), each when given. ``warps``: dims
    (one a warp) a block (0: the library's default)."""
    batch, dim, seqlen, dstate, groups, complex_A, B_lay, C_lay = _scan_args(u, delta, A, B, C, D, z, delta_bias)
    dtype = T.dtype_name(u)
    plan = _checked_plan(seqlen, plan)
    if states is not None:
        _check_f32("states", states, states_shape(batch, dim, dstate, plan), complex_A)
        T.check_contiguous("states", states)
    if last_state is not None:
        T.check_same_shape("last_state", last_state, (batch, dim, dstate))
        if complex_A:
            _check_f32("last_state", last_state, complex_A=True)
    seq = [_seq(name, t, batch, dim, seqlen, dtype) for name, t in
           (("u", u), ("delta", delta), ("z", z), ("out", out))] + [(0, 0, 0)] * 5
    strides, codes = _arrays(seq, A, B_lay, C_lay, _NO_BC, _NO_BC,
                             _float_strides(last_state) if last_state is not None else (0, 0, 0),
                             [_code(u), _code(A), _code(B), _code(C), _code(D), _code(delta_bias), _code(last_state)])
    library.check(_lib().pnf_selective_scan_fwd(
        _ptr(u), _ptr(delta), _ptr(A), _ptr(B), _ptr(C), _ptr(D), _ptr(z), _ptr(delta_bias), _ptr(out),
        _ptr(states), _ptr(last_state), batch, dim, seqlen, dstate, groups, strides, codes, int(B_lay[0]),
        int(C_lay[0]), int(bool(delta_softplus)), int(complex_A), int(warps), library.stream_of(u)),
        "selective_scan_fwd")


def selective_scan_bwd(u, delta, A, B, C, dout, states, workspace, du, ddelta, dA, dB, dC, D=None, z=None,
                       delta_bias=None, dD=None, dz=None, ddelta_bias=None, out_z=None,
                       delta_softplus: bool = False, plan: ScanPlan | None = None, warps: int = 0) -> None:
    """Gradients of the scan (the Triton launcher's contract; ``workspace`` must be None). Written:
    du, ddelta, dz (with z), out_z (optional, with z). Accumulated into zeroed float32: dA [d, n]
    contiguous, dB/dC shaped like B/C, dD, ddelta_bias [d]; with complex A, dA and fixed dB/dC are
    complex64 (input-dependent dB/dC float32 (re, im) pairs like B/C)."""
    batch, dim, seqlen, dstate, groups, complex_A, B_lay, C_lay = _scan_args(u, delta, A, B, C, D, z, delta_bias)
    dtype = T.dtype_name(u)
    plan = _checked_plan(seqlen, plan)
    if workspace is not None:
        raise ValueError("workspace: the CUDA backward takes none (workspace_shape is None)")
    check_optional_grads(dim, z, dz, out_z, D, dD, delta_bias, ddelta_bias)
    _check_f32("dA", dA, (dim, dstate), complex_A)
    T.check_contiguous("dA", dA)
    _check_f32("states", states, states_shape(batch, dim, dstate, plan), complex_A)
    T.check_contiguous("states", states)
    for name, t, like, lay in (("dB", dB, B, B_lay), ("dC", dC, C, C_lay)):
        _check_f32(name, t, T.shape(like), complex_A and not lay[0])
    dB_lay = _bc("dB", dB, batch, dim, dstate, seqlen, complex_A)
    dC_lay = _bc("dC", dC, batch, dim, dstate, seqlen, complex_A)
    seq = [_seq(name, t, batch, dim, seqlen, dtype) for name, t in
           (("u", u), ("delta", delta), ("z", z), ("out", None), ("dout", dout), ("du", du), ("ddelta", ddelta),
            ("dz", dz), ("out_z", out_z))]
    strides, codes = _arrays(seq, A, B_lay, C_lay, dB_lay, dC_lay, (0, 0, 0),
                             [_code(u), _code(A), _code(B), _code(C), _code(D), _code(delta_bias), 0])
    library.check(_lib().pnf_selective_scan_bwd(
        _ptr(u), _ptr(delta), _ptr(A), _ptr(B), _ptr(C), _ptr(D), _ptr(z), _ptr(delta_bias), _ptr(dout),
        _ptr(states), _ptr(du), _ptr(ddelta), _ptr(dA), _ptr(dB), _ptr(dC), _ptr(dD), _ptr(dz), _ptr(ddelta_bias),
        _ptr(out_z), batch, dim, seqlen, dstate, groups, strides, codes, int(B_lay[0]), int(C_lay[0]),
        int(bool(delta_softplus)), int(complex_A), int(warps), library.stream_of(u)), "selective_scan_bwd")
