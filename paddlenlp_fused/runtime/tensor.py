"""Framework-neutral tensor accessors for kernel launchers.

Launchers in ``paddlenlp_fused.kernels`` receive Paddle tensors (GPU, or CPU wrapped for the Triton
interpreter), torch tensors (the GPU test and benchmark suites) or the shape-only ``SpecTensor`` of
the compile-only check. They read shapes, strides and dtypes only through these helpers, so no
kernel module imports a framework.
"""

from __future__ import annotations

from typing import Sequence, Tuple

# dtype name -> bytes per element; the names are the part after the dot of str(dtype) in
# Paddle ("paddle.bfloat16") and torch ("torch.bfloat16").
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


_NAMES: dict = {}  # dtype object -> name: the ops ask per call, and str() of a dtype is not cheap


def dtype_name(t) -> str:
    """'float32', 'bfloat16', ... for a tensor or a dtype of either framework."""
    dtype = getattr(t, "dtype", t)
    try:
        return _NAMES[dtype]
    except KeyError:
        name = _NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
        return name
    except TypeError:  # an unhashable dtype
        return str(dtype).rsplit(".", 1)[-1]


def itemsize(t) -> int:
    name = dtype_name(t)
    if name not in _ITEMSIZE:
        raise TypeError(f"unsupported dtype {name!r}")
    return _ITEMSIZE[name]


def shape(t) -> Tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def strides(t) -> Tuple[int, ...]:
    """Strides in elements. torch and Paddle both expose ``stride()``; Paddle also ``.strides``."""
    stride = getattr(t, "stride", None)
    if callable(stride):
        return tuple(int(s) for s in stride())
    return tuple(int(s) for s in t.strides)


def numel(t) -> int:
    n = 1
    for s in shape(t):
        n *= s
    return n


def contiguous_strides(dims: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(tuple(dims)):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def is_contiguous(t) -> bool:
    """Row-major contiguous, ignoring the strides of size-1 axes."""
    return all(d == 1 or s == c for d, s, c in zip(shape(t), strides(t), contiguous_strides(shape(t))))


def check_same_shape(name: str, t, expected: Sequence[int]) -> None:
    if shape(t) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {shape(t)}")


def check_rows(name: str, t, M: int, N: int) -> None:
    """``t`` is None, or an ``[M, N]`` matrix whose last axis is contiguous (rows at any stride)."""
    if t is None:
        return
    check_same_shape(name, t, (M, N))
    if M and N > 1 and strides(t)[1] != 1:
        raise ValueError(f"{name}: last axis must be contiguous, got strides {strides(t)}")


def check_contiguous(name: str, t) -> None:
    if not is_contiguous(t):
        raise ValueError(f"{name}: launcher expects a contiguous tensor, got strides {strides(t)}")


class SpecTensor:
    """A tensor with a shape, strides and dtype but no memory: what the compile-only check hands
    to a launcher so that Triton specialises and compiles exactly what a real launch would.
    ``data_ptr()`` is 0, which Triton reads as 16-byte aligned."""

    def __init__(self, dims: Sequence[int], dtype: str, stride: Sequence[int] | None = None):
        if dtype not in _ITEMSIZE:
            raise TypeError(f"unsupported dtype {dtype!r}")
        self.shape = tuple(int(d) for d in dims)
        self.dtype = _spec_dtype(dtype)
        self._stride = tuple(stride) if stride is not None else contiguous_strides(self.shape)

    def stride(self, dim: int | None = None):
        return self._stride if dim is None else self._stride[dim]

    @staticmethod
    def data_ptr() -> int:
        return 0

    def __repr__(self) -> str:
        return f"SpecTensor({list(self.shape)}, {self.dtype})"


class _SpecDType:
    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:  # Triton reads str(dtype) and keeps what follows the last dot.
        return f"spec.{self.name}"

    __repr__ = __str__


# Triton caches its type mangling per dtype object, so each name must map to one object for life.
_SPEC_DTYPES = {name: _SpecDType(name) for name in _ITEMSIZE}


def _spec_dtype(name: str) -> _SpecDType:
    return _SPEC_DTYPES[name]


def device_kind(t) -> str:
    """'gpu' or 'cpu' for a Paddle tensor (``.place``) or a torch tensor (``.is_cuda``). Paddle's
    first, without probing: the ops ask per call."""
    try:
        return "gpu" if t.place.is_gpu_place() else "cpu"
    except AttributeError:  # a torch tensor (no .place)
        return "gpu" if getattr(t, "is_cuda", False) else "cpu"


def row_stride(name: str, t, M: int, N: int) -> int:
    """The row stride of t, an [M, N] matrix with a contiguous last axis (0 for None); reads its
    layout once (a launcher's host time adds to the GPU's when the host is the slower)."""
    if t is None:
        return 0
    dims, st = shape(t), strides(t)
    if dims != (M, N):
        raise ValueError(f"{name}: expected shape {(M, N)}, got {dims}")
    if M and N > 1 and st[1] != 1:
        raise ValueError(f"{name}: last axis must be contiguous, got strides {st}")
    return st[0]
