"""The dtypes Paddle's AMP gives a matmul's inputs, applied by the ops whose core is a matmul.

Inside an active ``paddle.amp.auto_cast`` (O1 or O2), matmul is on the white list: its float32 inputs
are cast to the auto_cast dtype. Outside, Paddle's matmul rejects a float32 / 16-bit mix; the ops
with weights take it as AMP O1's master weights with 16-bit activations and cast the float32 weights
to the activations' dtype. The casts are ordinary autograd ops, so a float32 tensor gets a float32
gradient.
"""

from __future__ import annotations

import paddle

from ..runtime import tensor as T

_LOW = (paddle.float16, paddle.bfloat16)


def autocast_dtype():
    """The dtype name an active ``auto_cast`` gives matmul's inputs, or None outside one."""
    if not paddle.amp.is_autocast_enabled():
        return None
    return str(paddle.amp.get_autocast_dtype()).split(".")[-1]


def cast_float32(tensors, dtype):
    """``tensors`` with each float32 tensor cast to ``dtype`` (others, and None, as they are)."""
    return [t.astype(dtype) if isinstance(t, paddle.Tensor) and t.dtype == paddle.float32 else t
            for t in tensors]


def amp_cast(x, params):
    """(x, params) as a matmul of activations ``x`` with weights ``params`` sees them under AMP (module
    docstring). Other mixes are left for the ops' dtype checks to reject."""
    target = autocast_dtype()
    if target is not None:
        x, *params = cast_float32([x, *params], target)
    elif isinstance(x, paddle.Tensor) and x.dtype in _LOW:
        params = cast_float32(params, T.dtype_name(x))
    return x, params
