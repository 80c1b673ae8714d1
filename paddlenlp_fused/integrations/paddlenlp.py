"""Swap paddlenlp_fused layers into PaddleNLP models, in place, keeping their parameters.

    from paddlenlp.transformers import LlamaForCausalLM
    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers
    model = LlamaForCausalLM(config); report = swap_fused_layers(model); print(report)

What is swapped (PaddleNLP 3.0.0b4 class names):

- norms: ``LlamaRMSNorm`` and ``MambaRMSNorm`` -> ``FusedRMSNorm``; ``GPTLayerNorm`` -> ``FusedLayerNorm``
  (under sequence parallel their weights keep PaddleNLP's ``sequence_parallel`` mark);
- mlp: ``LlamaMLP`` (fused ``gate_up_fused_proj`` or separate ``gate_proj``/``up_proj``) ->
  ``FusedLlamaMLP``, the same function through ``fused_mlp_func(activation="swiglu")``; GPT's inline MLP
  (``linear1`` / gelu / ``linear2`` in ``GPTDecoderLayer.forward``) -> one
  ``fused_mlp_func(activation="gelu_approx")`` call through ``FusedGPTMLP`` (how: its docstring);
- tensor parallel (``tensor_parallel_degree > 1``; ``integrations.paddlenlp_parallel``): fleet's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` and PaddleNLP's ``ColumnSequenceParallelLinear`` /
  ``RowSequenceParallelLinear`` (attention q/k/v/o, MLP, GPT's qkv/out) -> our
  ``layers.tensor_parallel`` Column/RowParallelLinear owning the same shards (the MLPs then run as one
  ``fused_mlp_func`` call over the group), ``VocabParallelEmbedding`` -> our adapter of the same name;
- mamba: PaddleNLP's ``MambaMixer`` -> ours (``layers.mamba.MambaMixer``);
- lm_head: on ``LlamaForCausalLM`` / ``GPTForCausalLM`` (any layer owning a ``LlamaLMHead``/``GPTLMHead``
  ``lm_head`` and a ``Llama``/``GPTPretrainingCriterion`` ``criterion``), ``lm_head`` -> ``FusedLMHead``
  and ``criterion`` -> ``FusedCausalLMCriterion``: a labelled forward computes its loss with
  ``ops.linear_cross_entropy`` and never materialises the ``[batch, seq, vocab]`` logits; with a
  vocabulary-parallel head the op runs over fleet's model-parallel group (``tp_group``), with
  ``sequence_parallel`` on this rank's rows (``sequence_parallel=True``).

How the LM head is swapped: the model's own ``forward`` is untouched. A forward pre-hook on the model
(the layer owning ``lm_head``) looks for ``labels`` among the call's arguments; while a labelled call
runs, ``FusedLMHead`` returns a ``DeferredLogits`` (the hidden states and the head weight, no matmul)
and ``FusedCausalLMCriterion`` turns it into the loss, with the original criterion's ``ignore_index``
and token mask (tokens with a loss > 0, as PaddleNLP counts them; GPT's ``loss_mask`` when given).
Neither model shifts labels (the data collator does), so neither do we. A post-hook (always run) ends the
labelled call and puts ``None`` where the model returned the deferred logits, as PaddleNLP's own
``use_fused_linear_cross_entropy`` path does. Without labels a single-device head runs its original
``forward`` (same weight, same matmul): the logits are bit-identical; a vocabulary-parallel one computes
them on our comm ops, sharded or gathered as ``tensor_parallel_output`` says. Tied embeddings need
nothing special: the head weight is the shared ``Parameter`` (``transpose_y=True``, ``[vocab, hidden]``),
its gradient accumulates from both uses. One difference: GPT's criterion returns NaN (0/0) when every
token is ignored; ours 0.

The new layers take over the very same ``Parameter`` objects under the same attribute names, so the
state dict keeps its keys, an optimizer built before the swap keeps updating the live parameters, and
parameter attributes set by PaddleNLP and fleet (``is_distributed``, ``split_axis``,
``sequence_parallel``, ``no_weight_decay``...) travel along. Under sequence parallel the gradients of
the parameters marked ``sequence_parallel`` (norm weights, row biases) are partial sums on each rank,
as with PaddleNLP's own layers: all-reduce them after backward (PaddleNLP's trainer registers hooks
for it; ``layers.tensor_parallel.allreduce_sequence_parallel_grads(model)`` does it by hand).

Not swapped, and reported as such where it applies: the ``*_NOTE`` texts below.

PaddleNLP is imported inside ``swap_fused_layers``: ``paddlenlp_fused`` itself never needs it.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections import Counter
from typing import Dict, List, Tuple

import paddle
from paddle import nn

from ..distributed import comm
from ..layers.mamba import MambaMixer
from ..layers.norm import FusedLayerNorm, FusedRMSNorm
from ..layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..ops.fused_dense import fused_mlp_func
from ..ops.cross_entropy import linear_cross_entropy
from .paddlenlp_parallel import VocabParallelEmbedding, fleet_classes, parallel_linear, parallel_logits, sequence_chunk

# what the swap leaves to PaddleNLP, each reported only for a model it applies to (sep / context
# parallelism and use_fused_linear_cross_entropy are reported per layer, among the left-alone ones)
LOGITS_NOTE = "lm_head with labels: the model returns logits=None (the loss is computed without materialising them)"
MAMBA_HEAD_NOTE = ("Mamba lm_head: MambaForCausalLM computes its loss inline in forward (no criterion sublayer to "
                   "swap); linear_cross_entropy on the backbone's hidden states computes it without logits")
ATTENTION_NOTE = "attention (softmax(QK^T)V, rotary or position embeddings) stays PaddleNLP's"


SEQUENCE_PARALLEL_NOTE = (
    "sequence parallel: the gradients of parameters marked sequence_parallel (norm weights, row biases) are "
    "partial sums on each rank; all-reduce them after backward (PaddleNLP's trainer hooks, or "
    "paddlenlp_fused.layers.tensor_parallel.allreduce_sequence_parallel_grads(model))")


@dataclasses.dataclass
class SwapReport:
    """``swapped``: {kind: count}; ``swapped_paths``: (sublayer path, old class -> new class);
    ``skipped``: (sublayer path, why it was left alone); ``notes``: what the swap does not cover in this
    model."""

    swapped: Dict[str, int] = dataclasses.field(default_factory=dict)
    swapped_paths: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.swapped.values())

    def __str__(self) -> str:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.swapped.items())) or "nothing"
        lines = [f"swap_fused_layers: swapped {counts}"]
        lines += [f"  left alone {path}: {why}" for path, why in self.skipped]
        lines += [f"  not covered: {note}" for note in self.notes]
        return "\n".join(lines)


class FusedLlamaMLP(nn.Layer):
    """PaddleNLP's ``LlamaMLP`` (``down(silu(gate(x)) * up(x))``) as one ``fused_mlp_func`` call.

    Holds the original ``Linear`` sublayers under their names (``gate_up_fused_proj`` or
    ``gate_proj`` + ``up_proj``, and ``down_proj``), so the state dict is unchanged. With separate
    gate/up weights the fused ``[hidden, 2 * intermediate]`` weight is concatenated each call
    (gate then up, which is the order ``swiglu`` splits it in); the gradient flows back through the
    concat to both parameters.

    Tensor parallel: the sublayers are then our ``ColumnParallelLinear`` (gate, up: this rank's
    ``[hidden, intermediate / n]`` columns; ``gate_up_fused_proj``: PaddleNLP's per-rank
    ``[gate shard | up shard]``) and ``RowParallelLinear`` (down: ``[intermediate / n, hidden]``), as
    ``swap_fused_layers`` makes them from fleet's, and the call passes their group (``process_group``)
    and ``sequence_parallel`` to ``fused_mlp_func``: the input all-gather (sequence parallel) or
    identity/all-reduce pair and the output reduce-scatter or all-reduce happen inside it.
    """

    def __init__(self, mlp: nn.Layer, backend: str = "auto"):
        super().__init__()
        self.fuse_attention_ffn = bool(getattr(mlp, "fuse_attention_ffn", False))
        if self.fuse_attention_ffn:
            self.gate_up_fused_proj = mlp.gate_up_fused_proj
        else:
            self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj = mlp.down_proj
        self.hidden_size, self.intermediate_size = mlp.hidden_size, mlp.intermediate_size
        self.process_group = getattr(self.down_proj, "pg", None)
        self.sequence_parallel = bool(getattr(self.down_proj, "sequence_parallel", False))
        self.backend = backend

    def _gate_up(self):
        if self.fuse_attention_ffn:
            return self.gate_up_fused_proj.weight, self.gate_up_fused_proj.bias
        gate, up = self.gate_proj, self.up_proj
        if (gate.bias is None) != (up.bias is None):
            raise ValueError("gate_proj/up_proj: expected both or neither to have a bias")
        bias = None if gate.bias is None else paddle.concat([gate.bias, up.bias], axis=0)
        return paddle.concat([gate.weight, up.weight], axis=1), bias

    def forward(self, x):
        """x [..., hidden] (sequence parallel: this rank's rows [tokens / n, hidden]) -> the same shape."""
        weight1, bias1 = self._gate_up()
        return fused_mlp_func(x, weight1, self.down_proj.weight, bias1, self.down_proj.bias,
                              activation="swiglu", process_group=self.process_group,
                              sequence_parallel=self.sequence_parallel, backend=self.backend)

    def extra_repr(self) -> str:
        ranks = self.process_group.world_size if self.process_group is not None else 1
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"fuse_attention_ffn={self.fuse_attention_ffn}, tensor_parallel={ranks}, "
                f"sequence_parallel={self.sequence_parallel}, backend={self.backend}")


class DeferredLogits:
    """What ``FusedLMHead`` returns during a labelled forward: the logits ``hidden_states @ weight``
    (``weight^T`` with ``transpose_y``) left uncomputed. hidden_states ``[batch, seq, hidden]`` (with
    ``sequence_parallel``: this rank's rows ``[batch * seq / n, hidden]``); weight ``[hidden, vocab]`` or,
    with ``transpose_y``, ``[vocab, hidden]`` (tensor parallel: this rank's ``vocab / n`` rows, ``tp_group``
    the model-parallel ``ParallelGroup``)."""

    __slots__ = ("hidden_states", "weight", "transpose_y", "tp_group", "sequence_parallel")

    def __init__(self, hidden_states, weight, transpose_y: bool, tp_group=None, sequence_parallel: bool = False):
        self.hidden_states, self.weight, self.transpose_y = hidden_states, weight, transpose_y
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel


class FusedLMHead(nn.Layer):
    """PaddleNLP's ``LlamaLMHead``/``GPTLMHead`` owning the same ``weight``. ``defer`` (set by the
    model's pre-hook for a labelled call) makes it return ``DeferredLogits``. Otherwise, on one
    device, it runs the original class's ``forward`` on itself (it holds the attributes that forward
    reads), so the logits are exactly the original's; with a vocabulary-parallel weight
    (``tensor_parallel_degree > 1``) or ``sequence_parallel`` it computes them with our comm ops
    (``paddlenlp_parallel.parallel_logits``: fleet's ``parallel_matmul`` has no CPU kernels), sharded
    over the vocabulary or gathered as ``tensor_parallel_output`` (the call's, else the config's) says."""

    def __init__(self, head: nn.Layer):
        super().__init__()
        self.config, self.transpose_y = head.config, bool(head.transpose_y)
        self.weight = head.weight
        if hasattr(head, "xpu_parallel_matmul"):
            self.xpu_parallel_matmul = head.xpu_parallel_matmul
        self._logits_forward = type(head).forward
        self.tp_group = comm.model_parallel_group() if getattr(self.weight, "is_distributed", False) else None
        self.sequence_parallel = bool(getattr(self.config, "sequence_parallel", False))
        self.defer = False

    def forward(self, hidden_states, tensor_parallel_output=None):
        """hidden_states [batch, seq, hidden] (sequence parallel: [batch * seq / n, hidden]) -> logits
        [batch, seq, vocab or vocab / n] (DeferredLogits if ``defer``)."""
        if self.defer:
            return DeferredLogits(hidden_states, self.weight, self.transpose_y, self.tp_group, self.sequence_parallel)
        if self.tp_group is None and not self.sequence_parallel:
            return self._logits_forward(self, hidden_states, tensor_parallel_output)
        if tensor_parallel_output is None:
            tensor_parallel_output = bool(self.config.tensor_parallel_output) and self.tp_group is not None
        return parallel_logits(hidden_states, self.weight, self.transpose_y, self.tp_group, self.sequence_parallel,
                               self.config.seq_length, tensor_parallel_output)

    def extra_repr(self) -> str:
        ranks = self.tp_group.world_size if self.tp_group is not None else 1
        return (f"weight={list(self.weight.shape)}, transpose_y={self.transpose_y}, tensor_parallel={ranks}, "
                f"sequence_parallel={self.sequence_parallel}")


class FusedCausalLMCriterion(nn.Layer):
    """PaddleNLP's ``Llama``/``GPTPretrainingCriterion``: on ``DeferredLogits`` the same mean loss through
    ``linear_cross_entropy`` (float32, no logits held; vocabulary parallel over the head's group, the
    labels cut to this rank's sequence chunk under sequence parallel); on real logits the original
    criterion (kept as the ``original`` sublayer: it has no parameters, so the state dict is
    unchanged). Under tensor parallelism every rank returns the same (global) loss, as PaddleNLP's."""

    def __init__(self, criterion: nn.Layer, backend: str = "auto"):
        super().__init__()
        self.original = criterion
        loss_func = getattr(criterion, "loss_func", None)
        self.ignore_index = int(getattr(criterion, "ignore_index", getattr(loss_func, "ignore_index", -100)))
        self.backend = backend

    def forward(self, prediction_scores, masked_lm_labels, *args, **kwargs):
        """prediction_scores: logits [batch, seq, vocab] or DeferredLogits; masked_lm_labels [batch, seq]
        int; GPT's optional ``loss_mask`` [batch * seq] float. Returns the scalar float32 loss."""
        if not isinstance(prediction_scores, DeferredLogits):
            return self.original(prediction_scores, masked_lm_labels, *args, **kwargs)
        loss_mask = args[0] if args else kwargs.get("loss_mask")
        deferred = prediction_scores
        hidden, weight, labels = deferred.hidden_states, deferred.weight, masked_lm_labels
        if weight.dtype != hidden.dtype:  # as AMP casts the original head matmul's inputs to one dtype
            weight = weight.astype(hidden.dtype)
        if deferred.sequence_parallel:  # hidden holds this rank's rows of the flattened [batch * seq] tokens
            labels = sequence_chunk(labels, deferred.tp_group)
        with paddle.amp.auto_cast(False):
            token_loss = linear_cross_entropy(hidden, weight, labels, ignore_index=self.ignore_index,
                                              reduction="none", transpose_y=deferred.transpose_y,
                                              tp_group=deferred.tp_group,
                                              sequence_parallel=deferred.sequence_parallel,
                                              backend=self.backend).reshape([-1])
            if loss_mask is not None:
                mask = loss_mask.astype("float32").reshape([-1])
                return paddle.sum(token_loss * mask) / mask.sum()
            # PaddleNLP counts the tokens with a positive loss (ignored ones have 0); count 0 gives 0.
            mask = (token_loss > 0).astype("float32")
            return paddle.sum(token_loss * mask) / paddle.clip(mask.sum(), min=1.0)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, backend={self.backend}"


def _lm_head_blocker(owner) -> str | None:
    config = owner.lm_head.config
    for degree in ("sep_parallel_degree", "context_parallel_degree"):
        if int(getattr(config, degree, 1) or 1) > 1:
            return f"{degree} > 1: the criterion's loss concat over that group is kept (not wired in)"
    if getattr(config, "use_fused_linear_cross_entropy", False):
        return ("use_fused_linear_cross_entropy=True: PaddleNLP bypasses lm_head for its own fused loss "
                "(paddlenlp_fused.integrations.enable() points that loss at our op)")
    weight = owner.lm_head.weight
    if getattr(weight, "is_distributed", False) and comm.model_parallel_group() is None:
        return "the head's weight is marked distributed but fleet's model-parallel group has one rank (or none)"
    return None


def _labels_of(signature: inspect.Signature, owner, args, kwargs):
    try:
        return signature.bind(owner, *args, **kwargs).arguments.get("labels")
    except TypeError:  # a call the forward itself will reject; let it
        return None


def _swap_lm_head(owner: nn.Layer, backend: str):
    """(new head, new criterion) for ``owner`` (a causal-LM model), hooks installed, or the reason not."""
    blocker = _lm_head_blocker(owner)
    if blocker:
        return blocker
    signature = inspect.signature(type(owner).forward)
    if "labels" not in signature.parameters:
        return f"{type(owner).__name__}.forward takes no labels"
    head, criterion = FusedLMHead(owner.lm_head), FusedCausalLMCriterion(owner.criterion, backend)

    def begin(layer, args, kwargs):
        head.defer = _labels_of(signature, layer, args, kwargs) is not None

    def end(layer, args, kwargs, outputs):
        head.defer = False
        if isinstance(outputs, tuple):
            return tuple(None if isinstance(x, DeferredLogits) else x for x in outputs)
        if isinstance(getattr(outputs, "logits", None), DeferredLogits):
            outputs["logits"] = None
        return outputs

    owner.register_forward_pre_hook(begin, with_kwargs=True)
    owner.register_forward_post_hook(end, with_kwargs=True, always_call=True)
    return head, criterion


def _group_key(layer):
    pg = getattr(layer, "pg", None)
    return None if pg is None else (tuple(pg.group.ranks), pg.world_size)


def _mlp_blocker(columns, row, hidden: int, widths, inter: int) -> str | None:
    """Whether an MLP's input linears ``columns`` (full widths ``widths``) and output linear ``row``
    (``[inter, hidden]``) are ones ``fused_mlp_func`` can take the weights of: all plain ``[in, out]``
    ``paddle.nn.Linear``, or all ours (column ``gather_output=False`` / row ``input_is_parallel``) on one
    group with one ``sequence_parallel`` setting (what the tensor-parallel swap makes of fleet's)."""
    fleet_column, fleet_row, _, _ = fleet_classes()
    layers = list(columns) + [row]
    if any(isinstance(layer, fleet_column + fleet_row) for layer in layers):
        return "fleet's parallel linears are kept (see their own entries)"
    if all(isinstance(layer, nn.Linear) for layer in layers):
        world = 1
    elif all(isinstance(layer, ColumnParallelLinear) and not layer.gather_output for layer in columns) \
            and isinstance(row, RowParallelLinear) and row.input_is_parallel:
        if len({_group_key(layer) for layer in layers}) != 1 or \
                len({bool(layer.sequence_parallel) for layer in layers}) != 1:
            return "the parallel linears differ in group or sequence_parallel"
        world = row.pg.world_size if row.pg is not None else 1
    else:
        return ", ".join(type(layer).__name__ for layer in layers) + ": not plain Linear nor our parallel linears"
    for layer, width in zip(columns, widths):
        if list(layer.weight.shape) != [hidden, width // world]:
            return f"{type(layer).__name__} weight {list(layer.weight.shape)} is not [{hidden}, {width // world}]"
    if list(row.weight.shape) != [inter // world, hidden]:
        return f"{type(row).__name__} weight {list(row.weight.shape)} is not [{inter // world}, {hidden}]"
    return None


def _llama_mlp_blocker(mlp) -> str | None:
    hidden, inter = mlp.hidden_size, mlp.intermediate_size
    if getattr(mlp, "fuse_attention_ffn", False):
        return _mlp_blocker([mlp.gate_up_fused_proj], mlp.down_proj, hidden, [2 * inter], inter)
    return _mlp_blocker([mlp.gate_proj, mlp.up_proj], mlp.down_proj, hidden, [inter, inter], inter)


class DeferredMLPInput:
    """What a swapped GPT decoder layer's ``linear1`` returns while that layer's forward runs: its input
    ``x`` ``[..., hidden]`` (sequence parallel: ``[tokens / n, hidden]``), the GEMM not done."""

    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x


class FusedGPTMLP:
    """GPT's inline MLP ``linear2(gelu(linear1(h), approximate=True))`` as one
    ``fused_mlp_func(activation="gelu_approx")`` call, keeping ``linear1``/``linear2`` and their parameters.

    ``GPTDecoderLayer.forward`` applies ``self.linear1``, ``self.activation`` and ``self.linear2`` inline,
    so there is no MLP sublayer to replace. ``install`` instead routes those three call sites: while the
    decoder layer's forward runs (a forward pre-hook sets ``active``; a post-hook, always called, clears
    it), ``linear1`` returns a ``DeferredMLPInput`` holding its input, the layer's ``activation`` (an
    instance attribute, replaced by ``activation``) passes it on, and ``linear2`` runs the whole MLP on
    it with ``linear1``'s and ``linear2``'s weights and biases. Outside that window each call does what
    it did before (the overrides are per instance: the ``forward`` of these two linears and the
    ``activation`` of this layer; the classes, sublayers, parameters and state-dict keys are untouched).
    The linears are ``paddle.nn.Linear`` or, after the tensor-parallel swap, our column / row parallel
    linears, whose group and ``sequence_parallel`` go to ``fused_mlp_func``.
    """

    def __init__(self, layer: nn.Layer, backend: str = "auto"):
        self.linear1, self.linear2 = layer.linear1, layer.linear2
        self.plain_activation = layer.activation
        self.plain_forward1, self.plain_forward2 = self.linear1.forward, self.linear2.forward
        self.process_group = getattr(self.linear2, "pg", None)
        self.sequence_parallel = bool(getattr(self.linear2, "sequence_parallel", False))
        self.backend = backend
        self.active = False

    def install(self, layer: nn.Layer) -> None:
        def begin(_layer, _args):
            self.active = True

        def end(_layer, _args, _outputs):
            self.active = False

        self.linear1.forward, self.linear2.forward = self.forward1, self.forward2
        layer.activation = self.activation
        layer._paddlenlp_fused_mlp = self
        layer.register_forward_pre_hook(begin)
        layer.register_forward_post_hook(end, always_call=True)

    def forward1(self, x):
        return DeferredMLPInput(x) if self.active else self.plain_forward1(x)

    def activation(self, x, *args, **kwargs):
        if isinstance(x, DeferredMLPInput):
            if args or kwargs.get("approximate") is not True:
                raise NotImplementedError("the fused GPT MLP computes gelu(approximate=True), as "
                                          f"GPTDecoderLayer calls it; got arguments {args} {kwargs}")
            return x
        return self.plain_activation(x, *args, **kwargs)

    def forward2(self, x):
        if not isinstance(x, DeferredMLPInput):
            return self.plain_forward2(x)
        return fused_mlp_func(x.x, self.linear1.weight, self.linear2.weight, self.linear1.bias, self.linear2.bias,
                              activation="gelu_approx", process_group=self.process_group,
                              sequence_parallel=self.sequence_parallel, backend=self.backend)


def _gpt_mlp(layer, backend: str):
    """Install a ``FusedGPTMLP`` on GPT decoder ``layer``, or the reason not (None: already installed)."""
    if getattr(layer, "_paddlenlp_fused_mlp", None) is not None:
        return None
    import paddle.nn.functional as F

    if layer.activation is not F.gelu:
        return f"activation {getattr(layer.activation, '__name__', layer.activation)}: only gelu is fused"
    config = layer.config
    hidden, inter = config.hidden_size, config.intermediate_size
    blocker = _mlp_blocker([layer.linear1], layer.linear2, hidden, [inter], inter)
    if blocker:
        return blocker
    fused = FusedGPTMLP(layer, backend)
    fused.install(layer)
    return fused


def _rms_norm(old, backend: str) -> FusedRMSNorm:
    new = FusedRMSNorm(int(old.weight.shape[0]), epsilon=old.variance_epsilon, backend=backend)
    new.weight = old.weight
    return new


def _layer_norm(old, backend: str):
    """FusedLayerNorm taking ``old``'s weight and bias, or the reason it cannot."""
    shape = list(old._normalized_shape)
    if len(shape) != 1:
        return f"normalized over {shape}: only last-axis LayerNorm is swapped"
    new = FusedLayerNorm(shape[0], epsilon=old._epsilon, weight_attr=None if old.weight is not None else False,
                         bias_attr=None if old.bias is not None else False, backend=backend)
    if old.weight is not None:
        new.weight = old.weight
    if old.bias is not None:
        new.bias = old.bias
    return new


_MIXER_PARTS = ("conv1d", "in_proj", "x_proj", "dt_proj", "out_proj")


def _mamba_mixer(old, backend: str):
    """Our MambaMixer with ``old``'s sublayers and parameters, or the reason it cannot."""
    config = types.SimpleNamespace(
        hidden_size=old.hidden_size, state_size=old.ssm_state_size, conv_kernel=old.conv_kernel_size,
        intermediate_size=old.intermediate_size, time_step_rank=old.time_step_rank, use_bias=old.use_bias,
        use_conv_bias=old.use_conv_bias, hidden_act=old.activation)
    rng_state = paddle.get_rng_state()  # our constructor draws a dt init that is then replaced
    try:
        new = MambaMixer(config, layer_idx=old.layer_idx, backend=backend)
    except ValueError as exc:
        return str(exc)
    finally:
        paddle.set_rng_state(rng_state)
    for name in _MIXER_PARTS:
        setattr(new, name, getattr(old, name))
    new.A_log, new.D = old.A_log, old.D
    return new


def _classes():
    """PaddleNLP's classes by kind (imported here: paddlenlp is optional)."""
    from paddlenlp.transformers.gpt import modeling as gpt
    from paddlenlp.transformers.llama import modeling as llama

    column, row, _, embedding = fleet_classes()
    found = {"rms_norm": (llama.LlamaRMSNorm,), "layer_norm": (gpt.GPTLayerNorm,), "llama_mlp": (llama.LlamaMLP,),
             "gpt_mlp": (gpt.GPTDecoderLayer,), "mamba_mixer": (), "lm_head": (llama.LlamaLMHead, gpt.GPTLMHead),
             "criterion": (llama.LlamaPretrainingCriterion, gpt.GPTPretrainingCriterion),
             "parallel_linear": column + row, "vocab_parallel_embedding": embedding,
             "attention": (llama.LlamaAttention, gpt.MultiHeadAttention), "mamba_lm": ()}
    try:  # the Mamba model arrived in PaddleNLP 3.0.0b4
        from paddlenlp.transformers.mamba import modeling as mamba
    except ImportError:
        return found
    found["rms_norm"] += (mamba.MambaRMSNorm,)
    found["mamba_mixer"] = (mamba.MambaMixer,)
    found["mamba_lm"] = (mamba.MambaForCausalLM,)
    return found


def _replace(root: nn.Layer, path: str, new: nn.Layer) -> None:
    parent = root
    *parents, name = path.split(".")
    for part in parents:
        parent = parent._sub_layers[part]
    parent._sub_layers[name] = new


def _swap_lm_heads(model, kinds, lm_head: bool, backend: str, report: SwapReport, counts: Counter, replaced):
    for path, owner in [("", model)] + list(model.named_sublayers()):
        if not (isinstance(owner._sub_layers.get("lm_head"), kinds["lm_head"])
                and isinstance(owner._sub_layers.get("criterion"), kinds["criterion"])):
            continue
        prefix = path + "." if path else ""
        new = _swap_lm_head(owner, backend) if lm_head else "lm_head=False"
        if isinstance(new, str):
            report.skipped.append((prefix + "lm_head", new))
            continue
        for name, layer in zip(("lm_head", "criterion"), new):
            report.swapped_paths.append((prefix + name, f"{type(owner._sub_layers[name]).__name__} -> "
                                                        f"{type(layer).__name__}"))
            owner._sub_layers[name] = layer
            replaced.append(prefix + name)
            counts[name] += 1


def _new_layer(layer, kinds, options: dict, backend: str):
    """(kind, the layer replacing ``layer`` or the reason not), or (None, None) for a layer not swapped.
    Kind ``gpt_mlp`` installs a ``FusedGPTMLP`` on the decoder layer itself (kept in place)."""
    if isinstance(layer, kinds["parallel_linear"]):
        return "parallel_linear", parallel_linear(layer, backend) if options["tensor_parallel"] \
            else "tensor_parallel=False"
    if isinstance(layer, kinds["vocab_parallel_embedding"]):
        return "vocab_parallel_embedding", VocabParallelEmbedding(layer) if options["tensor_parallel"] \
            else "tensor_parallel=False"
    if isinstance(layer, kinds["rms_norm"]):
        return "rms_norm", _rms_norm(layer, backend) if options["norms"] else "norms=False"
    if isinstance(layer, kinds["layer_norm"]):
        return "layer_norm", _layer_norm(layer, backend) if options["norms"] else "norms=False"
    if isinstance(layer, kinds["llama_mlp"]):
        blocker = _llama_mlp_blocker(layer) if options["mlp"] else "mlp=False"
        return "llama_mlp", blocker or FusedLlamaMLP(layer, backend)
    if isinstance(layer, kinds["gpt_mlp"]):
        return "gpt_mlp", _gpt_mlp(layer, backend) if options["mlp"] else "mlp=False"
    if kinds["mamba_mixer"] and isinstance(layer, kinds["mamba_mixer"]):
        return "mamba_mixer", _mamba_mixer(layer, backend) if options["mamba"] else "mamba=False"
    return None, None


def swap_fused_layers(model: nn.Layer, norms: bool = True, mlp: bool = True, mamba: bool = True,
                      lm_head: bool = True, tensor_parallel: bool = True, backend: str = "auto") -> SwapReport:
    """Replace, in place, the norms (``norms``), LLaMA and GPT MLPs (``mlp``), Mamba mixers (``mamba``),
    the LLaMA / GPT causal-LM head + criterion (``lm_head``: labelled calls then compute the loss with
    ``linear_cross_entropy`` and return logits=None) and fleet's tensor-parallel linears and
    vocabulary-parallel embeddings (``tensor_parallel``) of a PaddleNLP LLaMA / GPT / Mamba model with
    paddlenlp_fused layers that own the same parameters; ``backend`` is given to every new layer
    ("auto" follows ``use_backend``). Returns a ``SwapReport``. Call it after ``fleet.init`` (for a
    tensor-parallel model) and before wrapping the model for distributed training or building a static
    graph; an optimizer built before it stays valid (same parameters)."""
    if not isinstance(model, nn.Layer):
        raise TypeError(f"model: expected a paddle.nn.Layer, got {type(model).__name__}")
    if backend not in ("auto", "triton", "cuda", "reference"):
        raise ValueError(f"backend: expected one of 'auto', 'triton', 'cuda', 'reference', got {backend!r}")
    kinds = _classes()
    options = dict(norms=norms, mlp=mlp, mamba=mamba, tensor_parallel=tensor_parallel)
    report, counts = SwapReport(), Counter()
    replaced: List[str] = []
    # fleet's parallel layers first, so that the MLP swaps find ours under a LLaMA MLP / GPT layer
    parallel = ("parallel_linear", "vocab_parallel_embedding")
    only_parallel = {kind: classes if kind in parallel else () for kind, classes in kinds.items()}
    _swap_sublayers(model, only_parallel, options, backend, report, counts, replaced)
    _swap_lm_heads(model, kinds, lm_head, backend, report, counts, replaced)
    _swap_sublayers(model, dict(kinds, **{kind: () for kind in parallel}), options, backend, report, counts,
                    replaced)
    report.swapped = dict(counts)
    present = [layer for _, layer in model.named_sublayers(include_self=True)]
    if counts["lm_head"]:
        report.notes.append(LOGITS_NOTE)
    if any(isinstance(layer, kinds["mamba_lm"]) for layer in present):
        report.notes.append(MAMBA_HEAD_NOTE)
    if any(isinstance(layer, kinds["attention"]) for layer in present):
        report.notes.append(ATTENTION_NOTE)
    if any(getattr(param, "sequence_parallel", False) for param in model.parameters()):
        report.notes.append(SEQUENCE_PARALLEL_NOTE)
    return report


def _swap_sublayers(model, kinds, options, backend, report: SwapReport, counts: Counter, replaced) -> None:
    for path, layer in list(model.named_sublayers()):
        if any(path.startswith(done + ".") for done in replaced):
            continue
        kind, new = _new_layer(layer, kinds, options, backend)
        if kind is None or new is None:  # not ours to swap, or a FusedGPTMLP installed by an earlier swap
            continue
        if isinstance(new, str):
            report.skipped.append((path, new))
            continue
        counts[kind] += 1
        if isinstance(new, FusedGPTMLP):
            report.swapped_paths.append((path, "linear1 / activation / linear2 -> FusedGPTMLP (fused_mlp_func)"))
            continue
        _replace(model, path, new)
        replaced.append(path)
        report.swapped_paths.append((path, f"{type(layer).__name__} -> {type(new).__name__}"))
