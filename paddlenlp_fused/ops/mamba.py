"""Mamba-1 ops: selective scan, its decoding step, and the fused inner block.

Signatures follow ``mamba_ssm`` as a superset (plus ``backend=``); the causal conv lives in
``ops/causal_conv1d.py``:

* ``selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
  return_last_state=False)``: u, delta, z ``[batch, dim, seqlen]``; A ``[dim, dstate]`` real or
  complex (mamba_ssm's convention: then fixed B/C are complex ``[dim, dstate]``, input-dependent B/C
  real ``[batch, (groups,) dstate, 2 * seqlen]`` holding (re, im) pairs, and y is
  ``2 Re(sum_n C h)``); B, C ``[dim, dstate]``, ``[batch, dstate, seqlen]`` or
  ``[batch, groups, dstate, seqlen]``; D, delta_bias ``[dim]``. Returns ``y * silu(z)`` (or y) in u's
  dtype, and with ``return_last_state`` the final state ``[batch, dim, dstate]`` (float32, complex64
  for complex A; no gradient).
* ``selective_state_update``: one decoding step, state updated in place (no autograd).
* ``mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
  out_proj_weight, out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None,
  C_proj_bias=None, delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None,
  dt_rms_weight=None, b_c_dt_rms_eps=1e-6, is_paddle_linear=True)``: conv, projections, the optional
  B/C/dt RMSNorms (Jamba), scan and output projection in one PyLayer; ``checkpoint_lvl=1``
  recomputes the conv output and delta in backward instead of saving them. ``is_paddle_linear``: the
  projection weights are Paddle ``Linear`` weights ``[in, out]`` (else torch's ``[out, in]``).

Backends of the scan (``selective_scan_fn`` and the scan inside ``mamba_inner_fn``): ``cuda``
(``csrc/selective_scan.cu``), ``triton`` (``kernels/triton/selective_scan.py``), both inside PyLayers
with matmuls by Paddle, and ``reference`` (pure Paddle, float32). Complex A runs on all three: ``auto``
takes CUDA for it on the GPU (complex64 A and fixed B/C), Triton where the CUDA library is not built or
cannot take the call (with a warning), Triton in the interpreter on the CPU, else the reference. The
Triton kernels take complex64 or complex128 A and complex or real fixed B/C (computing in complex64,
as the reference does for float32 activations).

``deterministic`` (both ops; None follows ``FLAGS_cudnn_deterministic``, see
``runtime/determinism.py``): the Triton backward stores its per-program sums of dA, dB, dC, dD and
ddelta_bias (and the conv's weight gradients) in a float32 workspace and adds them in a fixed order
instead of fp32 atomics, so two runs give bit-identical gradients (complex A too). The CUDA backward
uses atomics: ``auto`` routes a call that can be differentiated around it (to Triton, with a warning),
an explicit ``backend="cuda"`` raises ``BackendUnavailableError``.
"""

from __future__ import annotations

import paddle

from ..kernels.cuda import selective_scan as cuda_scan
from ..kernels.triton import selective_scan as scan_kernels
from ..kernels.triton.state_update import selective_state_update as state_update_launch
from ..reference import mamba as ref
from ..runtime import tensor as T
from ..runtime.backend import gpu_order, resolve_backend
from ..runtime.determinism import deterministic_requested
from ..runtime.triton_paddle import triton_args, triton_scoped
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import (TritonPyLayer, add, cast_like, check_shape, empty_on, grads_for, mm, needs_grad, run_in_place,
                       zeros32_on)
from .causal_conv1d import check_state_indices, conv_launch_bwd, conv_launch_fwd, conv_weight

IMPLEMENTED = ("triton", "reference")
SCAN_IMPLEMENTED = ("cuda", "triton", "reference")
_SCAN_KERNELS = {"cuda": cuda_scan, "triton": scan_kernels}
# ``auto`` on the GPU: the order the scan's backends are tried in for real A, Triton first (faster at
# the benchmark shape: benchmarks/NOTES.md); CUDA runs when Triton cannot or when asked for.
SCAN_AUTO_ORDER = gpu_order("selective_scan")
COMPLEX_A_BACKENDS = ("cuda", "triton", "reference")
# ``auto`` on the GPU for complex A: CUDA first (the Triton complex scan is not yet measured against it
# on the GPU), Triton where CUDA cannot run the call
COMPLEX_A_PREFER = ("cuda", "triton")
CUDA_MAX_DSTATE = 256  # shared-memory carries of csrc/selective_scan.cu
CUDA_MAX_BATCH = 65535  # grid y
_COMPLEX = (paddle.complex64, paddle.complex128)
_INT_DTYPES = ("int32", "int64")


# ----------------------------------------------------------------------------------------------
# argument checks


_REAL_DTYPES = T.FLOAT_DTYPES + ("float64",)
_COMPLEX_NAMES = ("complex64", "complex128")


def _check_bc(name, t, batch, dim, dstate, seqlen, complex_A):
    check_tensor(name, t, float_dtypes=None)
    # complex only where it goes with complex A: a fixed B/C (a real one then has imaginary part 0)
    allowed = _REAL_DTYPES + (_COMPLEX_NAMES if complex_A and t.ndim == 2 else ())
    if T.dtype_name(t) not in allowed:
        kind = ("fixed" if t.ndim == 2 else "input-dependent (real (re, im) pairs)") if complex_A else "real A"
        raise TypeError(f"{name}: expected dtype in {list(allowed)} ({kind}), got {T.dtype_name(t)}")
    shape = list(t.shape)
    # complex A with input-dependent B/C: mamba_ssm's real [..., dstate, 2 * seqlen] (re, im) pairs
    length = 2 * seqlen if complex_A and t.ndim > 2 else seqlen
    ok = (t.ndim == 2 and shape == [dim, dstate]) or (t.ndim == 3 and shape == [batch, dstate, length]) or \
        (t.ndim == 4 and shape[0] == batch and shape[2:] == [dstate, length] and shape[1] >= 1 and dim % shape[1] == 0)
    if not ok:
        raise ValueError(f"{name}: expected [dim={dim}, dstate={dstate}], [batch={batch}, dstate, seqlen={length}] "
                         f"or [batch, groups dividing dim, dstate, seqlen], got {shape}")


def _check_scan_args(u, delta, A, B, C, D, z, delta_bias):
    check_tensor("u", u)
    if u.ndim != 3:
        raise ValueError(f"u: expected [batch, dim, seqlen], got shape {list(u.shape)}")
    batch, dim, seqlen = u.shape
    check_tensor("delta", delta)
    check_shape("delta", delta, u.shape)
    check_tensor("A", A, float_dtypes=None)
    if A.ndim != 2 or A.shape[0] != dim:
        raise ValueError(f"A: expected [dim={dim}, dstate], got shape {list(A.shape)}")
    complex_A = A.dtype in _COMPLEX
    if not complex_A and T.dtype_name(A) not in T.FLOAT_DTYPES + ("float64",):
        raise TypeError(f"A: expected a float or complex dtype, got {T.dtype_name(A)}")
    dstate = A.shape[1]
    _check_bc("B", B, batch, dim, dstate, seqlen, complex_A)
    _check_bc("C", C, batch, dim, dstate, seqlen, complex_A)
    if B.ndim > 2 and C.ndim > 2 and B.ndim == 4 and C.ndim == 4 and B.shape[1] != C.shape[1]:
        raise ValueError(f"B, C: expected the same number of groups, got {B.shape[1]} and {C.shape[1]}")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            check_tensor(name, t)
            check_shape(name, t, [dim])
    if z is not None:
        check_tensor("z", z)
        check_shape("z", z, u.shape)
    return complex_A


# ----------------------------------------------------------------------------------------------
# selective scan


def _cuda_dtype_issue(u, delta, z, A=None, B=None, C=None, D=None, delta_bias=None):
    """Why the CUDA scan cannot take these dtypes (delta and z in u's dtype; every tensor float32,
    float16 or bfloat16, except that complex A and the fixed B/C that go with it are complex64), or
    None."""
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.dtype != u.dtype:
            return f"{name} is {T.dtype_name(t)}, u is {T.dtype_name(u)} (the CUDA scan wants one dtype)"
    complex_A = A is not None and A.dtype in _COMPLEX
    if complex_A and A.dtype != paddle.complex64:
        return f"A is {T.dtype_name(A)} (the CUDA scan takes complex64 for complex A)"
    real = [u, D, delta_bias] + ([] if complex_A else [A])
    for name, t in (("B", B), ("C", C)):
        if complex_A and t is not None and t.ndim == 2:  # fixed B/C go with A
            if t.dtype != paddle.complex64:
                return f"fixed {name} is {T.dtype_name(t)} with complex A (the CUDA scan takes complex64)"
        else:
            real.append(t)
    for t in real:
        if t is not None and T.dtype_name(t) not in T.FLOAT_DTYPES:
            return f"{T.dtype_name(t)} input (the CUDA scan takes {', '.join(T.FLOAT_DTYPES)})"
    return None


def _scan_unsupported(complex_A, batch, dstate, cuda_dtype_issue=None, deterministic=False):
    """Why a GPU backend cannot take this scan (``resolve_backend``'s ``unsupported``), or None."""
    def why(name):
        if complex_A and name not in COMPLEX_A_BACKENDS:
            return f"complex A runs on the {' and '.join(COMPLEX_A_BACKENDS)} backends only"
        if name == "cuda" and deterministic:
            return "deterministic (the CUDA backward adds dA, dB, dC, dD and ddelta_bias with fp32 atomics)"
        if name == "cuda" and dstate > CUDA_MAX_DSTATE:
            return f"dstate {dstate} > {CUDA_MAX_DSTATE}"
        if name == "cuda" and batch > CUDA_MAX_BATCH:
            return f"batch {batch} > {CUDA_MAX_BATCH}"
        return cuda_dtype_issue if name == "cuda" else None
    return why


def _deterministic_backward(deterministic, *tensors):
    """Whether this call's backward must be deterministic: requested (``deterministic`` or the flag)
    and a backward can follow (the forward kernels are deterministic on every backend)."""
    return deterministic_requested(deterministic) and paddle.is_grad_enabled() and any(needs_grad(*tensors))


def _scan_launch(backend, name, *tensors, **options):
    """Launcher ``name`` of the scan kernels of ``backend`` (tensors wrapped for Triton)."""
    if backend == "triton":
        tensors = triton_args(*tensors)
    getattr(_SCAN_KERNELS[backend], name)(*tensors, **options)


def _triton_pairs(A, B, C):
    """Complex A, B, C as the Triton kernels take them, float (re, im) pairs along a trailing axis
    (views where they can be): A and fixed B/C [dim, dstate, 2] (a real fixed one with imaginary part
    0), input-dependent B/C [.., dstate, seqlen, 2] (mamba_ssm's [.., dstate, 2 seqlen] viewed so)."""
    def pairs(t):
        if t.ndim > 2:
            return t.reshape(list(t.shape[:-1]) + [t.shape[-1] // 2, 2])
        return paddle.as_real(t) if t.dtype in _COMPLEX else paddle.stack([t, paddle.zeros_like(t)], axis=-1)
    return paddle.as_real(A), pairs(B), pairs(C)


def _unpaired(grad, t):
    """A Triton gradient accumulated in (re, im) pairs (``_triton_pairs``) in t's form: complex64 for
    complex t, the real part for a real fixed B/C, t's shape for an input-dependent one."""
    if t.ndim > 2:
        return grad.reshape(t.shape)
    grad = paddle.as_complex(grad)
    return grad if t.dtype in _COMPLEX else paddle.real(grad)


def _scan_launch_fwd(backend, u, delta, A, B, C, D, z, delta_bias, delta_softplus, want_states, want_last):
    """(out, states, last_state, plan) from the forward kernel of ``backend`` on contiguous inputs."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    kernels = _SCAN_KERNELS[backend]
    plan = kernels.scan_plan(seqlen)
    out = empty_on(u.shape, u.dtype, u)
    pairs = A.dtype in _COMPLEX and backend == "triton"  # float32 states, the last one as (re, im) pairs
    if pairs:
        A, B, C = _triton_pairs(A, B, C)
        states_shape, last_shape = kernels.states_shape(batch, dim, dstate, plan, True), [batch, dim, dstate, 2]
    else:
        states_shape, last_shape = kernels.states_shape(batch, dim, dstate, plan), [batch, dim, dstate]
    state_dtype = "complex64" if A.dtype in _COMPLEX else "float32"  # complex A on CUDA: complex states
    states = empty_on(states_shape, state_dtype, u) if want_states else None
    last = empty_on(last_shape, state_dtype, u) if want_last else None
    _scan_launch(backend, "selective_scan_fwd", u, delta, A, B, C, out, D, z, delta_bias, states, last,
                 delta_softplus=delta_softplus, plan=plan)
    if pairs and last is not None:
        last = paddle.as_complex(last)
    return out, states, last, plan


def _scan_launch_bwd(backend, saved, dout, plan, delta_softplus, want_out_z=False, deterministic=False):
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias) in float32 (complex64) accumulators /
    input dtypes, and the recomputed output when ``want_out_z``. ``deterministic`` (Triton only): the
    accumulated gradients are summed in a fixed order (a float32 partials workspace)."""
    u, delta, A, B, C, D, z, delta_bias, states = saved
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    pairs = A.dtype in _COMPLEX and backend == "triton"
    kernel_A, kernel_B, kernel_C = _triton_pairs(A, B, C) if pairs else (A, B, C)
    du, ddelta = empty_on(u.shape, u.dtype, u), empty_on(delta.shape, delta.dtype, u)
    dz = None if z is None else empty_on(z.shape, z.dtype, u)
    out_z = empty_on(u.shape, u.dtype, u) if want_out_z and z is not None else None
    dA, dB, dC = (_accumulator(t, u) for t in (kernel_A, kernel_B, kernel_C))
    dD = None if D is None else zeros32_on(D.shape, u)
    ddb = None if delta_bias is None else zeros32_on(delta_bias.shape, u)
    if pairs:
        work_shape = scan_kernels.workspace_shape(batch, dim, dstate, plan, True)
    else:
        work_shape = _SCAN_KERNELS[backend].workspace_shape(batch, dim, dstate, plan)
    work = None if work_shape is None else empty_on(work_shape, "float32", u)
    options = {}
    if deterministic:
        layout = scan_kernels.bwd_partials_layout(*triton_args(u, kernel_A, kernel_B, kernel_C, D, delta_bias),
                                                  plan=plan)
        options["partials"] = triton_args(empty_on([layout["numel"]], "float32", u))[0]
    _scan_launch(backend, "selective_scan_bwd", u, delta, kernel_A, kernel_B, kernel_C, contiguous(dout), states,
                 work, du, ddelta, dA, dB, dC, D, z, delta_bias, dD, dz, ddb, out_z, delta_softplus=delta_softplus,
                 plan=plan, **options)
    if pairs:
        dA, dB, dC = _unpaired(dA, A), _unpaired(dB, B), _unpaired(dC, C)
    return du, ddelta, dA, dB, dC, dD, dz, ddb, out_z


def _accumulator(t, like):
    """A zeroed gradient accumulator for t: complex64 for complex t (complex A on CUDA), else float32."""
    if t.dtype in _COMPLEX:
        return paddle.zeros(list(t.shape), dtype="complex64", device=like.place)
    return zeros32_on(t.shape, like)


class SelectiveScanFunction(TritonPyLayer):
    op = "selective_scan_fn"

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, backend,
                deterministic):
        ctx.needs_grad = needs_grad(u, delta, A, B, C, D, z, delta_bias)
        u, delta, A, B, C, D, z, delta_bias = (contiguous(t) for t in (u, delta, A, B, C, D, z, delta_bias))
        # the chunk states are only saved when a backward can follow
        out, states, last, plan = _scan_launch_fwd(backend, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                   any(ctx.needs_grad), return_last_state)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states)
        ctx.plan, ctx.delta_softplus, ctx.backend, ctx.deterministic = plan, delta_softplus, backend, deterministic
        if return_last_state:
            ctx.mark_non_differentiable(last)
            return out, last
        return out

    @staticmethod
    def backward(ctx, dout, dlast=None):
        saved = ctx.saved_tensor()
        u, delta, A, B, C, D, z, delta_bias, _ = saved
        du, ddelta, dA, dB, dC, dD, dz, ddb, _ = _scan_launch_bwd(ctx.backend, saved, dout, ctx.plan,
                                                                  ctx.delta_softplus, deterministic=ctx.deterministic)
        grads = [du, ddelta, cast_like(dA, A), cast_like(dB, B), cast_like(dC, C)]
        grads += [cast_like(g, t) for g, t in ((dD, D), (dz, z), (ddb, delta_bias)) if t is not None]
        return grads_for(ctx, grads)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, backend: str = "auto", deterministic=None):
    """Mamba-1 selective scan (see the module docstring). Returns out, or (out, last_state).
    ``deterministic``: None follows ``FLAGS_cudnn_deterministic``; True makes the gradients
    bit-reproducible (no atomics; not on the CUDA backend)."""
    complex_A = _check_scan_args(u, delta, A, B, C, D, z, delta_bias)
    deterministic = _deterministic_backward(deterministic, u, delta, A, B, C, D, z, delta_bias)
    chosen = resolve_backend("selective_scan", backend, device_of(u), implemented=SCAN_IMPLEMENTED,
                             unsupported=_scan_unsupported(complex_A, u.shape[0], A.shape[1],
                                                           _cuda_dtype_issue(u, delta, z, A, B, C, D, delta_bias),
                                                           deterministic),
                             prefer=COMPLEX_A_PREFER if complex_A else SCAN_AUTO_ORDER)
    if chosen == "reference" or u.size == 0:
        return ref.selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    return SelectiveScanFunction.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                                       bool(return_last_state), chosen, deterministic)


# ----------------------------------------------------------------------------------------------
# decoding steps (in place, no autograd)


@triton_scoped
def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, backend: str = "auto"):
    """One decoding step of the scan: state ``[batch, dim, dstate]`` updated in place; x, dt, z
    ``[batch, dim]``; A ``[dim, dstate]``; B, C ``[batch, dstate]`` or ``[batch, groups, dstate]``;
    D, dt_bias ``[dim]``. With ``state_batch_indices`` ``[batch]`` (int32/int64; mamba_ssm's continuous
    batching) state is a cache ``[slots, dim, dstate]`` and row b updates slot
    ``state_batch_indices[b]``; a negative index is a padding row (output 0, no slot touched).
    Returns out ``[batch, dim]`` in x's dtype."""
    check_tensor("state", state)
    if state.ndim != 3:
        raise ValueError(f"state: expected [batch, dim, dstate], got shape {list(state.shape)}")
    batch, dim, dstate = state.shape
    if state_batch_indices is not None:
        check_tensor("x", x)
        batch = x.shape[0] if x.ndim else batch
        check_state_indices("state_batch_indices", state_batch_indices, batch, state.shape[0])
    for name, t in (("x", x), ("dt", dt), ("z", z)):
        if t is not None or name != "z":
            check_tensor(name, t)
            check_shape(name, t, [batch, dim])
    check_tensor("A", A)
    check_shape("A", A, [dim, dstate])
    for name, t in (("B", B), ("C", C)):
        check_tensor(name, t)
        if not (list(t.shape) == [batch, dstate] or (t.ndim == 3 and t.shape[0] == batch and t.shape[2] == dstate
                                                     and dim % t.shape[1] == 0)):
            raise ValueError(f"{name}: expected [batch={batch}, dstate={dstate}] or [batch, groups dividing "
                             f"dim={dim}, dstate], got {list(t.shape)}")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(name, t)
            check_shape(name, t, [dim])
    chosen = resolve_backend("selective_state_update", backend, device_of(x), implemented=IMPLEMENTED)
    with paddle.no_grad():
        if chosen == "reference" or x.size == 0:
            return ref.selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                  state_batch_indices)
        x, dt, A, B, C, D, z, dt_bias, indices = (contiguous(t) for t in (x, dt, A, B, C, D, z, dt_bias,
                                                                           state_batch_indices))
        out = empty_on(x.shape, x.dtype, x)

        def launch(st):
            *args, indices_arg = triton_args(st, x, dt, A, B, C, out, D, z, dt_bias, indices)
            state_update_launch(*args, dt_softplus=dt_softplus, state_batch_indices=indices_arg)

        run_in_place(state, launch)
        return out


# ----------------------------------------------------------------------------------------------
# mamba_inner_fn


def _batch_sum_mm(a, b):
    """sum_b a[b] @ b[b]^T for a [B, M, L], b [B, K, L]: [M, K] (a weight gradient)."""
    batch, m, length = a.shape
    a2 = a.transpose([1, 0, 2]).reshape([m, batch * length])
    b2 = b.transpose([1, 0, 2]).reshape([b.shape[1], batch * length])
    return mm(a2, b2, transpose_b=True)


class MambaInnerFunction(TritonPyLayer):
    """Conv, x/delta projections, scan and output projection. Projection weights arrive in Paddle's
    [in, out] layout and in xz's dtype; the projected tensors stay in [batch, features, seqlen] so
    that no activation is transposed: x_dbl = x_proj^T @ conv_out, delta = delta_proj^T @ x_dbl[:r]."""
    op = "mamba_inner_fn"

    @staticmethod
    def forward(ctx, xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, out_proj_b, A, B, C, D, delta_bias,
                B_proj_bias, C_proj_bias, b_rms_w, c_rms_w, dt_rms_w, rms_eps, delta_softplus, checkpoint_lvl,
                backend, deterministic):
        # the launchers read these with their own strides assumed dense
        xz, conv_w, conv_b, A, D, delta_bias, B_proj_bias, C_proj_bias = (
            contiguous(t) for t in (xz, conv_w, conv_b, A, D, delta_bias, B_proj_bias, C_proj_bias))
        dim = xz.shape[1] // 2
        x, z = contiguous(xz[:, :dim]), contiguous(xz[:, dim:])
        conv_out = conv_launch_fwd(x, conv_w, conv_b, None, None, "silu")
        x_dbl = mm(x_proj_w, conv_out, transpose_a=True)  # [batch, r (+ n) (+ n), seqlen]
        rank = delta_proj_w.shape[0]
        delta = mm(delta_proj_w, x_dbl[:, :rank], transpose_a=True)  # [batch, dim, seqlen]
        ctx.rms_eps = rms_eps
        (delta_n, _, _), (B_n, _, _), (C_n, _, _) = _scan_bc_dt(x_dbl, rank, A, B, C, B_proj_bias, C_proj_bias,
                                                                delta, (b_rms_w, c_rms_w, dt_rms_w, rms_eps))
        out_z, states, _, plan = _scan_launch_fwd(backend, conv_out, delta_n, A, B_n, C_n, D, z, delta_bias,
                                                  delta_softplus, True, False)
        out = mm(out_z, out_proj_w, transpose_a=True)  # [batch, seqlen, d_model]
        if out_proj_b is not None:
            out = add(out, out_proj_b)
        keep = (conv_out, delta) if checkpoint_lvl == 0 else (None, None)
        ctx.save_for_backward(xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, out_proj_b, A, B, C, D,
                              delta_bias, B_proj_bias, C_proj_bias, b_rms_w, c_rms_w, dt_rms_w, x_dbl, states, *keep)
        ctx.plan, ctx.delta_softplus, ctx.backend, ctx.deterministic = plan, delta_softplus, backend, deterministic
        ctx.needs_grad = needs_grad(xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, out_proj_b, A, B, C, D,
                                     delta_bias, B_proj_bias, C_proj_bias, b_rms_w, c_rms_w, dt_rms_w)
        return out

    @staticmethod
    def backward(ctx, dout):
        (xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, out_proj_b, A, B, C, D, delta_bias, B_proj_bias,
         C_proj_bias, b_rms_w, c_rms_w, dt_rms_w, x_dbl, states, conv_out, delta) = ctx.saved_tensor()
        dim = xz.shape[1] // 2
        rank, rows = delta_proj_w.shape[0], _projected_rows(A)
        x, z = contiguous(xz[:, :dim]), contiguous(xz[:, dim:])
        if conv_out is None:  # checkpoint_lvl 1: recompute
            conv_out = conv_launch_fwd(x, conv_w, conv_b, None, None, "silu")
            delta = mm(delta_proj_w, x_dbl[:, :rank], transpose_a=True)
        rms = (b_rms_w, c_rms_w, dt_rms_w, ctx.rms_eps)
        (delta_n, _, dt_rstd), (B_n, B_raw, B_rstd), (C_n, C_raw, C_rstd) = _scan_bc_dt(
            x_dbl, rank, A, B, C, B_proj_bias, C_proj_bias, delta, rms)
        dout = contiguous(dout)
        dout_z = mm(out_proj_w, dout, transpose_b=True)  # [batch, dim, seqlen]
        du, ddelta, dA, dB, dC, dD, dz, ddb, out_z = _scan_launch_bwd(
            ctx.backend, (conv_out, delta_n, A, B_n, C_n, D, z, delta_bias, states), dout_z, ctx.plan,
            ctx.delta_softplus, True, ctx.deterministic)
        # back through the RMSNorms: gradients of the raw delta / B / C and of the norm weights
        d_dt_rms_w = d_b_rms_w = d_c_rms_w = None
        if dt_rms_w is not None:
            ddelta, d_dt_rms_w = _rms_bwd(ddelta, delta, dt_rms_w, dt_rstd)
            ddelta = cast_like(ddelta, delta)
        if b_rms_w is not None:
            dB, d_b_rms_w = _rms_bwd(dB, B_raw, b_rms_w, B_rstd)
        if c_rms_w is not None:
            dC, d_c_rms_w = _rms_bwd(dC, C_raw, c_rms_w, C_rstd)
        d_out_proj_w = _batch_sum_mm(out_z, dout.transpose([0, 2, 1]))
        d_out_proj_b = None if out_proj_b is None else dout.astype("float32").sum(axis=[0, 1]).astype(out_proj_b.dtype)
        # gradient of x_dbl [batch, r (+ n) (+ n), seqlen]: delta's rows, then B's and C's when projected
        # (zero rows for a given B or C that x_proj still has columns for)
        parts = [mm(delta_proj_w, ddelta)]
        both = x_dbl.shape[1] == rank + 2 * rows
        if B is None:
            dB = _unprojected(dB, A)
            parts.append(cast_like(dB, x_dbl))
        elif both:
            parts.append(paddle.zeros_like(x_dbl[:, rank:rank + rows]))
        if C is None:
            dC = _unprojected(dC, A)
            parts.append(cast_like(dC, x_dbl))
        elif both:
            parts.append(paddle.zeros_like(x_dbl[:, rank + rows:]))
        dx_dbl = paddle.concat(parts, axis=1)
        d_delta_proj_w = _batch_sum_mm(x_dbl[:, :rank], ddelta)
        d_x_proj_w = _batch_sum_mm(conv_out, dx_dbl)
        dconv_out = add(du, mm(x_proj_w, dx_dbl))
        dx, dconv_w, dconv_b, _ = conv_launch_bwd(x, conv_w, conv_b, None, None, dconv_out, "silu",
                                                  deterministic=ctx.deterministic)
        dxz = paddle.concat([dx, dz], axis=1)
        # a bias of a given B or C goes unused (mamba_ssm's): zero gradient
        dB_bias = None if B_proj_bias is None else cast_like(
            dB.sum(axis=[0, 2]) if B is None else paddle.zeros_like(B_proj_bias), B_proj_bias)
        dC_bias = None if C_proj_bias is None else cast_like(
            dC.sum(axis=[0, 2]) if C is None else paddle.zeros_like(C_proj_bias), C_proj_bias)
        candidates = ((dxz, xz), (dconv_w, conv_w), (dconv_b, conv_b), (d_x_proj_w, x_proj_w),
                      (d_delta_proj_w, delta_proj_w), (d_out_proj_w, out_proj_w), (d_out_proj_b, out_proj_b),
                      (cast_like(dA, A), A), (cast_like(dB, B), B), (cast_like(dC, C), C), (cast_like(dD, D), D),
                      (cast_like(ddb, delta_bias), delta_bias), (dB_bias, B_proj_bias), (dC_bias, C_proj_bias),
                      (cast_like(d_b_rms_w, b_rms_w), b_rms_w), (cast_like(d_c_rms_w, c_rms_w), c_rms_w),
                      (cast_like(d_dt_rms_w, dt_rms_w), dt_rms_w))
        return grads_for(ctx, [g for g, t in candidates if t is not None])


def _scan_bc_dt(x_dbl, rank, A, B, C, B_proj_bias, C_proj_bias, delta, rms):
    """The scan's delta, B and C from x_dbl (B after delta's rows, C in the last rows: mamba_ssm's
    layout) or as given, each as (normed, raw, rstd) through the optional RMSNorms of
    ``rms = (b_weight, c_weight, dt_weight, eps)`` (raw and rstd None without one)."""
    b_w, c_w, dt_w, eps = rms
    rows = _projected_rows(A)
    B_raw = _projected(x_dbl, rank, rows, B_proj_bias, A) if B is None else contiguous(B)
    C_raw = _projected(x_dbl, x_dbl.shape[1] - rows, rows, C_proj_bias, A) if C is None else contiguous(C)
    return tuple(_rms_fwd(t, w, eps) for t, w in ((delta, dt_w), (B_raw, b_w), (C_raw, c_w)))


def _rms_fwd(t, w, eps):
    """(RMSNorm of t over axis -2 with weight w, in t's dtype; t; rstd float32), or (t, None, None)."""
    if w is None:
        return t, None, None
    tf = t.astype("float32")
    rstd = paddle.rsqrt((tf * tf).mean(axis=-2, keepdim=True) + eps)
    return contiguous((tf * rstd * w.astype("float32")[:, None]).astype(t.dtype)), t, rstd


def _rms_bwd(dy, t, w, rstd):
    """(dt, dw) in float32 of ``_rms_fwd``: dt = rstd (g - xhat mean(g xhat)) with g = dy w."""
    xhat = t.astype("float32") * rstd
    dyf = dy.astype("float32")
    g = dyf * w.astype("float32")[:, None]
    dt = rstd * (g - xhat * (g * xhat).mean(axis=-2, keepdim=True))
    dw = (dyf * xhat).sum(axis=[i for i in range(t.ndim) if i != t.ndim - 2])
    return dt, dw


def _projected_rows(A):
    """Rows of x_dbl that B (or C) takes: dstate, or 2 dstate ((re, im) per state) for complex A."""
    return A.shape[1] * (2 if A.dtype in _COMPLEX else 1)


def _projected(x_dbl, start, rows, bias, A):
    """Rows [start, start + rows) of x_dbl [batch, r + 2 rows, seqlen] (+ bias [rows]), contiguous: B or
    C [batch, dstate, seqlen]; for complex A, rows (dstate, re/im) become mamba_ssm's (re, im) pairs
    [batch, dstate, 2 seqlen] (as the reference projects them)."""
    t = x_dbl[:, start:start + rows]
    if bias is not None:
        t = add(t, bias[:, None])
    if A.dtype in _COMPLEX:
        batch, _, seqlen = t.shape
        t = t.reshape([batch, rows // 2, 2, seqlen]).transpose([0, 1, 3, 2]).reshape([batch, rows // 2, 2 * seqlen])
    return contiguous(t)


def _unprojected(g, A):
    """The gradient of ``_projected``'s output back in x_dbl's row layout [batch, rows, seqlen]."""
    if A.dtype not in _COMPLEX:
        return g
    batch, dstate, pairs = g.shape
    return g.reshape([batch, dstate, pairs // 2, 2]).transpose([0, 1, 3, 2]).reshape([batch, 2 * dstate, pairs // 2])


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
                   A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                   b_c_dt_rms_eps=1e-6, is_paddle_linear=True, backend: str = "auto", deterministic=None):
    """Mamba-1 inner block: xz ``[batch, 2 dim, seqlen]`` -> ``[batch, seqlen, d_model]`` (see the
    module docstring). conv1d_weight ``[dim, width]`` or ``[dim, 1, width]``; with
    ``is_paddle_linear`` x_proj_weight ``[dim, r + 2 dstate]`` (``r + dstate`` or ``r`` when B and/or
    C are given: mamba_ssm takes B from the columns after r and C from the last ones),
    delta_proj_weight ``[r, dim]``, out_proj_weight ``[dim, d_model]`` (torch layout transposed
    otherwise). ``b_rms_weight``/``c_rms_weight`` ``[dstate]``, ``dt_rms_weight`` ``[dim]``: RMSNorms
    (eps ``b_c_dt_rms_eps``) of the input-dependent B and C over dstate and of delta (before
    delta_bias) over dim, as Jamba uses them; real A only. The projection weights are cast to xz's
    dtype (their gradients come back in their own). ``deterministic``: as ``selective_scan_fn``'s (the
    conv's weight gradients too)."""
    check_tensor("xz", xz)
    if xz.ndim != 3 or xz.shape[1] % 2:
        raise ValueError(f"xz: expected [batch, 2 * dim, seqlen], got shape {list(xz.shape)}")
    if checkpoint_lvl not in (0, 1):
        raise ValueError(f"checkpoint_lvl: expected 0 or 1, got {checkpoint_lvl!r}")
    batch, two_dim, seqlen = xz.shape
    dim = two_dim // 2
    for name, t in (("x_proj_weight", x_proj_weight), ("delta_proj_weight", delta_proj_weight),
                    ("out_proj_weight", out_proj_weight)):
        check_tensor(name, t)
        if t.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D weight, got shape {list(t.shape)}")
    x_proj_w, delta_proj_w, out_proj_w = ref.paddle_linear_weights(x_proj_weight, delta_proj_weight,
                                                                   out_proj_weight, is_paddle_linear)
    conv_w = conv_weight(conv1d_weight, dim)
    if conv1d_bias is not None:
        check_tensor("conv1d_bias", conv1d_bias)
        check_shape("conv1d_bias", conv1d_bias, [dim])
    check_tensor("A", A, float_dtypes=None)
    if A.ndim != 2 or A.shape[0] != dim:
        raise ValueError(f"A: expected [dim={dim}, dstate], got shape {list(A.shape)}")
    complex_A = A.dtype in _COMPLEX
    dstate = A.shape[1] * (2 if complex_A else 1)
    rank = delta_proj_w.shape[0]
    if list(delta_proj_w.shape) != [rank, dim]:
        raise ValueError(f"delta_proj_weight: expected [dt_rank, dim={dim}] (Paddle layout), got "
                         f"{list(delta_proj_weight.shape)}")
    projected = (B is None) + (C is None)
    widths = sorted({rank + projected * dstate, rank + 2 * dstate})
    if x_proj_w.shape[0] != dim or x_proj_w.shape[1] not in widths:
        raise ValueError(f"x_proj_weight: expected [dim={dim}, dt_rank + {projected} projected of B, C * dstate = "
                         f"{widths[0]}{' or ' + str(widths[1]) if len(widths) > 1 else ''}] (Paddle layout), got "
                         f"{list(x_proj_weight.shape)}")
    if out_proj_w.shape[0] != dim:
        raise ValueError(f"out_proj_weight: expected [dim={dim}, d_model] (Paddle layout), got "
                         f"{list(out_proj_weight.shape)}")
    d_model = out_proj_w.shape[1]
    for name, t, size in (("out_proj_bias", out_proj_bias, d_model), ("D", D, dim), ("delta_bias", delta_bias, dim),
                          ("B_proj_bias", B_proj_bias, dstate), ("C_proj_bias", C_proj_bias, dstate)):
        if t is not None:
            check_tensor(name, t)
            check_shape(name, t, [size])
    for name, t in (("B", B), ("C", C)):
        if t is not None:
            _check_bc(name, t, batch, dim, A.shape[1], seqlen, complex_A)
    for name, t, size, of in (("b_rms_weight", b_rms_weight, dstate, B), ("c_rms_weight", c_rms_weight, dstate, C),
                              ("dt_rms_weight", dt_rms_weight, dim, None)):
        if t is None:
            continue
        check_tensor(name, t)
        check_shape(name, t, [size])
        if complex_A:
            raise ValueError(f"{name}: the B/C/dt RMSNorms take real A only (mamba_ssm's), got A {T.dtype_name(A)}")
        if of is not None and of.ndim == 2:
            raise ValueError(f"{name}: normalises an input-dependent {name[0].upper()} over dstate; "
                             f"got a fixed {name[0].upper()} {list(of.shape)}")
    if not isinstance(b_c_dt_rms_eps, (int, float)) or isinstance(b_c_dt_rms_eps, bool) or \
            not b_c_dt_rms_eps >= 0:
        raise ValueError(f"b_c_dt_rms_eps: expected a float >= 0, got {b_c_dt_rms_eps!r}")
    deterministic = _deterministic_backward(
        deterministic, xz, conv_w, conv1d_bias, x_proj_w, delta_proj_w, out_proj_w, out_proj_bias, A, B, C, D,
        delta_bias, B_proj_bias, C_proj_bias, b_rms_weight, c_rms_weight, dt_rms_weight)
    chosen = resolve_backend("mamba_inner", backend, device_of(xz), implemented=SCAN_IMPLEMENTED,
                             unsupported=_scan_unsupported(complex_A, batch, A.shape[1],
                                                           _cuda_dtype_issue(xz, None, None, A, B, C, D, delta_bias),
                                                           deterministic),
                             prefer=COMPLEX_A_PREFER if complex_A else SCAN_AUTO_ORDER)
    if chosen == "reference" or xz.size == 0:
        return ref.mamba_inner_ref(xz, conv_w, conv1d_bias, x_proj_w, delta_proj_w, out_proj_w, out_proj_bias, A,
                                   B, C, D, delta_bias, B_proj_bias, C_proj_bias, delta_softplus, True,
                                   b_rms_weight, c_rms_weight, dt_rms_weight, float(b_c_dt_rms_eps))
    x_proj_w, delta_proj_w, out_proj_w = (w if w.dtype == xz.dtype else w.astype(xz.dtype)
                                          for w in (x_proj_w, delta_proj_w, out_proj_w))
    return MambaInnerFunction.apply(xz, conv_w, conv1d_bias, x_proj_w, delta_proj_w, out_proj_w, out_proj_bias, A,
                                    B, C, D, delta_bias, B_proj_bias, C_proj_bias, b_rms_weight, c_rms_weight,
                                    dt_rms_weight, float(b_c_dt_rms_eps), bool(delta_softplus), int(checkpoint_lvl),
                                    chosen, deterministic)
