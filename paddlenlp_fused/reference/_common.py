"""Small helpers the reference modules share."""

from __future__ import annotations

import paddle


def float32(t):
    """``t`` in float32: itself when it is already (as ``astype`` would return it, without converting
    the dtype name on each call: the references cast many float32 tensors to float32)."""
    return t if t.dtype == paddle.float32 else t.astype("float32")
