"""Small pieces the ops' PyLayers share: their base class, gradient bookkeeping, buffers on the
input's place, and in-place launches on possibly strided state tensors."""

from __future__ import annotations

import functools

import paddle
from paddle.autograd import PyLayer

from ..runtime.triton_paddle import triton_scoped
from ._checks import contiguous, device_of


class TritonPyLayer(PyLayer):
    """A PyLayer whose forward and backward are each a Triton driver scope (``triton_scoped``): the
    backward runs later, called by Paddle's autograd engine outside the op's own scope.

    The gradient of an output that nothing differentiated reaches the backward as zeros of the
    output's shape and dtype, made here: Paddle 3.2 makes them itself only with a segfault
    (``paddle.grad`` of one output of a several-output PyLayer), so its own filling is turned off."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        wrappers = {"forward": _recording_outputs, "backward": _materializing_grads}
        for name, wrap in wrappers.items():
            method = vars(cls).get(name)
            if isinstance(method, staticmethod):
                setattr(cls, name, staticmethod(triton_scoped(wrap(method.__func__))))


def _recording_outputs(forward):
    def wrapped(ctx, *args, **kwargs):
        ctx.set_materialize_grads(False)
        result = forward(ctx, *args, **kwargs)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        ctx.output_meta = [(list(t.shape), t.dtype, t.place) for t in outputs if isinstance(t, paddle.Tensor)]
        return result

    return functools.wraps(forward)(wrapped)


def _materializing_grads(backward):
    def wrapped(ctx, *grads):
        grads = [paddle.zeros(shape, dtype=dtype, device=place) if g is None else g
                 for g, (shape, dtype, place) in zip(grads, ctx.output_meta)] + list(grads[len(ctx.output_meta):])
        return backward(ctx, *grads)

    return functools.wraps(backward)(wrapped)


def grads_for(ctx, grads):
    """Paddle wants None for every tensor input that does not require a gradient; ``ctx.needs_grad``
    comes from ``needs_grad`` over the same (non-None) inputs."""
    return tuple(g if needed else None for g, needed in zip(grads, ctx.needs_grad))


def needs_grad(*tensors):
    return [not t.stop_gradient for t in tensors if t is not None]


def empty_on(shape, dtype, like):
    return paddle.empty(list(shape), dtype=dtype, device=like.place)


def zeros32_on(shape, like):
    return paddle.zeros(list(shape), dtype="float32", device=like.place)


def cast_like(t, like):
    """t cast to like's dtype (accumulators back to their input's dtype); None without like."""
    if t is None or like is None:
        return None
    return t if t.dtype == like.dtype else t.astype(like.dtype)


def check_shape(name, t, expected, what=None):
    if list(t.shape) != list(expected):
        raise ValueError(f"{name}: expected {what + ' = ' if what else 'shape '}{list(expected)}, "
                         f"got {list(t.shape)}")


def run_in_place(state, launch):
    """Run ``launch(dense_state)`` on state's memory, or on a contiguous copy written back."""
    dense = contiguous(state)
    launch(dense)
    if dense is not state:
        paddle.assign(dense, output=state)


def mm(a, b, transpose_a=False, transpose_b=False):
    """paddle.matmul; in float32 where Paddle's CPU build lacks the half-precision kernel."""
    if device_of(a) == "cpu" and a.dtype in (paddle.float16, paddle.bfloat16):
        return paddle.matmul(a.astype("float32"), b.astype("float32"), transpose_a, transpose_b).astype(a.dtype)
    return paddle.matmul(a, b, transpose_a, transpose_b)


def add(a, b):
    """a + b in a's dtype; in float32 where Paddle's CPU build lacks the half-precision kernel."""
    if device_of(a) == "cpu" and a.dtype in (paddle.float16, paddle.bfloat16):
        return (a.astype("float32") + b.astype("float32")).astype(a.dtype)
    return a + b.astype(a.dtype)
