"""Causal depthwise conv1d ops (``causal_conv1d``'s signatures, plus ``backend=``).

* ``causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
  return_final_states=False, final_states_out=None, activation=None)``: x ``[batch, dim, seqlen]``,
  weight ``[dim, width]`` (or Conv1D's ``[dim, 1, width]``), any width; activation None, "silu" or
  "swish"; ``seq_idx`` ``[batch, seqlen]`` resets the conv at sequence boundaries of a packed batch
  (a negative id marks padding: output 0 there); ``initial_states`` / final states
  ``[batch, dim, width - 1]``; ``deterministic`` (None: ``FLAGS_cudnn_deterministic``) sums the
  weight gradients in a fixed order.
* ``causal_conv1d_update``: decoding step(s), state updated in place (no autograd), optionally a
  slot of a state cache per row (``conv_state_indices``).
* ``causal_conv1d_varlen_states``: the final conv states of each sequence of a packed batch.

Backends: ``cuda`` (``csrc/causal_conv1d.cu``, widths 2 to 4) and ``triton``
(``kernels/triton/causal_conv1d.py``, any width), each inside the same PyLayer, and ``reference``
(pure Paddle, float32). ``causal_conv1d_update`` has the same three. The CUDA kernels take neither
``seq_idx`` (they know no padding id), a deterministic backward nor ``conv_state_indices``: ``auto``
takes Triton for those, an explicit ``backend="cuda"`` raises ``BackendUnavailableError``.
"""

from __future__ import annotations

import paddle

from ..kernels.cuda import causal_conv1d as cuda_conv
from ..kernels.triton import causal_conv1d as conv_kernels
from ..reference import mamba as ref
from ..runtime.backend import gpu_order, resolve_backend
from ..runtime.determinism import deterministic_requested
from ..runtime.triton_paddle import triton_args, triton_scoped
from ._checks import check_tensor, contiguous, device_of
from ._pylayer import TritonPyLayer, cast_like, check_shape, empty_on, grads_for, needs_grad, run_in_place, zeros32_on

IMPLEMENTED = ("cuda", "triton", "reference")
CONV_ACTIVATIONS = (None, "silu", "swish")
_INT_DTYPES = ("int32", "int64")


def conv_weight(weight, dim=None):
    """A [dim, width] view of weight ([dim, width] or Conv1D's [dim, 1, width])."""
    check_tensor("weight", weight)
    if weight.ndim == 3 and weight.shape[1] == 1:
        weight = weight.reshape([weight.shape[0], weight.shape[2]])
    if weight.ndim != 2 or (dim is not None and weight.shape[0] != dim) or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [dim={dim}, width >= 1] (or [dim, 1, width]), got {list(weight.shape)}")
    return weight


def _check_activation(activation):
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")


def _check_conv_args(x, weight, bias, seq_idx, initial_states, activation):
    check_tensor("x", x)
    if x.ndim != 3:
        raise ValueError(f"x: expected [batch, dim, seqlen], got shape {list(x.shape)}")
    batch, dim, seqlen = x.shape
    weight = conv_weight(weight, dim)
    width = weight.shape[1]
    _check_activation(activation)
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, [dim])
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, float_dtypes=_INT_DTYPES)
        check_shape("seq_idx", seq_idx, [batch, seqlen])
    if initial_states is not None:
        check_tensor("initial_states", initial_states)
        if width < 2:
            raise ValueError("initial_states: a width-1 conv has no state")
        check_shape("initial_states", initial_states, [batch, dim, width - 1])
    return weight


# ``auto`` on the GPU tries Triton first, then CUDA (Triton is faster at the benchmark shape:
# benchmarks/results/causal_conv1d.json). The decoding step follows the same order (not timed).
AUTO_ORDER = gpu_order("causal_conv1d")
_KERNELS = {"triton": conv_kernels, "cuda": cuda_conv}


def cuda_unsupported(width: int, seqlen: int = 0, seq_idx: bool = False, deterministic: bool = False,
                     state_indices: bool = False):
    """Why the CUDA kernels cannot take this conv (x made contiguous), or None."""
    if not cuda_conv.MIN_WIDTH <= width <= cuda_conv.MAX_WIDTH:
        return f"width {width} (the CUDA kernels take {cuda_conv.MIN_WIDTH} to {cuda_conv.MAX_WIDTH})"
    if seqlen > cuda_conv.MAX_SEQLEN_CHANNEL_FIRST:
        return f"seqlen {seqlen} (the CUDA kernels take at most {cuda_conv.MAX_SEQLEN_CHANNEL_FIRST})"
    if seq_idx:
        return "seq_idx (the CUDA kernels do not treat negative ids as padding; Triton and reference do)"
    if deterministic:
        return "deterministic (the CUDA backward reduces the weight gradients with atomics)"
    if state_indices:
        return "conv_state_indices (the CUDA decoding kernel has no state cache)"
    return None


def choose_backend(op, backend, x, width, seq_idx=False, deterministic=False, state_indices=False):
    """The backend for one conv (see ``resolve_backend``)."""
    seqlen = x.shape[2] if x.ndim == 3 else 1
    return resolve_backend(op, backend, device_of(x), implemented=IMPLEMENTED, prefer=AUTO_ORDER,
                           unsupported=lambda name: cuda_unsupported(width, seqlen, seq_idx, deterministic,
                                                                     state_indices) if name == "cuda" else None)


def check_state_indices(name, indices, batch, slots):
    """A state-cache index tensor: int32/int64 ``[batch]``, every entry < ``slots`` (negative: a
    padding row). Reads the indices on the host (one small copy), so that no kernel reads out of
    bounds on any backend."""
    check_tensor(name, indices, float_dtypes=_INT_DTYPES)
    check_shape(name, indices, [batch])
    if batch and int(indices.max()) >= slots:
        raise ValueError(f"{name}: expected entries < {slots} (the state's slots; negative for padding), "
                         f"got {int(indices.max())}")


def _launch(backend, name, *tensors, **options):
    """Launcher ``name`` of ``backend`` on positional tensors (wrapped for Triton)."""
    if backend == "triton":
        tensors = triton_args(*tensors)
    getattr(_KERNELS[backend], name)(*tensors, **options)


def conv_launch_fwd(x, weight, bias, seq_idx, initial_states, activation, backend="triton"):
    """out = act(conv(x)) on ``backend`` ('triton' or 'cuda'; 'auto' chooses as ``causal_conv1d_fn``)."""
    if backend not in _KERNELS:
        backend = choose_backend("causal_conv1d", backend, x, weight.shape[-1])
    out = empty_on(x.shape, x.dtype, x)
    _launch(backend, "causal_conv1d_fwd", x, weight, out, bias, seq_idx, initial_states, activation=activation)
    return out


def conv_launch_bwd(x, weight, bias, seq_idx, initial_states, dout, activation, backend="triton",
                    deterministic=None):
    """(dx, dweight, dbias, dinitial_states) in the inputs' dtypes, on ``backend`` (as ``conv_launch_fwd``).
    ``deterministic`` (None: ``FLAGS_cudnn_deterministic``) reduces the weight gradients in a fixed
    order (Triton only: a CUDA ``backend`` raises BackendUnavailableError)."""
    deterministic = deterministic_requested(deterministic)
    if backend not in _KERNELS or (backend == "cuda" and deterministic):
        backend = choose_backend("causal_conv1d", backend, x, weight.shape[-1], deterministic=deterministic)
    dx = empty_on(x.shape, x.dtype, x)
    dweight = zeros32_on(weight.shape, x)
    dbias = None if bias is None else zeros32_on(bias.shape, x)
    dinit = None if initial_states is None else empty_on(initial_states.shape, initial_states.dtype, x)
    options = {"activation": activation}
    if deterministic:
        options["workspace"] = triton_args(empty_on(conv_kernels.bwd_workspace_shape(x, weight), "float32", x))[0]
    _launch(backend, "causal_conv1d_bwd", x, weight, contiguous(dout), dx, dweight, bias, dbias, seq_idx,
            initial_states, dinit, **options)
    return dx, cast_like(dweight, weight), cast_like(dbias, bias), dinit


class CausalConv1dFunction(TritonPyLayer):
    op = "causal_conv1d_fn"

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_states, activation, backend, deterministic):
        x, weight, bias, seq_idx, initial_states = (contiguous(t) for t in (x, weight, bias, seq_idx, initial_states))
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        ctx.activation, ctx.backend, ctx.deterministic = activation, backend, deterministic
        ctx.needs_grad = needs_grad(x, weight, bias, seq_idx, initial_states)
        return conv_launch_fwd(x, weight, bias, seq_idx, initial_states, activation, backend)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, seq_idx, initial_states = ctx.saved_tensor()
        dx, dweight, dbias, dinit = conv_launch_bwd(x, weight, bias, seq_idx, initial_states, dout, ctx.activation,
                                                    ctx.backend, ctx.deterministic)
        grads = [dx, dweight] + [g for g, t in ((dbias, bias), (None, seq_idx), (dinit, initial_states))
                                 if t is not None]
        return grads_for(ctx, grads)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, backend: str = "auto", deterministic=None):
    """Depthwise causal conv (see the module docstring). Returns out in x's dtype, and with
    ``return_final_states`` also the last width - 1 inputs ``[batch, dim, width - 1]`` (written into
    ``final_states_out`` when given; differentiable otherwise). ``deterministic``: None follows
    ``FLAGS_cudnn_deterministic``; True makes the weight gradients bit-reproducible (no atomics)."""
    weight = _check_conv_args(x, weight, bias, seq_idx, initial_states, activation)
    deterministic = deterministic_requested(deterministic)
    width = weight.shape[1]
    if return_final_states and width < 2:
        raise ValueError("return_final_states: a width-1 conv has no state")
    if final_states_out is not None:
        check_tensor("final_states_out", final_states_out)
        check_shape("final_states_out", final_states_out, [x.shape[0], x.shape[1], width - 1])
    chosen = choose_backend("causal_conv1d", backend, x, width, seq_idx is not None, deterministic)
    if chosen == "reference" or x.size == 0:
        return ref.causal_conv1d_ref(x, weight, bias, seq_idx, initial_states, return_final_states,
                                     final_states_out, activation)
    out = CausalConv1dFunction.apply(x, weight, bias, seq_idx, initial_states, activation, chosen, deterministic)
    if not return_final_states:
        return out
    # the last width - 1 inputs: a slice of (initial_states, x), differentiable by Paddle
    history = x if x.shape[-1] >= width - 1 else paddle.concat(
        [initial_states if initial_states is not None else paddle.zeros([x.shape[0], x.shape[1], width - 1],
                                                                        dtype=x.dtype), x], axis=-1)
    final = history[:, :, history.shape[-1] - (width - 1):]
    if final_states_out is not None:
        paddle.assign(final.detach(), output=final_states_out)
        return out, final_states_out
    return out, final


@triton_scoped
def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, backend: str = "auto"):
    """Decoding step(s) of the causal conv: x ``[batch, dim]`` or ``[batch, dim, seqlen]`` new tokens;
    conv_state ``[batch, dim, state_len >= width - 1]`` updated in place (the last inputs, or with
    ``cache_seqlens`` ``[batch]`` a ring buffer where token i goes to ``(cache_seqlens + i) % state_len``).
    With ``conv_state_indices`` ``[batch]`` (int32/int64; continuous batching) conv_state is a cache
    ``[slots, dim, state_len]`` and row b uses slot ``conv_state_indices[b]``; a negative index is a
    padding row (output 0, no slot touched), as in causal-conv1d. Returns out shaped like x."""
    check_tensor("x", x)
    if x.ndim not in (2, 3):
        raise ValueError(f"x: expected [batch, dim] or [batch, dim, seqlen], got shape {list(x.shape)}")
    batch, dim = x.shape[:2]
    weight = conv_weight(weight, dim)
    width = weight.shape[1]
    _check_activation(activation)
    check_tensor("conv_state", conv_state)
    slots = batch if conv_state_indices is None else conv_state.shape[0] if conv_state.ndim else -1
    if conv_state.ndim != 3 or list(conv_state.shape[:2]) != [slots, dim] or conv_state.shape[2] < width - 1:
        lead = "batch" if conv_state_indices is None else "slots"
        raise ValueError(f"conv_state: expected [{lead}={slots}, dim={dim}, state_len >= width - 1 = {width - 1}], "
                         f"got {list(conv_state.shape)}")
    if conv_state_indices is not None:
        check_state_indices("conv_state_indices", conv_state_indices, batch, slots)
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, [dim])
    if cache_seqlens is not None:
        check_tensor("cache_seqlens", cache_seqlens, float_dtypes=_INT_DTYPES)
        check_shape("cache_seqlens", cache_seqlens, [batch])
    chosen = choose_backend("causal_conv1d_update", backend, x, width, state_indices=conv_state_indices is not None)
    with paddle.no_grad():
        if chosen == "reference" or x.size == 0:
            return ref.causal_conv1d_update_ref(x, conv_state, weight, bias, activation, cache_seqlens,
                                                conv_state_indices)
        x, weight, bias, cache_seqlens = (contiguous(t) for t in (x, weight, bias, cache_seqlens))
        out = empty_on(x.shape, x.dtype, x)
        seqlens = cache_seqlens if chosen == "cuda" or cache_seqlens is None else triton_args(cache_seqlens)[0]
        options = {"activation": activation, "cache_seqlens": seqlens}
        if conv_state_indices is not None:  # Triton only
            options["conv_state_indices"] = triton_args(contiguous(conv_state_indices))[0]
        run_in_place(conv_state, lambda state: _launch(chosen, "causal_conv1d_update", x, state, weight, out, bias,
                                                       **options))
        return out


@triton_scoped
def causal_conv1d_varlen_states(x, cu_seqlens, state_len, backend: str = "auto"):
    """causal-conv1d's ``causal_conv1d_varlen_states``: the last ``state_len`` inputs of each sequence
    of a packed batch (the conv states to continue decoding from), no autograd. x
    ``[total_tokens, dim]``; cu_seqlens ``[batch + 1]`` int32/int64, sorted, from 0, last <=
    total_tokens. Returns states ``[batch, dim, state_len]`` in x's dtype, zeros before a sequence's
    first token. Backends: ``triton``, ``reference``."""
    check_tensor("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: expected [total_tokens, dim], got shape {list(x.shape)}")
    check_tensor("cu_seqlens", cu_seqlens, float_dtypes=_INT_DTYPES)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens: expected [batch + 1], got shape {list(cu_seqlens.shape)}")
    if isinstance(state_len, bool) or not isinstance(state_len, int) or state_len < 0:
        raise ValueError(f"state_len: expected an int >= 0, got {state_len!r}")
    bounds = cu_seqlens.numpy()  # a few integers; read here so that no backend indexes out of x
    if bounds[0] != 0 or (bounds[1:] < bounds[:-1]).any() or bounds[-1] > x.shape[0]:
        raise ValueError(f"cu_seqlens: expected sorted offsets from 0 to at most total_tokens={x.shape[0]}, "
                         f"got {bounds.tolist()}")
    chosen = resolve_backend("causal_conv1d_varlen_states", backend, device_of(x), implemented=("triton", "reference"))
    with paddle.no_grad():
        if chosen == "reference":
            return ref.causal_conv1d_varlen_states_ref(x, cu_seqlens, state_len)
        states = empty_on([cu_seqlens.shape[0] - 1, x.shape[1], state_len], x.dtype, x)
        conv_kernels.causal_conv1d_varlen_states(*triton_args(contiguous(x), contiguous(cu_seqlens), states))
        return states
