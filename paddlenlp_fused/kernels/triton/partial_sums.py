"""Fixed-order sums of per-program partial sums: the deterministic alternative to fp32 atomics.

A backward kernel in deterministic mode stores each program's partial sums in its own slot of a
float32 workspace instead of adding them atomically into a gradient; ``add_parts`` then adds the
slots into the gradient in slot order, so the result does not depend on which program finished
first. Workspace ``[outer, parts, inner]`` (any strides over outer and parts, inner contiguous),
gradient ``[outer, inner]`` (inner contiguous): ``out[o, i] += sum over p of part[o, p, i]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import tensor as T


@triton.jit
def _add_parts_kernel(part_ptr, out_ptr, parts, inner, part_offset, out_offset, s_part_o, s_part_p, s_out_o,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < inner
    o = tl.program_id(1).to(tl.int64)
    part = part_ptr + part_offset + o * s_part_o + i  # pointers advance in 64 bits: the workspace may pass 2^31 elements
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(parts):
        acc += tl.load(part, mask=live, other=0.0)
        part += s_part_p
    out = out_ptr + out_offset + o * s_out_o + i
    tl.store(out, tl.load(out, mask=live, other=0.0) + acc, mask=live)


def add_parts(part, out, parts: int, inner: int, outer: int = 1, part_strides=None, out_stride=None,
              part_offset: int = 0, out_offset: int = 0) -> None:
    """out (float32) += the slot-ordered sum of the float32 partials ``part`` (see the module
    docstring). ``part_strides`` (outer, part), default a contiguous ``[outer, parts, inner]``;
    ``out_stride`` (outer), default ``inner``; ``part_offset`` / ``out_offset``: the first element
    used of each (part and out are pointers into larger buffers)."""
    for name, t in (("part", part), ("out", out)):
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")
    s_part_o, s_part_p = part_strides if part_strides is not None else (parts * inner, inner)
    if outer * parts * inner == 0:
        return
    block = min(1024, triton.next_power_of_2(inner))
    _add_parts_kernel[(triton.cdiv(inner, block), outer)](
        part, out, parts, inner, part_offset, out_offset, s_part_o, s_part_p, inner if out_stride is None else out_stride,
        BLOCK=block, num_warps=4)
