"""``FlashContrastiveLoss``: CLIP / InfoNCE loss with a learnable temperature, tiled (no similarity
matrix), optionally over a data-parallel ring. Replaces ``F.cross_entropy(scale * q @ k.T, labels)``
(and its transpose, symmetric)."""

from __future__ import annotations

import math

import paddle
import paddle.nn as nn

from ..ops.contrastive import PRECISIONS, REDUCTIONS, flash_contrastive_loss
from . import _args


class FlashContrastiveLoss(nn.Layer):
    """``forward(q, k, labels=None)`` -> the loss of ``flash_contrastive_loss``.

    ``learnable_scale``: the scale is ``exp(logit_scale)`` with ``logit_scale`` a parameter holding the
    log of the scale (as CLIP), starting at ``log(init_scale)``; the scale used is clamped to
    ``max_scale`` (no gradient beyond it). Otherwise the scale is the constant ``init_scale``.
    Features are used as given (CLIP normalises them before the loss). ``group``: see
    ``flash_contrastive_loss`` (default fleet's data-parallel group when it has several ranks).
    """

    def __init__(self, symmetric: bool = True, learnable_scale: bool = True, init_scale: float = 1 / 0.07,
                 max_scale: float = 100.0, reduction: str = "mean", group=None, backend: str = "auto",
                 precision: str = "auto"):
        super().__init__()
        _args.real("init_scale", init_scale, low=0.0, low_open=True)
        _args.real("max_scale", max_scale, optional=True)
        if max_scale is not None and not max_scale >= init_scale:
            raise ValueError(f"max_scale: expected >= init_scale ({init_scale}), got {max_scale}")
        _args.backend(backend)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        self.symmetric, self.learnable_scale = bool(symmetric), bool(learnable_scale)
        self.init_scale, self.max_scale = float(init_scale), max_scale
        self.reduction, self.group, self.backend, self.precision = reduction, group, backend, precision
        if self.learnable_scale:
            self.logit_scale = self.create_parameter(
                [], dtype="float32", default_initializer=nn.initializer.Constant(math.log(init_scale)))
        else:
            self.logit_scale = None

    def scale(self):
        """The scale this step uses: a scalar tensor (learnable) or a float."""
        if self.logit_scale is None:
            return self.init_scale
        scale = paddle.exp(self.logit_scale.astype("float32"))  # float32 also under O2 (a bfloat16 parameter)
        return scale if self.max_scale is None else paddle.clip(scale, max=float(self.max_scale))

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, labels: paddle.Tensor | None = None) -> paddle.Tensor:
        return flash_contrastive_loss(q, k, labels, self.scale(), symmetric=self.symmetric, reduction=self.reduction,
                                      group=self.group, backend=self.backend, precision=self.precision)

    def extra_repr(self) -> str:
        return (f"symmetric={self.symmetric}, learnable_scale={self.learnable_scale}, "
                f"init_scale={self.init_scale:.4g}, max_scale={self.max_scale}, reduction={self.reduction!r}")
