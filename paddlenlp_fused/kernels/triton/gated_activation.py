"""Gated activations (SwiGLU, GeGLU): ``out = act(x[..., :H]) * x[..., H:]``.

Shapes: x ``[M, 2H]``, out ``[M, H]``, dout ``[M, H]``, dx ``[M, 2H]``; the last axis contiguous,
rows at any stride. ``act`` is silu (SwiGLU) or tanh-approximate gelu (GeGLU). Inputs of any float
dtype are upcast to fp32, computed in fp32 and cast on store.

Memory-bound: forward moves 3H elements a row, backward 5H (x and dout in, dx out); the backward
recomputes ``act(gate)`` from x rather than saving it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import tensor as T

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _act_and_grad(a, ACTIVATION: tl.constexpr):
    """act(a) and d act / d a for fp32 a (the forward kernel's unused gradient is dead code)."""
    if ACTIVATION == 0:  # silu
        s = _sigmoid(a)
        act = a * s
        grad = s * (1.0 + a * (1.0 - s))
    else:  # gelu, tanh approximation: 0.5 a (1 + tanh(u)) = a sigmoid(2u), with no 1 + tanh(u) that cancels
        # for negative a (a = -3 lost 1e-5 of fp32's relative accuracy that way)
        u = _SQRT_2_OVER_PI * (a + _GELU_C * a * a * a)
        s = _sigmoid(2.0 * u)
        act = a * s
        grad = s + 2.0 * a * s * (1.0 - s) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * a * a)
    return act, grad


@triton.jit
def _load_gate_up(x_ptr, M, H, stride_x, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_H] tile of gate and up (fp32), its 64-bit row indices,
    column indices and mask."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)[:, None]
    x_row = x_ptr + rows64 * stride_x + cols[None, :]
    gate = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + H, mask=mask, other=0.0).to(tl.float32)
    return gate, up, rows64, cols[None, :], mask


@triton.jit
def _gated_fwd_kernel(x_ptr, out_ptr, M, H, stride_x, stride_out,
                      ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    gate, up, rows64, cols, mask = _load_gate_up(x_ptr, M, H, stride_x, BLOCK_M, BLOCK_H)
    act, _ = _act_and_grad(gate, ACTIVATION)
    tl.store(out_ptr + rows64 * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(x_ptr, dout_ptr, dx_ptr, M, H, stride_x, stride_dout, stride_dx,
                      ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    gate, up, rows64, cols, mask = _load_gate_up(x_ptr, M, H, stride_x, BLOCK_M, BLOCK_H)
    dout = tl.load(dout_ptr + rows64 * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(gate, ACTIVATION)
    dx_row = dx_ptr + rows64 * stride_dx + cols
    tl.store(dx_row, (dout * up * dact).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_row + H, (dout * act).to(dx_ptr.dtype.element_ty), mask=mask)


def _launch_config(M: int, H: int):
    """Tiles of about 4096 elements (16 KB of fp32 work per operand), wide along H."""
    block_h = min(triton.next_power_of_2(max(H, 1)), 2048)
    block_m = max(1, min(4096 // block_h, triton.next_power_of_2(max(M, 1))))
    num_warps = 8 if block_m * block_h >= 4096 else 4
    grid = (triton.cdiv(M, block_m), triton.cdiv(H, block_h))
    return grid, block_m, block_h, num_warps


def _check(x, gated, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if len(T.shape(x)) != 2:
        raise ValueError(f"x: expected a 2-D tensor [M, 2H], got shape {T.shape(x)}")
    M, two_h = T.shape(x)
    if two_h % 2:
        raise ValueError(f"x: last axis must be even (2H), got {two_h}")
    T.check_rows("x", x, M, two_h)
    for name, t, width in gated:
        T.check_rows(name, t, M, width)
    return M, two_h // 2


def gated_activation_fwd(x, out, activation: str = "silu") -> None:
    """out[M, H] = act(x[:, :H]) * x[:, H:], written in place."""
    M, H = _check(x, [("out", out, T.shape(x)[1] // 2)], activation)
    if M == 0 or H == 0:
        return
    grid, block_m, block_h, num_warps = _launch_config(M, H)
    _gated_fwd_kernel[grid](x, out, M, H, T.strides(x)[0], T.strides(out)[0],
                            ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_H=block_h,
                            num_warps=num_warps)


def gated_activation_bwd(x, dout, dx, activation: str = "silu") -> None:
    """dx[M, 2H] = (dout * up * act'(gate), dout * act(gate)), written in place."""
    two_h = T.shape(x)[1]
    M, H = _check(x, [("dout", dout, two_h // 2), ("dx", dx, two_h)], activation)
    if M == 0 or H == 0:
        return
    grid, block_m, block_h, num_warps = _launch_config(M, H)
    _gated_bwd_kernel[grid](x, dout, dx, M, H, T.strides(x)[0], T.strides(dout)[0], T.strides(dx)[0],
                            ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_H=block_h,
                            num_warps=num_warps)


def compile_cases():
    """Launches the compile-only check runs (SpecTensor arguments): each dtype and activation, at a
    wide and a tiny hidden size."""
    for dtype in T.FLOAT_DTYPES:
        for activation in ACTIVATIONS:
            for M, H in ((16384, 14336), (3, 5)):
                x = T.SpecTensor((M, 2 * H), dtype)
                out, dx = T.SpecTensor((M, H), dtype), T.SpecTensor((M, 2 * H), dtype)
                yield f"gated_activation_fwd[{dtype},{activation},H={H}]", \
                    lambda x=x, out=out, a=activation: gated_activation_fwd(x, out, a)
                yield f"gated_activation_bwd[{dtype},{activation},H={H}]", \
                    lambda x=x, out=out, dx=dx, a=activation: gated_activation_bwd(x, out, dx, a)
