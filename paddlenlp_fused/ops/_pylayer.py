"""Small pieces the ops' PyLayers share: their base class, gradient bookkeeping, buffers on the
input's place, and in-place launches on possibly strided state tensors."""

from __future__ import annotations

import functools
import inspect
import weakref

import paddle
from paddle.autograd import PyLayer

from ..runtime.triton_paddle import triton_scoped
from ._checks import contiguous, device_of


class TritonPyLayer(PyLayer):
    """A PyLayer whose forward and backward are each a Triton driver scope (``triton_scoped``): the
    backward runs later, called by Paddle's autograd engine outside the op's own scope. ``op``: the
    public name the errors give.

    The gradient of an output that nothing differentiated reaches the backward as zeros of the
    output's shape and dtype, made here: Paddle 3.2 makes them itself only with a segfault
    (``paddle.grad`` of one output of a several-output PyLayer), so its own filling is turned off.

    Paddle checks the tensors its own ops keep for the backward against in-place edits; a PyLayer's
    it does not. The forward records the in-place version of every tensor the backward reads (those
    given to ``ctx.save_for_backward`` and those kept as ``ctx`` attributes; reshapes and other views
    share the version, so an edit of the caller's input or output shows) and the backward raises as
    Paddle's ops do where one changed. The backward also raises under ``create_graph=True``: the
    kernels' backward is not differentiable, where it would silently give no second-order term."""

    op = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        wrappers = {"forward": _recording_forward,
                    "backward": functools.partial(_checked_backward, op=cls.op or cls.__name__)}
        for name, wrap in wrappers.items():
            method = vars(cls).get(name)
            if isinstance(method, staticmethod):
                setattr(cls, name, staticmethod(triton_scoped(wrap(method.__func__))))


def _recording_forward(forward):
    """The forward, recording its outputs' shapes (for the zeros) and the versions of what the
    backward reads."""
    names = list(inspect.signature(forward).parameters)[1:]

    def wrapped(ctx, *args, **kwargs):
        ctx.set_materialize_grads(False)
        saved = []
        save = ctx.save_for_backward

        def save_for_backward(*tensors):
            saved[:] = tensors
            save(*tensors)

        ctx.save_for_backward = save_for_backward  # (an instance attribute: the class's method is Paddle's)
        try:
            result = forward(ctx, *args, **kwargs)
        finally:
            del ctx.save_for_backward
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        ctx.output_meta = [(list(t.shape), t.dtype, t.place) for t in outputs if isinstance(t, paddle.Tensor)]
        ctx.versions = _versions(saved, vars(ctx), zip(names, args), kwargs.items(), outputs)
        return result

    return functools.wraps(forward)(wrapped)


def _kept_tensors(attributes):
    """(attribute, tensor) for the tensors among ctx's attributes, one level into tuples, lists and dicts."""
    for key, value in attributes.items():
        if isinstance(value, paddle.Tensor):
            yield key, value
        elif isinstance(value, (tuple, list)):
            yield from ((key, t) for t in value if isinstance(t, paddle.Tensor))
        elif isinstance(value, dict):
            yield from ((key, t) for t in value.values() if isinstance(t, paddle.Tensor))


def _versions(saved, attributes, named_args, named_kwargs, outputs):
    """[(weak reference, in-place version, role)] of the tensors the backward reads. Weak: a tensor
    the ctx no longer holds (``saved_tensors_hooks`` of a non-reentrant recompute packed it) is not
    kept alive, and is then not checked. The role names the caller's argument or output that shares
    the tensor's memory, else the saved intermediate. (A few microseconds: ``Tensor.size`` would cost
    tens, so empty tensors are told by their null pointer.)"""
    roles = {}
    for i, t in enumerate(outputs):
        if isinstance(t, paddle.Tensor):
            roles.setdefault(t.data_ptr(), f"output {i}")
    for name, t in list(named_args) + list(named_kwargs):
        if isinstance(t, paddle.Tensor):
            roles[t.data_ptr()] = f"input '{name}'"
    roles.pop(0, None)
    kept = [(f"saved tensor {i}", t) for i, t in enumerate(saved) if isinstance(t, paddle.Tensor)]
    kept += [(f"ctx.{key}", t) for key, t in _kept_tensors(attributes)]
    return [(weakref.ref(t), t._inplace_version(), roles.get(t.data_ptr(), what)) for what, t in kept]


def _check_versions(op, versions):
    for ref, version, role in versions:
        t = ref()
        if t is not None and t._inplace_version() != version:
            raise RuntimeError(
                f"(PermissionDenied) {op}: {role}, used in gradient computation, has been modified by an inplace "
                f"operation after the forward (its version is {t._inplace_version()}, the forward saw {version}): "
                f"the gradient would be wrong. Apply the operation out of place (x = x * 2, not x.scale_(2)) or "
                f"on a clone")


def _checked_backward(backward, op):
    """The backward, refusing double backward and in-place edits, with the zero gradients made."""
    def wrapped(ctx, *grads):
        if paddle.is_grad_enabled():  # (only under create_graph=True: Paddle runs backward without grad)
            raise NotImplementedError(
                f"{op}: double backward (paddle.grad(..., create_graph=True)) is not implemented: the fused "
                f"backward is not itself differentiable. The plain-Paddle reference (backend='reference') supports "
                f"it")
        _check_versions(op, ctx.versions)
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
