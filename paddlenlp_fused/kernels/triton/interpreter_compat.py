"""What the kernels do differently under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU suite).

``INTERPRETING`` is read once, at import: kernel modules are imported after TRITON_INTERPRET is set
(``@triton.jit`` itself decides there whether a kernel is compiled or interpreted). As a constexpr it
can steer both launchers (e.g. small tiles) and kernels: in compiled kernels a branch on it is
resolved at compile time and leaves no code.

``dot_operand``: Triton 3.6's interpreter holds bf16 as uint16 and its ``tl.dot`` multiplies the raw
bit patterns, so there the operands go in as fp32 (16-bit products are exact in fp32, so the result
is the tensor-core one up to summation order); compiled, the operand passes unchanged.

Casts to bf16: Triton 3.6's interpreter truncates fp32 -> bf16 (``.to()`` and stores), an error
twice the GPU's and biased, which drifted the CPU suite's low-precision errors past the GPU's. When
interpreting, importing this module makes the interpreter's fp32 -> bf16 cast round to nearest even,
as the hardware does; compiled kernels are untouched.
"""

import numpy as np
import triton
import triton.language as tl

INTERPRETING = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def dot_operand(x):
    """``x`` as ``tl.dot`` should take it: upcast to fp32 in the interpreter, unchanged when compiled."""
    if INTERPRETING:
        x = x.to(tl.float32)
    return x


def _round_bf16_casts_to_nearest_even():
    """Wrap the interpreter's cast so that fp32 -> bf16 rounds to nearest even (NaN stays NaN)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    truncating_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.asarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
            rounded = np.where(np.isnan(src.data), np.uint32(0x7FC0), rounded).astype(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return truncating_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


if INTERPRETING:
    _round_bf16_casts_to_nearest_even()
