"""Swap paddlenlp_fused layers into PaddleNLP models, in place, keeping their parameters.

    from paddlenlp.transformers import LlamaForCausalLM
    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers
    model = LlamaForCausalLM(config); report = swap_fused_layers(model); print(report)

What is swapped (PaddleNLP 3.0.0b4 class names):

- norms: ``LlamaRMSNorm`` and ``MambaRMSNorm`` -> ``FusedRMSNorm``; ``GPTLayerNorm`` -> ``FusedLayerNorm``;
- mlp: ``LlamaMLP`` (fused ``gate_up_fused_proj`` or separate ``gate_proj``/``up_proj``) ->
  ``FusedLlamaMLP``, the same function through ``fused_mlp_func(activation="swiglu")``;
- mamba: PaddleNLP's ``MambaMixer`` -> ours (``layers.mamba.MambaMixer``);
- lm_head: on ``LlamaForCausalLM`` / ``GPTForCausalLM`` (any layer owning a ``LlamaLMHead``/``GPTLMHead``
  ``lm_head`` and a ``Llama``/``GPTPretrainingCriterion`` ``criterion``), ``lm_head`` -> ``FusedLMHead``
  and ``criterion`` -> ``FusedCausalLMCriterion``: a labelled forward computes its loss with
  ``ops.linear_cross_entropy`` and never materialises the ``[batch, seq, vocab]`` logits.

How the LM head is swapped: the model's own ``forward`` is untouched. A forward pre-hook on the model
(the layer owning ``lm_head``) looks for ``labels`` among the call's arguments; while a labelled call
runs, ``FusedLMHead`` returns a ``DeferredLogits`` (the hidden states and the head weight, no matmul)
and ``FusedCausalLMCriterion`` turns it into the loss, with the original criterion's ``ignore_index``
and token mask (tokens with a loss > 0, as PaddleNLP counts them; GPT's ``loss_mask`` when given).
Neither model shifts labels (the data collator does), so neither do we. A post-hook (always run) ends the
labelled call and puts ``None`` where the model returned the deferred logits, as PaddleNLP's own
``use_fused_linear_cross_entropy`` path does. Without labels the head runs its original ``forward``
(same weight, same matmul): the logits are bit-identical. Tied embeddings need nothing special: the head
weight is the shared ``Parameter`` (``transpose_y=True``, ``[vocab, hidden]``), its gradient accumulates
from both uses. One difference: GPT's criterion returns NaN (0/0) when every token is ignored; ours 0.

The new layers take over the very same ``Parameter`` objects under the same attribute names, so the
state dict keeps its keys, an optimizer built before the swap keeps updating the live parameters, and
parameter attributes set by PaddleNLP (``sequence_parallel``, ``no_weight_decay``...) travel along.

Not swapped this round, and reported as such: the tensor-parallel MLPs (``tensor_parallel_degree >
1``: PaddleNLP's own ``ColumnParallelLinear``/``RowParallelLinear`` stay), GPT's MLP (its
``linear1``/``linear2`` are applied inline in ``GPTDecoderLayer.forward``, not in a sublayer of their
own), the vocabulary-parallel LM head (``tensor_parallel_degree > 1``, ``sequence_parallel``, sep/context
parallel: PaddleNLP's ``parallel_matmul`` + ``ParallelCrossEntropy`` stay; our op's ``tp_group`` path is
not wired in nor tested inside PaddleNLP yet), a LLaMA configured with ``use_fused_linear_cross_entropy``
(PaddleNLP then bypasses ``lm_head`` itself) and Mamba's LM head (its loss is computed inline in
``MambaForCausalLM.forward``).

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

from ..layers.mamba import MambaMixer
from ..layers.norm import FusedLayerNorm, FusedRMSNorm
from ..ops.fused_dense import fused_mlp_func
from ..ops.linear_cross_entropy import linear_cross_entropy

NOT_SWAPPED_THIS_ROUND = (
    "lm_head + criterion with tensor_parallel_degree > 1 / sequence_parallel: the vocabulary-parallel head "
    "(parallel_matmul + ParallelCrossEntropy) is kept; linear_cross_entropy's tp_group is not wired in yet",
    "lm_head with labels: the model returns logits=None (the loss is computed without materialising them)",
    "Mamba lm_head: MambaForCausalLM computes its loss inline in forward (no criterion sublayer to swap)",
    "GPT MLP: linear1/linear2 are applied inline in GPTDecoderLayer.forward (no MLP sublayer to swap)",
)


@dataclasses.dataclass
class SwapReport:
    """``swapped``: {kind: count}; ``swapped_paths``: (sublayer path, old class -> new class);
    ``skipped``: (sublayer path, why it was left alone); ``notes``: what the swap never covers."""

    swapped: Dict[str, int] = dataclasses.field(default_factory=dict)
    swapped_paths: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=lambda: list(NOT_SWAPPED_THIS_ROUND))

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
        """x [..., hidden] -> [..., hidden]."""
        weight1, bias1 = self._gate_up()
        return fused_mlp_func(x, weight1, self.down_proj.weight, bias1, self.down_proj.bias,
                              activation="swiglu", backend=self.backend)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"fuse_attention_ffn={self.fuse_attention_ffn}, backend={self.backend}")


class DeferredLogits:
    """What ``FusedLMHead`` returns during a labelled forward: the logits ``hidden_states @ weight``
    (``weight^T`` with ``transpose_y``) left uncomputed. hidden_states ``[batch, seq, hidden]``; weight
    ``[hidden, vocab]`` or, with ``transpose_y``, ``[vocab, hidden]``."""

    __slots__ = ("hidden_states", "weight", "transpose_y")

    def __init__(self, hidden_states, weight, transpose_y: bool):
        self.hidden_states, self.weight, self.transpose_y = hidden_states, weight, transpose_y


class FusedLMHead(nn.Layer):
    """PaddleNLP's ``LlamaLMHead``/``GPTLMHead`` owning the same ``weight``. ``defer`` (set by the
    model's pre-hook for a labelled call) makes it return ``DeferredLogits``; otherwise it runs the
    original class's ``forward`` on itself (it holds the attributes that forward reads), so the
    logits are exactly the original's."""

    def __init__(self, head: nn.Layer):
        super().__init__()
        self.config, self.transpose_y = head.config, bool(head.transpose_y)
        self.weight = head.weight
        if hasattr(head, "xpu_parallel_matmul"):
            self.xpu_parallel_matmul = head.xpu_parallel_matmul
        self._logits_forward = type(head).forward
        self.defer = False

    def forward(self, hidden_states, tensor_parallel_output=None):
        """hidden_states [batch, seq, hidden] -> logits [batch, seq, vocab] (DeferredLogits if ``defer``)."""
        if self.defer:
            return DeferredLogits(hidden_states, self.weight, self.transpose_y)
        return self._logits_forward(self, hidden_states, tensor_parallel_output)

    def extra_repr(self) -> str:
        return f"weight={list(self.weight.shape)}, transpose_y={self.transpose_y}"


class FusedCausalLMCriterion(nn.Layer):
    """PaddleNLP's ``Llama``/``GPTPretrainingCriterion``: on ``DeferredLogits`` the same mean loss through
    ``linear_cross_entropy`` (float32, no logits held); on real logits the original criterion (kept as
    the ``original`` sublayer: it has no parameters, so the state dict is unchanged)."""

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
        hidden, weight = prediction_scores.hidden_states, prediction_scores.weight
        if weight.dtype != hidden.dtype:  # as AMP casts the original head matmul's inputs to one dtype
            weight = weight.astype(hidden.dtype)
        with paddle.amp.auto_cast(False):
            token_loss = linear_cross_entropy(hidden, weight, masked_lm_labels, ignore_index=self.ignore_index,
                                              reduction="none", transpose_y=prediction_scores.transpose_y,
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
    if int(getattr(config, "tensor_parallel_degree", 1) or 1) > 1:
        return ("tensor_parallel_degree > 1: the vocabulary-parallel head (parallel_matmul + ParallelCrossEntropy) "
                "is kept (linear_cross_entropy's tp_group is not wired in this round)")
    if getattr(config, "sequence_parallel", False):
        return "sequence_parallel: the head's sequence gather is kept (not wired in this round)"
    for degree in ("sep_parallel_degree", "context_parallel_degree"):
        if int(getattr(config, degree, 1) or 1) > 1:
            return f"{degree} > 1: the criterion's loss concat over that group is kept (not wired in this round)"
    if getattr(config, "use_fused_linear_cross_entropy", False):
        return "use_fused_linear_cross_entropy=True: PaddleNLP bypasses lm_head for its own fused loss"
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


def _plain_linear(layer, in_features: int, out_features: int) -> bool:
    """A single-device ``[in, out]`` linear our fused MLP can take the weight of."""
    weight = getattr(layer, "weight", None)
    return (isinstance(layer, nn.Linear) and weight is not None
            and list(weight.shape) == [in_features, out_features])


def _llama_mlp_blocker(mlp) -> str | None:
    if int(getattr(mlp, "tensor_parallel_degree", 1)) > 1:
        return ("tensor_parallel_degree > 1: PaddleNLP's ColumnParallelLinear/RowParallelLinear are kept "
                "(tensor-parallel swap not done this round)")
    hidden, inter = mlp.hidden_size, mlp.intermediate_size
    if getattr(mlp, "fuse_attention_ffn", False):
        ins = [(mlp.gate_up_fused_proj, hidden, 2 * inter)]
    else:
        ins = [(mlp.gate_proj, hidden, inter), (mlp.up_proj, hidden, inter)]
    for layer, fan_in, fan_out in ins + [(mlp.down_proj, inter, hidden)]:
        if not _plain_linear(layer, fan_in, fan_out):
            return f"{type(layer).__name__} is not a plain [in, out] paddle.nn.Linear"
    return None


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

    found = {"rms_norm": (llama.LlamaRMSNorm,), "layer_norm": (gpt.GPTLayerNorm,), "llama_mlp": (llama.LlamaMLP,),
             "mamba_mixer": (), "lm_head": (llama.LlamaLMHead, gpt.GPTLMHead),
             "criterion": (llama.LlamaPretrainingCriterion, gpt.GPTPretrainingCriterion)}
    try:  # the Mamba model arrived in PaddleNLP 3.0.0b4
        from paddlenlp.transformers.mamba import modeling as mamba
    except ImportError:
        return found
    found["rms_norm"] += (mamba.MambaRMSNorm,)
    found["mamba_mixer"] = (mamba.MambaMixer,)
    return found


def _replace(root: nn.Layer, path: str, new: nn.Layer) -> None:
    parent = root
    *parents, name = path.split(".")
    for part in parents:
        parent = parent._sub_layers[part]
    parent._sub_layers[name] = new


def swap_fused_layers(model: nn.Layer, norms: bool = True, mlp: bool = True, mamba: bool = True,
                      lm_head: bool = True, backend: str = "auto") -> SwapReport:
    """Replace, in place, the norms (``norms``), LLaMA MLPs (``mlp``), Mamba mixers (``mamba``) and the
    LLaMA / GPT causal-LM head + criterion (``lm_head``: labelled calls then compute the loss with
    ``linear_cross_entropy`` and return logits=None) of a PaddleNLP LLaMA / GPT / Mamba model with
    paddlenlp_fused layers that own the same parameters; ``backend`` is given to every new layer
    ("auto" follows ``use_backend``). Returns a ``SwapReport``. Call it before wrapping the model for
    distributed training or building a static graph; an optimizer built before it stays valid (same
    parameters)."""
    if not isinstance(model, nn.Layer):
        raise TypeError(f"model: expected a paddle.nn.Layer, got {type(model).__name__}")
    if backend not in ("auto", "triton", "cuda", "reference"):
        raise ValueError(f"backend: expected one of 'auto', 'triton', 'cuda', 'reference', got {backend!r}")
    kinds = _classes()
    report, counts = SwapReport(), Counter()
    replaced: List[str] = []
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
    for path, layer in list(model.named_sublayers()):
        if any(path.startswith(done + ".") for done in replaced):
            continue
        new, kind = None, None
        if isinstance(layer, kinds["rms_norm"]):
            kind = "rms_norm"
            new = _rms_norm(layer, backend) if norms else "norms=False"
        elif isinstance(layer, kinds["layer_norm"]):
            kind = "layer_norm"
            new = _layer_norm(layer, backend) if norms else "norms=False"
        elif isinstance(layer, kinds["llama_mlp"]):
            kind = "llama_mlp"
            blocker = None if mlp else "mlp=False"
            blocker = blocker or _llama_mlp_blocker(layer)
            new = blocker or FusedLlamaMLP(layer, backend)
        elif kinds["mamba_mixer"] and isinstance(layer, kinds["mamba_mixer"]):
            kind = "mamba_mixer"
            new = _mamba_mixer(layer, backend) if mamba else "mamba=False"
        if kind is None:
            continue
        if isinstance(new, str):
            report.skipped.append((path, new))
            continue
        _replace(model, path, new)
        replaced.append(path)
        counts[kind] += 1
        report.swapped_paths.append((path, f"{type(layer).__name__} -> {type(new).__name__}"))
    report.swapped = dict(counts)
    return report
