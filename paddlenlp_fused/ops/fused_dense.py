"""Fused dense layer and MLP: ``fused_dense_func`` and ``fused_mlp_func``.

Names and arguments follow ``flash_attn.ops.fused_dense``; weights are in Paddle's ``[in, out]``
layout. ``fused_mlp_func`` computes ``act(x @ weight1 + bias1) @ weight2 + bias2`` with activation
``gelu_approx`` (tanh), ``gelu`` (erf), ``relu``, ``sqrelu`` (relu squared), ``swiglu`` or ``geglu``;
the gated two take one fused weight1 ``[in, 2*hidden]`` whose first half of columns is the gate and
second half the up projection (``act(gate) * up``).

Policy (every decision of this module is here)
----------------------------------------------
backend        "auto": on a GPU the CUDA backend (cuBLASLt epilogues) when the library is built and
               cuBLASLt loads, else Triton; on the CPU Triton in interpreter mode, else the reference
               (Paddle autograd). Problems with an empty dimension run the reference.
activation     Where each activation, its derivative and the bias gradients run:
                 triton: GEMM1's epilogue applies gelu_approx / gelu / relu / sqrelu (saving the
                         pre-activation) and the input-gradient GEMM's epilogue their derivative;
                         bias gradients come with the weight-gradient GEMM (GEMM + column sums).
                 cuda:   every backward GEMM is a plain GEMM (no DGELU/DRELU epilogue: slower than the
                         plain GEMM plus a pass, and the 16-bit RELU_AUX mask disagrees with the sign
                         of the epilogue's own output near zero). gelu_approx goes into GEMM1's
                         GELU_AUX_BIAS epilogue when ``tuning.FWD_GELU_EPILOGUE``, for 16-bit dtypes
                         and a hidden width divisible by 8 (the saved pre-activation is then a plain
                         [M, H] tensor; float32 keeps GELU out of cuBLASLt, whose tanh is
                         approximate). Bias gradients: from BGRADA epilogues when
                         ``tuning.BGRAD_EPILOGUE``, else from Triton passes: the hidden bias's inside
                         the activation-backward pass (dpre = act'(pre) * dact, and its column sums),
                         the others by a column-sum pass. Measurements: benchmarks/NOTES.md.
               Otherwise GEMM1 adds the bias, an elementwise kernel applies the activation (the gated
               ones: gated_activation.py), and its backward runs between the input-gradient GEMM and
               the weight-gradient GEMM.
checkpoint_lvl 0 saves x, the pre-activation and the activation output; 1 saves x and the
               pre-activation and recomputes the activation output in backward; 2 saves only x and
               recomputes both. Gradients are bit-identical across levels because a recomputation
               repeats exactly the forward's computation: the elementwise activation (Triton's GEMM
               epilogue rounds the pre-activation before activating it, so the epilogue and the
               elementwise kernel agree bit for bit) or, for cuBLASLt's GELU epilogue, which activates
               the unrounded accumulator, GEMM1 itself (level 1 then costs what level 2 costs).
               ``record_saved_activations()`` measures the bytes each level keeps.
heuristic      "auto": per GEMM, the index into cuBLASLt's algorithm list that
               ``kernels.cuda.fused_dense_tuning.heuristic`` gives for its kind and shape (the
               fastest in the MLP benchmark, else 0); an int: that index for every GEMM. Ignored by
               Triton.
dtypes (AMP)   Weights and biases of float32 with float16 / bfloat16 x (AMP O1: master weights) are
               cast to x's dtype, and inside an active ``paddle.amp.auto_cast`` float32 x and
               parameters are cast to its dtype, as Paddle's O1 white list casts matmul's inputs;
               the casts are ordinary autograd ops, so float32 parameters get float32 gradients.
parallel       With ``process_group``: weight1/bias1 are this rank's column shard and weight2 its row
               shard. ``sequence_parallel``: x is this rank's rows (sequence axis 0), all-gathered
               before GEMM1 inside the fused function (x is saved sharded and gathered again in
               backward), and the output is reduce-scattered; otherwise x is replicated and the output
               all-reduced. bias2 is added after the reduction. x's gradient is reduce-scattered
               (sequence parallel) or all-reduced.
"""

from __future__ import annotations

import contextlib
from typing import List, NamedTuple, Optional

import paddle

from ..distributed import comm
from ..kernels.cuda import fused_dense_tuning as tuning
from ..kernels.triton import fused_dense as triton_kernels
from ..kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd
from ..reference.fused_dense import GATED, fused_dense_ref, fused_mlp_ref
from ..runtime import tensor as T
from ..runtime.backend import resolve_backend
from ..runtime.triton_paddle import triton_args, triton_scoped
from ._amp import amp_cast
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer

ACTIVATIONS = ("gelu_approx", "gelu", "relu", "sqrelu", "swiglu", "geglu")
_TRITON_EPILOGUE = frozenset({"gelu_approx", "gelu", "relu", "sqrelu"})
CHECKPOINT_LEVELS = (0, 1, 2)
_recorders: List[List[int]] = []


@contextlib.contextmanager
def record_saved_activations():
    """Yields a list that receives, for each fused MLP / dense call in the block that saves tensors
    for backward, the bytes of the activations it saved (weights not counted)."""
    record: List[int] = []
    _recorders.append(record)
    try:
        yield record
    finally:
        _recorders.remove(record)


def _record(tensors) -> None:
    if _recorders:
        n = sum(int(t.numel()) * T.itemsize(t) for t in tensors)
        for record in _recorders:
            record.append(n)


def _empty(shape, like, dtype=None):
    return paddle.empty(list(shape), dtype=dtype or like.dtype, device=like.place)


# ---- kernel sets: one interface over the Triton and the cuBLASLt backends, on 2-D tensors --------

def _elementwise_act(pre, activation):
    """The activation output of a pre-activation (gated: [M, 2H] -> [M, H])."""
    if activation in GATED:
        out = _empty([pre.shape[0], pre.shape[1] // 2], pre)
        gated_activation_fwd(*triton_args(pre, out), activation=GATED[activation])
    else:
        out = _empty(pre.shape, pre)
        triton_kernels.act_fwd(*triton_args(pre, out), activation=activation)
    return out


def _elementwise_act_bwd(pre, dact, activation, with_dbias=False):
    """(dpre, its column sums when ``with_dbias`` (non-gated activations) else None)."""
    dpre = _empty(pre.shape, pre)
    if activation in GATED:
        gated_activation_bwd(*triton_args(pre, dact, dpre), activation=GATED[activation])
        return dpre, None
    if with_dbias:
        dbias = _empty([pre.shape[1]], pre)
        partial = _empty(triton_kernels.colsum_partial_shape(*pre.shape), pre, "float32")
        triton_kernels.act_bwd_dbias(*triton_args(pre, dact, dpre, dbias, partial), activation=activation)
        return dpre, dbias
    triton_kernels.act_bwd(*triton_args(pre, dact, dpre), activation=activation)
    return dpre, None


class _TritonKernels:
    name = "triton"
    bwd_epilogue = _TRITON_EPILOGUE
    dbias_in_act_pass = False  # the bias gradient comes with the weight-gradient GEMM
    recompute_by_gemm = False  # the epilogue's activation equals the elementwise kernel's

    def __init__(self, heuristic: Optional[int], dtype: str):
        del heuristic, dtype  # Triton autotunes; every dtype takes every epilogue

    def fuses_forward(self, activation: str, width: int) -> bool:
        """Whether GEMM1's epilogue applies ``activation`` (and saves the pre-activation)."""
        return activation in _TRITON_EPILOGUE

    def linear(self, x, w, bias=None, activation="none", with_aux=False):
        """(act(x @ w + bias), saved pre-activation or None)."""
        out = _empty([x.shape[0], w.shape[1]], x)
        aux = _empty(out.shape, x) if with_aux else None
        a, b, c, bias_, pre = triton_args(x, w, out, bias, aux)
        triton_kernels.gemm(a, b, c, bias=bias_, activation=activation, pre=pre)
        return out, aux

    def linear_t(self, dy, w):
        """dy @ w^T."""
        out = _empty([dy.shape[0], w.shape[0]], dy)
        triton_kernels.gemm(*triton_args(dy, w, out), trans_b=True)
        return out

    def wgrad(self, x, dy, with_dbias):
        """(x^T @ dy, dy.sum(0) or None) from one GEMM."""
        dw = _empty([x.shape[1], dy.shape[1]], x)
        db = _empty([dy.shape[1]], dy) if with_dbias else None
        a, b, c, dbias = triton_args(x, dy, dw, db)
        triton_kernels.gemm(a, b, c, dbias=dbias, trans_a=True)
        return dw, db

    def linear_act_grad(self, dy, w, pre, activation):
        """act'(pre) * (dy @ w^T); the bias gradient comes with the weight-gradient GEMM."""
        dpre = _empty([dy.shape[0], w.shape[0]], dy)
        a, b, c, pre_ = triton_args(dy, w, dpre, pre)
        triton_kernels.gemm(a, b, c, activation=activation, pre=pre_, act_grad=True, trans_b=True)
        return dpre


class _CudaKernels:
    name = "cuda"
    bwd_epilogue = frozenset()
    recompute_by_gemm = True  # cuBLASLt activates the unrounded accumulator: only GEMM1 repeats it
    _workspace_bytes: dict = {}

    def __init__(self, heuristic: Optional[int], dtype: str):
        from ..kernels.cuda import fused_dense as cuda_kernels

        self.k = cuda_kernels
        self.fixed_heuristic = heuristic
        self.dtype = dtype
        gelu = tuning.FWD_GELU_EPILOGUE and dtype != "float32"
        self.fwd_epilogue = frozenset({"gelu_approx"}) if gelu else frozenset()
        self.bgrad_epilogue = tuning.BGRAD_EPILOGUE
        self.dbias_in_act_pass = not self.bgrad_epilogue

    def heuristic(self, kind, M, N, K) -> int:
        if self.fixed_heuristic is not None:
            return self.fixed_heuristic
        return tuning.heuristic(kind, self.dtype, M, N, K)

    def fuses_forward(self, activation: str, width: int) -> bool:
        return activation in self.fwd_epilogue and width % 8 == 0

    def workspace(self, like):
        """A fresh workspace per GEMM (from Paddle's caching allocator, ordered on the stream), so
        nothing stays allocated between forward and backward."""
        device = like.place.gpu_device_id()
        if device not in self._workspace_bytes:
            self._workspace_bytes[device] = self.k.workspace_bytes(device)
        return _empty([self._workspace_bytes[device]], like, "uint8")

    def linear(self, x, w, bias=None, activation="none", with_aux=False):
        M, N = x.shape[0], w.shape[1]
        out = _empty([M, N], x)
        aux = None
        if with_aux:
            shape, dtype = self.k.aux_shape(activation, M, N)
            aux = _empty(shape, x, dtype)
        kind = ("fwd_bias" if bias is not None else "fwd") + ("_gelu_aux" if activation == "gelu_approx" else "")
        self.k.linear_act_fwd(x, w, out, self.workspace(x), bias=bias, activation=activation, aux=aux,
                              heuristic=self.heuristic(kind, M, N, x.shape[1]))
        return out, aux

    def linear_t(self, dy, w):
        out = _empty([dy.shape[0], w.shape[0]], dy)
        self.k.linear_act_fwd(dy, w, out, self.workspace(dy), weight_transposed=True,
                              heuristic=self.heuristic("dgrad", dy.shape[0], w.shape[0], w.shape[1]))
        return out

    def wgrad(self, x, dy, with_dbias):
        dw = _empty([x.shape[1], dy.shape[1]], x)
        in_epilogue = with_dbias and self.bgrad_epilogue
        db = _empty([dy.shape[1]], dy) if with_dbias else None
        self.k.linear_wgrad(x, dy, dw, self.workspace(x), dbias=db if in_epilogue else None,
                            heuristic=self.heuristic("wgrad_bgrad" if in_epilogue else "wgrad", x.shape[1],
                                                     dy.shape[1], x.shape[0]))
        if with_dbias and not in_epilogue:
            partial = _empty(triton_kernels.colsum_partial_shape(*dy.shape), dy, "float32")
            triton_kernels.column_sum(*triton_args(dy, db, partial))
        return dw, db


_KERNELS = {"triton": _TritonKernels, "cuda": _CudaKernels}


# ---- the MLP's steps, shared by forward, recomputation and the no-grad path ----------------------

def _act_linear(kernels, x, w1, b1, activation):
    """GEMM1 and the activation: (activation output, saved pre-activation)."""
    if kernels.fuses_forward(activation, w1.shape[1]):
        return kernels.linear(x, w1, b1, activation, with_aux=True)
    pre, _ = kernels.linear(x, w1, b1)
    return _elementwise_act(pre, activation), pre


def _recompute_activation(kernels, x, w1, b1, pre, activation):
    """Level 1: the activation output again, bit-identical to the forward's."""
    if kernels.recompute_by_gemm and kernels.fuses_forward(activation, w1.shape[1]):
        return kernels.linear(x, w1, b1, activation, with_aux=True)[0]
    return _elementwise_act(pre, activation)


class _Config(NamedTuple):
    kernels: object
    activation: str
    checkpoint_lvl: int
    pg: Optional[comm.ParallelGroup]
    sequence_parallel: bool
    bias2_in_epilogue: bool


def _gather_input(x2d, cfg):
    return comm.all_gather_sequence(x2d, cfg.pg) if cfg.pg is not None and cfg.sequence_parallel else x2d


def _reduce_input_grad(dx, cfg):
    """What x's gradient needs from the other ranks (the gathered input was used on every rank)."""
    if cfg.pg is None:
        return dx
    if cfg.sequence_parallel:
        return comm.reduce_scatter_sequence(dx, cfg.pg)
    return comm.reduce_from_parallel(dx, cfg.pg)


def _bias_grad(dy):
    return dy.astype("float32").sum(axis=0).astype(dy.dtype)


class _FusedMLPFunction(TritonPyLayer):
    op = "fused_mlp_func"

    @staticmethod
    def forward(ctx, x2d, weight1, weight2, bias1, bias2, cfg):
        K = cfg.kernels
        total_x = _gather_input(x2d, cfg)
        out1, aux = _act_linear(K, total_x, weight1, bias1, cfg.activation)
        out, _ = K.linear(out1, weight2, bias2 if cfg.bias2_in_epilogue else None)
        saved = [x2d, aux, out1][: 3 - cfg.checkpoint_lvl]
        _record(saved)
        ctx.save_for_backward(weight1, weight2, bias1, *saved)
        ctx.cfg = cfg
        ctx.has_bias = (bias1 is not None, bias2 is not None)
        ctx.needs = [not t.stop_gradient for t in (x2d, weight1, weight2, bias1, bias2) if t is not None]
        return out

    @staticmethod
    def backward(ctx, dout):
        cfg, K = ctx.cfg, ctx.cfg.kernels
        weight1, weight2, bias1, x2d, *saved = ctx.saved_tensor()
        need_x, need_w1, need_w2, *need_b = ctx.needs
        need_b1 = ctx.has_bias[0] and need_b.pop(0)
        need_b2 = ctx.has_bias[1] and need_b.pop(0)
        dout = contiguous(dout)
        total_x = _gather_input(x2d, cfg)
        if cfg.checkpoint_lvl == 2:
            out1, aux = _act_linear(K, total_x, weight1, bias1, cfg.activation)
        elif cfg.checkpoint_lvl == 1:
            (aux,) = saved
            out1 = _recompute_activation(K, total_x, weight1, bias1, aux, cfg.activation) if need_w2 else None
        else:
            aux, out1 = saved

        dw2 = db2 = None
        if need_w2:
            dw2, db2 = K.wgrad(out1, dout, with_dbias=need_b2)
        elif need_b2:
            db2 = _bias_grad(dout)
        del out1
        db1 = None
        if cfg.activation in K.bwd_epilogue:
            dpre = K.linear_act_grad(dout, weight2, aux, cfg.activation)
        else:
            dpre, db1 = _elementwise_act_bwd(aux, K.linear_t(dout, weight2), cfg.activation,
                                             with_dbias=need_b1 and K.dbias_in_act_pass)
        del aux
        dw1 = None
        if need_w1:
            dw1, db1_gemm = K.wgrad(total_x, dpre, with_dbias=need_b1 and db1 is None)
            db1 = db1 if db1 is not None else db1_gemm
        elif need_b1 and db1 is None:
            db1 = _bias_grad(dpre)
        dx = _reduce_input_grad(K.linear_t(dpre, weight1), cfg) if need_x else None
        grads = [dx, dw1, dw2]
        if ctx.has_bias[0]:
            grads.append(db1)
        if ctx.has_bias[1]:
            grads.append(db2)
        return tuple(grads)


class _FusedDenseFunction(TritonPyLayer):
    op = "fused_dense_func"

    @staticmethod
    def forward(ctx, x2d, weight, bias, cfg):
        total_x = _gather_input(x2d, cfg)
        out, _ = cfg.kernels.linear(total_x, weight, bias)
        _record([x2d])
        ctx.save_for_backward(x2d, weight)
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.needs = [not t.stop_gradient for t in (x2d, weight, bias) if t is not None]
        return out

    @staticmethod
    def backward(ctx, dout):
        cfg, K = ctx.cfg, ctx.cfg.kernels
        x2d, weight = ctx.saved_tensor()
        need_x, need_w, *need_b = ctx.needs
        need_b = ctx.has_bias and need_b[0]
        dout = contiguous(dout)
        dw = db = None
        if need_w:
            dw, db = K.wgrad(_gather_input(x2d, cfg), dout, with_dbias=need_b)
        elif need_b:
            db = _bias_grad(dout)
        dx = _reduce_input_grad(K.linear_t(dout, weight), cfg) if need_x else None
        return (dx, dw, db) if ctx.has_bias else (dx, dw)


# ---- argument checks and dispatch ----------------------------------------------------------------

def _check_weight(name, w, rows, dtype, what):
    check_tensor(name, w, min_ndim=2)
    if w.ndim != 2 or (rows is not None and w.shape[0] != rows):
        raise ValueError(f"{name}: expected shape [{rows if rows is not None else 'in'}, out] ({what}), "
                         f"got {list(w.shape)}")
    if w.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {T.dtype_name(dtype)} (x's), got {T.dtype_name(w)}")


def _check_bias(name, b, size, dtype):
    if b is None:
        return
    check_tensor(name, b)
    if list(b.shape) != [size]:
        raise ValueError(f"{name}: expected shape [{size}], got {list(b.shape)}")
    if b.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {T.dtype_name(dtype)} (x's), got {T.dtype_name(b)}")


def _resolve_heuristic(heuristic) -> Optional[int]:
    """None for "auto" (the tuning table's index per GEMM), else the index for every GEMM."""
    if heuristic == "auto":
        return None
    if isinstance(heuristic, bool) or not isinstance(heuristic, int) or heuristic < 0:
        raise ValueError(f"heuristic: expected 'auto' or an index >= 0 into cuBLASLt's algorithm list, "
                         f"got {heuristic!r}")
    return heuristic


def _choose_backend(op, backend, x, dims):
    """The backend that runs this call: the chosen one, but the reference (no launch) for a problem
    with an empty dimension, which the launchers do not take."""
    def unsupported(name):
        if name == "cuda":
            from ..kernels.cuda import fused_dense as cuda_kernels

            ok, why = cuda_kernels.status()
            return None if ok else why
        return None

    chosen = resolve_backend(op, backend, device_of(x), implemented=("cuda", "triton", "reference"),
                             unsupported=unsupported)
    return "reference" if min(dims) == 0 else chosen


def _needs_grad(*tensors) -> bool:
    return paddle.is_grad_enabled() and any(t is not None and not t.stop_gradient for t in tensors)


def _check_parallel(x, pg, sequence_parallel):
    if pg is not None and sequence_parallel and x.ndim < 2:
        raise ValueError(f"x: sequence parallel needs a sequence axis 0 and a feature axis, got shape {list(x.shape)}")


def _lead_shape(x, pg, sequence_parallel):
    """The output's leading axes: x's, with axis 0 gathered when sequence parallel."""
    lead = list(x.shape[:-1])
    if pg is not None and sequence_parallel:
        lead[0] = lead[0] * pg.world_size
    return lead


@triton_scoped
def fused_dense_func(x: paddle.Tensor, weight: paddle.Tensor, bias: Optional[paddle.Tensor] = None,
                     return_residual: bool = False, process_group=None, sequence_parallel: bool = False,
                     backend: str = "auto"):
    """x [..., in] @ weight [in, out] + bias [out] in one GEMM (bias in the epilogue; backward: the
    weight and bias gradients from one GEMM). With ``return_residual`` returns (out, x).

    With ``process_group`` (a column-parallel linear): weight/bias are this rank's output shard;
    with ``sequence_parallel`` x is this rank's rows, all-gathered inside (and its gradient
    reduce-scattered), else x is replicated (its gradient all-reduced). The output is not reduced.
    """
    check_tensor("x", x)
    residual = x
    x, (weight, bias) = amp_cast(x, [weight, bias])
    _check_weight("weight", weight, x.shape[-1], x.dtype, "x's last axis = in")
    _check_bias("bias", bias, weight.shape[1], x.dtype)
    pg = comm.as_parallel_group(process_group)
    _check_parallel(x, pg, sequence_parallel)
    rows = 1
    for s in x.shape[:-1]:
        rows *= s
    chosen = _choose_backend("fused_dense", backend, x, (rows, weight.shape[0], weight.shape[1]))
    if chosen == "reference":
        x_in = x
        if pg is not None:
            x_in = comm.all_gather_sequence(x, pg) if sequence_parallel else comm.copy_to_parallel(x, pg)
        out = fused_dense_ref(x_in, weight, bias)
    else:
        cfg = _Config(_KERNELS[chosen](None, T.dtype_name(x)), "none", 0, pg, sequence_parallel, True)
        x2d = contiguous(x).reshape([-1, x.shape[-1]])
        weight, bias = contiguous(weight), contiguous(bias)  # the launchers take contiguous operands only
        if _needs_grad(x, weight, bias):
            out2d = _FusedDenseFunction.apply(x2d, weight, bias, cfg)
        else:
            out2d = cfg.kernels.linear(_gather_input(x2d, cfg), weight, bias)[0]
        out = out2d.reshape(_lead_shape(x, pg, sequence_parallel) + [weight.shape[1]])
    return (out, residual) if return_residual else out


def check_mlp_options(activation: str, checkpoint_lvl: int) -> None:
    """The MLP's activation and checkpoint level are ones we implement (also checked by the layers
    when they are built)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
    if checkpoint_lvl not in CHECKPOINT_LEVELS:
        raise ValueError(f"checkpoint_lvl: expected 0, 1 or 2, got {checkpoint_lvl!r}")


@triton_scoped
def fused_mlp_func(x: paddle.Tensor, weight1: paddle.Tensor, weight2: paddle.Tensor,
                   bias1: Optional[paddle.Tensor] = None, bias2: Optional[paddle.Tensor] = None,
                   activation: str = "gelu_approx", checkpoint_lvl: int = 0, heuristic="auto",
                   return_residual: bool = False, process_group=None, sequence_parallel: bool = False,
                   backend: str = "auto"):
    """act(x [..., in] @ weight1 [in, hidden'] + bias1) @ weight2 [hidden, out] + bias2, fused (see the
    module docstring for the policy); hidden' = 2 * hidden for swiglu / geglu. With
    ``return_residual`` returns (out, x)."""
    check_tensor("x", x)
    check_mlp_options(activation, checkpoint_lvl)
    heuristic_index = _resolve_heuristic(heuristic)
    residual = x
    x, (weight1, weight2, bias1, bias2) = amp_cast(x, [weight1, weight2, bias1, bias2])
    _check_weight("weight1", weight1, x.shape[-1], x.dtype, "x's last axis = in")
    _check_weight("weight2", weight2, None, x.dtype, "[hidden, out]")
    hidden = weight2.shape[0]
    width1 = 2 * hidden if activation in GATED else hidden
    if weight1.shape[1] != width1:
        raise ValueError(f"weight1: expected {width1} columns ({'2 * ' if activation in GATED else ''}weight2's "
                         f"{hidden} rows for activation {activation!r}), got shape {list(weight1.shape)}")
    _check_bias("bias1", bias1, width1, x.dtype)
    _check_bias("bias2", bias2, weight2.shape[1], x.dtype)
    pg = comm.as_parallel_group(process_group)
    _check_parallel(x, pg, sequence_parallel)
    rows = 1
    for s in x.shape[:-1]:
        rows *= s
    chosen = _choose_backend("fused_mlp", backend, x, (rows, x.shape[-1], hidden, weight2.shape[1]))
    bias2_in_epilogue = pg is None
    if chosen == "reference":
        x_in = x
        if pg is not None:
            x_in = comm.all_gather_sequence(x, pg) if sequence_parallel else comm.copy_to_parallel(x, pg)
        out = fused_mlp_ref(x_in, weight1, weight2, bias1, bias2 if bias2_in_epilogue else None, activation)
    else:
        cfg = _Config(_KERNELS[chosen](heuristic_index, T.dtype_name(x)), activation, checkpoint_lvl, pg,
                      sequence_parallel, bias2_in_epilogue)
        x2d = contiguous(x).reshape([-1, x.shape[-1]])
        # the launchers take contiguous operands only
        weight1, weight2, bias1 = contiguous(weight1), contiguous(weight2), contiguous(bias1)
        b2 = contiguous(bias2) if bias2_in_epilogue else None
        if _needs_grad(x, weight1, weight2, bias1, b2):
            out2d = _FusedMLPFunction.apply(x2d, weight1, weight2, bias1, b2, cfg)
        else:
            K = cfg.kernels
            total_x = _gather_input(x2d, cfg)
            if K.fuses_forward(activation, weight1.shape[1]):
                out1 = K.linear(total_x, weight1, bias1, activation)[0]
            else:
                out1 = _elementwise_act(K.linear(total_x, weight1, bias1)[0], activation)
            out2d = K.linear(out1, weight2, b2)[0]
        out = out2d.reshape(_lead_shape(x, pg, sequence_parallel) + [weight2.shape[1]])
    if pg is not None:
        out = comm.reduce_scatter_sequence(out, pg) if sequence_parallel else comm.reduce_from_parallel(out, pg)
        if bias2 is not None:
            out = out + bias2
    return (out, residual) if return_residual else out
