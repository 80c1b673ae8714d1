"""What the kernels do differently under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU suite).

``INTERPRETING`` is read once, at import: kernel modules are imported after TRITON_INTERPRET is set
(``@triton.jit`` itself decides there whether a kernel is compiled or interpreted). As a constexpr it
can steer both launchers (e.g. small tiles) and kernels: in compiled kernels a branch on it is
resolved at compile time and leaves no code.

``dot_operand``: Triton 3.6's interpreter holds bf16 as uint16 and its ``tl.dot`` multiplies the raw
bit patterns, so there the operands go in as fp32 (16-bit products are exact in fp32, so the result
is the tensor-core one up to summation order); compiled, the operand passes unchanged.

``round_to``: the interpreter truncates fp32 -> bf16 casts (a 2x larger, biased error, which drifts
the CPU suite's low-precision errors past the GPU's); there bf16 rounds to nearest even on the fp32
bits. Compiled, a plain cast (the hardware rounds to nearest even).
"""

import triton
import triton.language as tl

INTERPRETING = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def dot_operand(x):
    """``x`` as ``tl.dot`` should take it: upcast to fp32 in the interpreter, unchanged when compiled."""
    if INTERPRETING:
        x = x.to(tl.float32)
    return x


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """``x`` cast to DTYPE, rounding to nearest even also in the interpreter (NaN stays NaN)."""
    if INTERPRETING and DTYPE == tl.bfloat16:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        x = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)
