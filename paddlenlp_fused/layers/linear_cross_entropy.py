"""``LinearCrossEntropy``: LM head + loss in one layer, without the ``[tokens, V]`` logits.

Replaces PaddleNLP's ``LMHead`` + ``PretrainingCriterion`` (loss of ``hidden @ W``), vocabulary
parallel over fleet's model-parallel group. The weight is the layer's own ``[D, V]`` parameter
(``transpose_y=False``, the default: PaddleNLP LLaMA's layout) or ``[V, D]`` (``transpose_y=True``), or
an existing parameter passed as ``weight=`` (a tied ``[V, D]`` embedding), whose layout is read off its
shape unless ``transpose_y`` is given (and must be given when the weight is square). The functional
path is ``paddlenlp_fused.ops.linear_cross_entropy``.
"""

from __future__ import annotations

import contextlib
import numbers

import paddle
import paddle.nn as nn

from ..distributed import comm
from ..ops.cross_entropy import REDUCTIONS, check_workspace_bound, linear_cross_entropy
from . import _args


def _sharded_rng():
    """fleet's model-parallel RNG state when it is set up (sharded weights differ across ranks)."""
    try:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
    except ImportError:  # pragma: no cover - fleet ships with paddle
        return contextlib.nullcontext()
    tracker = get_rng_state_tracker()
    return tracker.rng_state() if "model_parallel_rng" in tracker.states_ else contextlib.nullcontext()


def _check_loss_options(*, ignore_index, reduction, label_smoothing, z_loss, softcap, shift, filter_eps,
                        max_workspace_gib, backend) -> None:
    """The loss options the op checks per call (some only against the input), checked at construction."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    _args.choice("reduction", reduction, REDUCTIONS)
    _args.real("label_smoothing", label_smoothing, low=0.0, high=1.0)
    if label_smoothing == 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {label_smoothing}")
    _args.real("z_loss", z_loss, low=0.0)
    _args.real("softcap", softcap, low=0.0, low_open=True, optional=True)
    if not isinstance(shift, bool):
        _args.nonnegative_int("shift", shift)
    if filter_eps is not None and filter_eps != "auto":
        if isinstance(filter_eps, str):
            raise ValueError(f"filter_eps: expected None (exact), 'auto' or a float > 0, got {filter_eps!r}")
        _args.real("filter_eps", filter_eps, low=0.0, low_open=True)
    check_workspace_bound(max_workspace_gib)
    _args.backend(backend)


class LinearCrossEntropy(nn.Layer):
    """``forward(hidden [..., D], labels [...])`` -> the cross-entropy of ``hidden @ W (+ bias)``.

    ``tensor_parallel_output``: None (default) means True when fleet's model-parallel group has
    more than one rank. True: this rank holds ``vocab_size / n`` vocabulary rows (weight marked
    ``is_distributed`` with ``split_axis`` on the vocabulary axis) and the loss is combined across the
    group; False: the weight is replicated and each rank computes the dense loss.
    ``sequence_parallel``: hidden and labels are this rank's sequence chunk (gathered inside).
    The loss options (``ignore_index``, ``reduction``, ``label_smoothing``, ``z_loss``, ``softcap``,
    ``shift``, ``max_workspace_gib``, ``filter_eps``, ``backend``) are those of ``linear_cross_entropy``,
    with its defaults (``max_workspace_gib="auto"``: the bounded path within 1 GiB where it applies).
    """

    def __init__(self, hidden_size: int, vocab_size: int, transpose_y=None, tensor_parallel_output=None,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap=None, shift=False, has_bias: bool = False,
                 sequence_parallel: bool = False, weight=None, weight_attr=None, bias_attr=None,
                 filter_eps=None, backend: str = "auto", max_workspace_gib="auto"):
        super().__init__()
        hidden_size = _args.positive_int("hidden_size", hidden_size)
        vocab_size = _args.positive_int("vocab_size", vocab_size)
        _check_loss_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                            z_loss=z_loss, softcap=softcap, shift=shift, filter_eps=filter_eps,
                            max_workspace_gib=max_workspace_gib, backend=backend)
        if tensor_parallel_output is not None:
            _args.flag("tensor_parallel_output", tensor_parallel_output)
        _args.flag("has_bias", has_bias)
        group = comm.model_parallel_group()
        if tensor_parallel_output is None:
            tensor_parallel_output = group is not None
        self.tp_group = group if tensor_parallel_output else None
        world = self.tp_group.world_size if self.tp_group is not None else 1
        if vocab_size % world:
            raise ValueError(f"vocab_size: {vocab_size} does not split over {world} model-parallel ranks")
        local_vocab = vocab_size // world
        self.hidden_size, self.vocab_size, self.local_vocab = hidden_size, vocab_size, local_vocab
        self.transpose_y = self._layout(transpose_y, weight, hidden_size)
        self.options = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                            z_loss=z_loss, softcap=softcap, shift=shift, filter_eps=filter_eps, backend=backend,
                            max_workspace_gib=max_workspace_gib)
        self.sequence_parallel = bool(sequence_parallel)
        shape = [local_vocab, hidden_size] if self.transpose_y else [hidden_size, local_vocab]
        vocab_axis = 0 if self.transpose_y else 1
        if weight is not None:
            if list(weight.shape) != shape:
                raise ValueError(f"weight: expected shape {shape} (transpose_y={self.transpose_y}, "
                                 f"{world} model-parallel rank(s)), got {list(weight.shape)}")
            self.weight = weight  # tied: the same parameter object as its owner's (e.g. an embedding)
        else:
            with _sharded_rng() if world > 1 else contextlib.nullcontext():
                self.weight = self.create_parameter(shape, attr=weight_attr, dtype=self._dtype)
            self._mark_distributed(self.weight, world, vocab_axis)
        self.bias = None
        if has_bias:
            self.bias = self.create_parameter([local_vocab], attr=bias_attr, dtype=self.weight.dtype, is_bias=True)
            self._mark_distributed(self.bias, world, 0)

    @staticmethod
    def _layout(transpose_y, weight, hidden_size: int) -> bool:
        """transpose_y as given; else False for an own weight, or read off a passed weight's shape."""
        if transpose_y is not None:
            if not isinstance(transpose_y, bool):
                raise TypeError(f"transpose_y: expected None or a bool, got {transpose_y!r}")
            return transpose_y
        if weight is None:
            return False
        rows, cols = weight.shape
        if rows == cols:
            raise ValueError(f"transpose_y: required for a square weight {list(weight.shape)} (True: [V, D], "
                             "False: [D, V])")
        return cols == hidden_size

    @staticmethod
    def _mark_distributed(param, world: int, axis: int) -> None:
        param.is_distributed = world > 1
        if world > 1:
            param.split_axis = axis

    def forward(self, hidden, labels, return_lse: bool = False):
        if isinstance(hidden, paddle.Tensor) and (hidden.ndim < 1 or hidden.shape[-1] != self.hidden_size):
            raise ValueError(f"hidden: expected [..., hidden_size={self.hidden_size}], got shape {list(hidden.shape)}")
        return linear_cross_entropy(hidden, self.weight, labels, bias=self.bias, transpose_y=self.transpose_y,
                                    return_lse=return_lse, tp_group=self.tp_group,
                                    sequence_parallel=self.sequence_parallel, **self.options)

    def extra_repr(self) -> str:
        tp = f", tensor_parallel={self.tp_group.world_size}" if self.tp_group is not None else ""
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, transpose_y={self.transpose_y}"
                f"{tp}, reduction={self.options['reduction']!r}")
