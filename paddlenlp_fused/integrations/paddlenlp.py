"""Swap paddlenlp_fused layers into PaddleNLP models, in place, keeping their parameters.

    from paddlenlp.transformers import LlamaForCausalLM
    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers
    model = LlamaForCausalLM(config); report = swap_fused_layers(model); print(report)

What is swapped is described per PaddleNLP family in ``FAMILIES`` (PaddleNLP 3.0.0b4 class names; a new
family is one entry): llama, gpt, mamba, qwen, qwen2, qwen2_moe, mistral, mixtral, gemma, chatglm_v2, bloom,
deepseek_v2, deepseek_v3 (deepseek_v2's layers), jamba. A model's families are found from the modules of its
sublayers' classes; a model of none of them is reported as such (its class and modules named).

- norms: the family's RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``GemmaRMSNorm`` scaling by ``1 + weight``,
  ChatGLMv2's ``RMSNorm``...) -> ``FusedRMSNorm`` (same epsilon, weight offset); ``GPTLayerNorm`` and Bloom's
  ``paddle.nn.LayerNorm`` -> ``FusedLayerNorm`` (under sequence parallel their weights keep PaddleNLP's
  ``sequence_parallel`` mark). In float32 each computes what the original does; in 16-bit ours rounds once
  (normalised value times weight in float32), where some originals round the normalised value first;
- mlp: the gated MLPs ``down(act(gate(x)) * up(x))`` (LLaMA, Qwen, Qwen2, Mistral, DeepSeek, Jamba, ChatGLMv2,
  and the MoE families' experts and shared experts, reported as ``<family>_expert``; separate or one fused
  gate-up linear, biases where they have them) -> ``FusedGatedMLP``, one ``fused_mlp_func`` call
  (``swiglu`` for silu, ``geglu`` for tanh-approximate gelu; Gemma's exact-gelu gate is left, reported);
  ``BloomMLP`` -> ``FusedBloomMLP`` (``gelu_approx``); GPT's inline MLP (``linear1`` / gelu / ``linear2`` in
  ``GPTDecoderLayer.forward``) -> one ``fused_mlp_func(activation="gelu_approx")`` call through
  ``FusedGPTMLP`` (how: its docstring). The MoE routing stays PaddleNLP's;
- tensor parallel (``tensor_parallel_degree > 1``; ``integrations.paddlenlp_parallel``): fleet's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` and PaddleNLP's ``ColumnSequenceParallelLinear`` /
  ``RowSequenceParallelLinear`` (attention q/k/v/o, MLP, GPT's qkv/out) -> our
  ``layers.tensor_parallel`` Column/RowParallelLinear owning the same shards (the MLPs then run as one
  ``fused_mlp_func`` call over the group), ``VocabParallelEmbedding`` -> our adapter of the same name;
- mamba: PaddleNLP's ``MambaMixer`` -> ours (``layers.mamba.MambaMixer``; Jamba's mixer, which normalises
  dt, B and C, is left, reported);
- lm_head: on any layer owning a family's ``lm_head`` and ``criterion`` (``HeadSpec`` / ``CriterionSpec``:
  the weight's name and layout, how the criterion averages), ``lm_head`` -> ``FusedLMHead``
  and ``criterion`` -> ``FusedCausalLMCriterion``: a labelled forward computes its loss with
  ``ops.linear_cross_entropy`` and never materialises the ``[batch, seq, vocab]`` logits; with a
  vocabulary-parallel head the op runs over fleet's model-parallel group (``tp_group``), with
  ``sequence_parallel`` on this rank's rows (``sequence_parallel=True``). ChatGLMv2's head (in the base
  model, its criterion outside) is left, reported;
- pipeline models (fleet's ``PipelineLayer``: ``LlamaForCausalLMPipe``, ``Qwen2ForCausalLMPipe``...): the stage
  layers as above, and on the last stage its LM head (``LlamaLMHeadPipe`` and kin, tied ones included: the head
  holding the shared embedding weight) -> ``FusedLMHeadPipe`` and the pretraining criterion in ``_loss_fn`` ->
  ``FusedCausalLMCriterion``: fleet runs the stages, then ``_loss_fn`` on their output, so in training mode the
  head defers and the loss is ``linear_cross_entropy``'s; in eval mode the logits are computed. What cannot be
  swapped (another loss function, a tied model built as one stage, virtual stages) is reported with the reason.

How the LM head is swapped: the model's own ``forward`` is untouched. A forward pre-hook on the model
(the layer owning ``lm_head``) looks for ``labels`` among the call's arguments; while a labelled call
runs, ``FusedLMHead`` returns a ``DeferredLogits`` (the hidden states and the head weight, no matmul)
and ``FusedCausalLMCriterion`` turns it into the loss, with the original criterion's ``ignore_index``
and token mask (tokens with a loss > 0, as most PaddleNLP criteria count them, or Bloom's labels other than
the ignore index; GPT's and Bloom's ``loss_mask`` when given).
Neither model shifts labels (the data collator does), so neither do we. A post-hook (always run) ends the
labelled call and puts ``None`` where the model returned the deferred logits, as PaddleNLP's own
``use_fused_linear_cross_entropy`` path does. Without labels a single-device head runs its original
``forward`` (same weight, same matmul): the logits are bit-identical; a vocabulary-parallel one computes
them on our comm ops, sharded or gathered as ``tensor_parallel_output`` says. Tied embeddings need
nothing special: the head weight is the shared ``Parameter`` (``transpose_y=True``, ``[vocab, hidden]``),
its gradient accumulates from both uses. One difference: GPT's, Mistral's, Mixtral's, Gemma's, QWen's and
Bloom's criteria return NaN (the mean of nothing) when every token is ignored; ours 0.

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
from typing import Callable, Dict, List, Tuple

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
PIPELINE_HEAD_NOTE = ("pipeline: the last stage's head defers its logits in training mode (fleet's train_batch "
                      "feeds them to _loss_fn, which computes the loss with linear_cross_entropy); in eval mode "
                      "(eval_batch, generation) it computes them and the original criterion runs")
ATTENTION_NOTE = "attention (softmax(QK^T)V, rotary or position embeddings) stays PaddleNLP's"


SEQUENCE_PARALLEL_NOTE = (
    "sequence parallel: the gradients of parameters marked sequence_parallel (norm weights, row biases) are "
    "partial sums on each rank; all-reduce them after backward (PaddleNLP's trainer hooks, or "
    "paddlenlp_fused.layers.tensor_parallel.allreduce_sequence_parallel_grads(model))")
ROUTER_NOTE = ("MoE routing (the gate, top-k dispatch and combine, aux losses) stays PaddleNLP's; each expert's MLP "
               "is swapped")
CHATGLM_HEAD_WHY = ("ChatGLMv2's head sits in the base model (output_layer) and returns [seq, batch, vocab] "
                    "transposed, its criterion in ChatGLMv2ForCausalLM: no layer owns both, nothing to defer")
JAMBA_MIXER_WHY = ("JambaMambaMixer RMS-normalises dt, B and C (dt_layernorm, b_layernorm, c_layernorm) inside the "
                   "scan's inputs: our MambaMixer has no such norms")


# --- what each PaddleNLP family holds that we swap: one entry per family, class names as in PaddleNLP 3.0.0b4


@dataclasses.dataclass(frozen=True)
class RMSNormSpec:
    """An RMSNorm class: ``eps`` names the attribute holding its epsilon; it scales by
    ``weight + weight_offset`` (Gemma: 1)."""

    eps: str = "variance_epsilon"
    weight_offset: float = 0.0


@dataclasses.dataclass(frozen=True)
class GatedMLPSpec:
    """A gated MLP ``down(act(gate(x)) * up(x))``: the names of its linears, either ``gate`` and ``up`` or one
    ``fused`` linear whose output halves are [gate | up]; ``fused_flag`` names the attribute choosing between
    the two layouts (absent: ``fused`` if given, else separate). ``activation``: ``"silu"`` / ``"gelu_erf"`` when
    the class hard-codes it, None when it applies ``act_fn`` (PaddleNLP's ``ACT2FN[config.hidden_act]``)."""

    down: str
    gate: str | None = None
    up: str | None = None
    fused: str | None = None
    fused_flag: str | None = None
    activation: str | None = None


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """A causal-LM head: ``weight`` names its parameter; ``transpose`` says whether it is stored
    ``[vocab, hidden]`` (from the head); ``gathers_sequence``: whether its forward gathers sequence-parallel rows."""

    weight: str = "weight"
    transpose: Callable[[nn.Layer], bool] = lambda head: bool(getattr(head, "transpose_y", False))
    gathers_sequence: bool = True


@dataclasses.dataclass(frozen=True)
class CriterionSpec:
    """A causal-LM criterion: its mean runs over the tokens with a positive loss (``"positive_loss"``, LLaMA's
    way) or with a label other than ``ignore_index`` (``"valid_labels"``); ``loss_mask``: whether it takes an
    optional float ``loss_mask`` (its third argument)."""

    count: str = "positive_loss"
    loss_mask: bool = False


@dataclasses.dataclass(frozen=True)
class Family:
    """One PaddleNLP model family (``paddlenlp.transformers.<module>.modeling``) by class name: what we swap
    (norms, MLPs, Mamba mixers, causal-LM heads and their criteria: a head is swapped where one layer owns both
    an ``lm_head`` and a ``criterion`` of these classes) and what we leave, with the reason (``left``)."""

    module: str
    rms_norms: Dict[str, RMSNormSpec] = dataclasses.field(default_factory=dict)
    layer_norms: Tuple[str, ...] = ()
    gated_mlps: Dict[str, GatedMLPSpec] = dataclasses.field(default_factory=dict)
    bloom_mlps: Tuple[str, ...] = ()
    gpt_mlps: Tuple[str, ...] = ()
    mamba_mixers: Tuple[str, ...] = ()
    heads: Dict[str, HeadSpec] = dataclasses.field(default_factory=dict)
    criteria: Dict[str, CriterionSpec] = dataclasses.field(default_factory=dict)
    attention: Tuple[str, ...] = ()
    left: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)  # class: (kind, why)
    notes: Tuple[str, ...] = ()


_LLAMA_STYLE = GatedMLPSpec(down="down_proj", gate="gate_proj", up="up_proj", fused="gate_up_fused_proj",
                            fused_flag="fuse_attention_ffn")
_SEPARATE = GatedMLPSpec(down="down_proj", gate="gate_proj", up="up_proj")
_UNTRANSPOSED = HeadSpec(transpose=lambda head: False)
_PLAIN_LAYER_NORM = "paddle.nn.LayerNorm"  # a family listing it swaps paddle's own LayerNorm in its models

FAMILIES: Dict[str, Family] = {
    "llama": Family("llama", rms_norms={"LlamaRMSNorm": RMSNormSpec()},
                    gated_mlps={"LlamaMLP": dataclasses.replace(_LLAMA_STYLE, activation="silu")},
                    heads={"LlamaLMHead": HeadSpec()}, criteria={"LlamaPretrainingCriterion": CriterionSpec()},
                    attention=("LlamaAttention",)),
    "gpt": Family("gpt", layer_norms=("GPTLayerNorm",), gpt_mlps=("GPTDecoderLayer",),
                  heads={"GPTLMHead": HeadSpec()},
                  criteria={"GPTPretrainingCriterion": CriterionSpec(loss_mask=True)},
                  attention=("MultiHeadAttention",)),
    "mamba": Family("mamba", rms_norms={"MambaRMSNorm": RMSNormSpec()}, mamba_mixers=("MambaMixer",),
                    notes=(MAMBA_HEAD_NOTE,)),
    "qwen2": Family("qwen2", rms_norms={"Qwen2RMSNorm": RMSNormSpec()}, gated_mlps={"Qwen2MLP": _LLAMA_STYLE},
                    heads={"Qwen2LMHead": HeadSpec()}, criteria={"Qwen2PretrainingCriterion": CriterionSpec()},
                    attention=("Qwen2Attention",)),
    "qwen2_moe": Family("qwen2_moe", rms_norms={"Qwen2MoeRMSNorm": RMSNormSpec()},
                        gated_mlps={"Qwen2MoeMLP": _LLAMA_STYLE},
                        heads={"Qwen2MoeLMHead": _UNTRANSPOSED},
                        criteria={"Qwen2MoePretrainingCriterion": CriterionSpec()},
                        attention=("Qwen2MoeAttention",), notes=(ROUTER_NOTE,)),
    "mistral": Family("mistral", rms_norms={"MistralRMSNorm": RMSNormSpec()}, gated_mlps={"MistralMLP": _SEPARATE},
                      heads={"MistralLMHead": dataclasses.replace(_UNTRANSPOSED, gathers_sequence=False)},
                      criteria={"MistralPretrainingCriterion": CriterionSpec()}, attention=("MistralAttention",)),
    "mixtral": Family("mixtral", rms_norms={"MixtralRMSNorm": RMSNormSpec()},
                      gated_mlps={"MixtralMLP": GatedMLPSpec(down="w2", gate="w1", up="w3")},
                      heads={"MixtralLMHead": _UNTRANSPOSED},
                      criteria={"MixtralPretrainingCriterion": CriterionSpec()},
                      attention=("MixtralAttention",), notes=(ROUTER_NOTE,)),
    "gemma": Family("gemma", rms_norms={"GemmaRMSNorm": RMSNormSpec(weight_offset=1.0)},
                    gated_mlps={"GemmaMLP": dataclasses.replace(_SEPARATE, activation="gelu_erf")},
                    heads={"GemmaLMHead": HeadSpec(transpose=lambda head: bool(head.config.tie_word_embeddings))},
                    criteria={"GemmaPretrainingCriterion": CriterionSpec()}, attention=("GemmaAttention",)),
    "chatglm_v2": Family("chatglm_v2", rms_norms={"RMSNorm": RMSNormSpec(eps="epsilon")},
                         gated_mlps={"MLP": GatedMLPSpec(down="dense_4h_to_h", fused="dense_h_to_4h",
                                                         activation="silu")},
                         attention=("SelfAttention",),
                         left={"Chatglmv2LMHead": ("lm_head", CHATGLM_HEAD_WHY)}),
    "bloom": Family("bloom", layer_norms=(_PLAIN_LAYER_NORM,), bloom_mlps=("BloomMLP",),
                    heads={"BloomLMHead": HeadSpec(weight="decoder_weight", transpose=lambda head: True,
                                                   gathers_sequence=False)},
                    criteria={"BloomPretrainingCriterion": CriterionSpec(count="valid_labels", loss_mask=True)},
                    attention=("BloomAttention",)),
    "deepseek_v2": Family("deepseek_v2", rms_norms={"DeepseekV2RMSNorm": RMSNormSpec()},
                          gated_mlps={"DeepseekV2MLP": _SEPARATE},
                          heads={"DeepseekV2LMHead": _UNTRANSPOSED},
                          criteria={"DeepseekV2PretrainingCriterion": CriterionSpec()},
                          attention=("DeepseekV2Attention",), notes=(ROUTER_NOTE,)),
    "deepseek_v3": Family("deepseek_v3"),  # its layers are deepseek_v2's classes
    "jamba": Family("jamba", rms_norms={"JambaRMSNorm": RMSNormSpec()}, gated_mlps={"JambaMLP": _SEPARATE},
                    heads={"JambaLMHead": dataclasses.replace(_UNTRANSPOSED, gathers_sequence=False)},
                    criteria={"JambaPretrainingCriterion": CriterionSpec()},
                    attention=("JambaAttention",), notes=(ROUTER_NOTE,),
                    left={"JambaMambaMixer": ("mamba_mixer", JAMBA_MIXER_WHY)}),
    "qwen": Family("qwen", rms_norms={"QWenRMSNorm": RMSNormSpec(eps="eps")},
                   gated_mlps={"QWenMLP": GatedMLPSpec(down="c_proj", gate="w2", up="w1", fused="gate_up_fused_proj",
                                                       fused_flag="fuse_attention_ffn", activation="silu")},
                   heads={"QWenLMHead": _UNTRANSPOSED}, criteria={"QWenPretrainingCriterion": CriterionSpec()},
                   attention=("QWenAttention",)),
}


# report categories, in print order, of the swap's kinds
CATEGORIES = {"norm": ("rms_norm", "layer_norm"), "mlp": ("mlp",), "moe experts": ("expert",),
              "lm_head": ("lm_head", "criterion"), "mamba": ("mamba_mixer",),
              "parallel linears": ("parallel_linear", "vocab_parallel_embedding")}


def category(kind: str) -> str:
    """The report category of a swap kind (``rms_norm`` -> ``norm``, ``qwen2_mlp`` -> ``mlp``...)."""
    for name, kinds in CATEGORIES.items():
        if kind in kinds or any(kind.endswith("_" + k) for k in kinds):
            return name
    raise KeyError(kind)


@dataclasses.dataclass
class SwapReport:
    """``swapped``: {kind: count}; ``swapped_paths``: (sublayer path, old class -> new class);
    ``skipped``: (sublayer path, why it was left alone); ``kinds``: {path: kind} of both; ``families``: the
    PaddleNLP families found in the model; ``notes``: what the swap does not cover in this model (an
    unsupported model names itself and what is missing). ``str(report)`` lists them per category
    (``CATEGORIES``: norm, mlp, moe experts, lm_head, mamba, parallel linears)."""

    swapped: Dict[str, int] = dataclasses.field(default_factory=dict)
    swapped_paths: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    kinds: Dict[str, str] = dataclasses.field(default_factory=dict)
    families: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.swapped.values())

    def by_category(self) -> Dict[str, dict]:
        """{category: {"swapped": {kind: count}, "left": [(path, why)]}} for the categories with entries."""
        out: Dict[str, dict] = {}
        for kind, n in sorted(self.swapped.items()):
            out.setdefault(category(kind), {"swapped": {}, "left": []})["swapped"][kind] = n
        for path, why in self.skipped:
            out.setdefault(category(self.kinds[path]), {"swapped": {}, "left": []})["left"].append((path, why))
        return {name: out[name] for name in CATEGORIES if name in out}

    def __str__(self) -> str:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.swapped.items())) or "nothing"
        lines = [f"swap_fused_layers ({', '.join(self.families) or 'no known family'}): swapped {counts}"]
        for name, entry in self.by_category().items():
            swapped = ", ".join(f"{kind} {n}" for kind, n in entry["swapped"].items()) or "nothing"
            lines.append(f"  {name}: swapped {swapped}")
            lines += [f"    left alone {path}: {why}" for path, why in entry["left"]]
        lines += [f"  not covered: {note}" for note in self.notes]
        return "\n".join(lines)


class FusedGatedMLP(nn.Layer):
    """A PaddleNLP gated MLP ``down(act(gate(x)) * up(x))`` (LLaMA, Qwen, Qwen2, Mistral, Mixtral's and the MoE
    families' experts, DeepSeek, Jamba, ChatGLMv2: ``GatedMLPSpec`` names its linears) as one ``fused_mlp_func``
    call, ``activation`` ``"swiglu"`` (silu) or ``"geglu"`` (tanh-approximate gelu).

    Holds the original ``Linear`` sublayers under their names, so the state dict is unchanged. With separate
    gate/up weights the fused ``[hidden, 2 * intermediate]`` weight (and bias) is concatenated each call (gate
    then up, the order the gated activation splits it in); the gradient flows back through the concat to both
    parameters. A fused linear's output halves are [gate | up] already (LLaMA's ``gate_up_fused_proj``,
    ChatGLMv2's ``dense_h_to_4h``).

    Tensor parallel: the sublayers are then our ``ColumnParallelLinear`` (gate, up: this rank's
    ``[hidden, intermediate / n]`` columns; a fused one: PaddleNLP's per-rank ``[gate shard | up shard]``) and
    ``RowParallelLinear`` (down: ``[intermediate / n, hidden]``), as ``swap_fused_layers`` makes them from
    fleet's, and the call passes their group (``process_group``) and ``sequence_parallel`` to
    ``fused_mlp_func``: the input all-gather (sequence parallel) or identity/all-reduce pair and the output
    reduce-scatter or all-reduce happen inside it.
    """

    def __init__(self, mlp: nn.Layer, spec: GatedMLPSpec, activation: str, backend: str = "auto"):
        super().__init__()
        self.fused = _uses_fused(mlp, spec)
        self.input_names = (spec.fused,) if self.fused else (spec.gate, spec.up)
        self.down_name = spec.down
        wanted = self.input_names + (spec.down,)
        for name in [name for name in mlp._sub_layers if name in wanted]:  # the original's order: same state dict
            setattr(self, name, getattr(mlp, name))
        down = getattr(mlp, spec.down)
        self.intermediate_size, self.hidden_size = (int(n) for n in down.weight.shape)  # this rank's intermediate
        self.activation = activation
        self.process_group = getattr(down, "pg", None)
        self.sequence_parallel = bool(getattr(down, "sequence_parallel", False))
        self.backend = backend

    def _gate_up(self):
        layers = [getattr(self, name) for name in self.input_names]
        if len(layers) == 1:
            return layers[0].weight, layers[0].bias
        gate, up = layers
        if (gate.bias is None) != (up.bias is None):
            raise ValueError(f"{self.input_names[0]}/{self.input_names[1]}: expected both or neither to have a bias")
        bias = None if gate.bias is None else paddle.concat([gate.bias, up.bias], axis=0)
        return paddle.concat([gate.weight, up.weight], axis=1), bias

    def forward(self, x):
        """x [..., hidden] (sequence parallel: this rank's rows [tokens / n, hidden]) -> the same shape."""
        weight1, bias1 = self._gate_up()
        down = getattr(self, self.down_name)
        return fused_mlp_func(x, weight1, down.weight, bias1, down.bias, activation=self.activation,
                              process_group=self.process_group, sequence_parallel=self.sequence_parallel,
                              backend=self.backend)

    def extra_repr(self) -> str:
        ranks = self.process_group.world_size if self.process_group is not None else 1
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size} (this rank's), "
                f"linears={list(self.input_names) + [self.down_name]}, activation={self.activation}, "
                f"tensor_parallel={ranks}, sequence_parallel={self.sequence_parallel}, backend={self.backend}")


FusedLlamaMLP = FusedGatedMLP  # its name before the other families came


def _uses_fused(mlp, spec: GatedMLPSpec) -> bool:
    if spec.fused_flag is not None:
        return bool(getattr(mlp, spec.fused_flag, False))
    return spec.fused is not None


def _gated_activation(mlp, spec: GatedMLPSpec):
    """("swiglu" | "geglu", None) for the activation ``mlp`` gates with, or (None, the reason it is not fused)."""
    from paddlenlp.transformers import activations

    act = spec.activation
    if act is None:
        fn = getattr(mlp, "act_fn", None)
        if isinstance(fn, activations.SiLUActivation) or fn in (paddle.nn.functional.silu, paddle.nn.functional.swish) \
                or getattr(fn, "__name__", "") == "swiglu":  # Qwen2's fusion_ops.swiglu for hidden_act "silu"
            act = "silu"
        elif isinstance(fn, activations.NewGELUActivation):
            act = "gelu_tanh"
        else:
            act = f"{type(fn).__name__ if isinstance(fn, nn.Layer) else getattr(fn, '__name__', fn)}"
    if act == "silu":
        return "swiglu", None
    if act == "gelu_tanh":
        return "geglu", None
    if act == "gelu_erf":
        return None, ("gates with exact (erf) gelu: fused_mlp_func's geglu is the tanh approximation (an erf "
                      "geglu activation would be needed)")
    return None, f"activation {act}: only silu (swiglu) and tanh-approximate gelu (geglu) gates are fused"


def _gated_mlp(mlp, spec: GatedMLPSpec, backend: str):
    activation, why = _gated_activation(mlp, spec)
    if why:
        return why
    fused = _uses_fused(mlp, spec)
    names = (spec.fused,) if fused else (spec.gate, spec.up)
    down = getattr(mlp, spec.down)
    inter = int(down.weight.shape[0])
    blocker = _mlp_blocker([getattr(mlp, name) for name in names], down, [2 * inter] if fused else [inter, inter])
    return blocker or FusedGatedMLP(mlp, spec, activation, backend)


class FusedBloomMLP(nn.Layer):
    """PaddleNLP's ``BloomMLP``: ``residual + dropout(dense_4h_to_h(bloom_gelu(dense_h_to_4h(x))))``, the MLP
    as one ``fused_mlp_func(activation="gelu_approx")`` call (Bloom's gelu is the tanh approximation), the
    dropout-add as Bloom's ``dropout_add``. Holds the two linears under their names."""

    def __init__(self, mlp: nn.Layer, backend: str = "auto"):
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h = mlp.dense_h_to_4h, mlp.dense_4h_to_h
        self.hidden_dropout = mlp.hidden_dropout
        self.process_group = getattr(self.dense_4h_to_h, "pg", None)
        self.sequence_parallel = bool(getattr(self.dense_4h_to_h, "sequence_parallel", False))
        self.backend = backend

    def forward(self, hidden_states, residual):
        out = fused_mlp_func(hidden_states, self.dense_h_to_4h.weight, self.dense_4h_to_h.weight,
                             self.dense_h_to_4h.bias, self.dense_4h_to_h.bias, activation="gelu_approx",
                             process_group=self.process_group, sequence_parallel=self.sequence_parallel,
                             backend=self.backend)
        return residual + paddle.nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)


def _bloom_mlp(mlp, backend: str):
    if mlp.pretraining_tp > 1 and mlp.slow_but_exact:
        return "pretraining_tp > 1 with slow_but_exact: the sliced down projection is kept"
    inter = int(mlp.dense_4h_to_h.weight.shape[0])
    return _mlp_blocker([mlp.dense_h_to_4h], mlp.dense_4h_to_h, [inter]) or FusedBloomMLP(mlp, backend)


def _mlp_blocker(columns, row, local_widths) -> str | None:
    """Whether an MLP's input linears ``columns`` (this rank's output widths ``local_widths``) and output linear
    ``row`` are ones ``fused_mlp_func`` can take the weights of: all plain ``[in, out]`` ``paddle.nn.Linear``, or
    all ours (column ``gather_output=False`` / row ``input_is_parallel``) on one group with one
    ``sequence_parallel`` setting (what the tensor-parallel swap makes of fleet's)."""
    fleet_column, fleet_row, _, _ = fleet_classes()
    layers = list(columns) + [row]
    if any(isinstance(layer, fleet_column + fleet_row) for layer in layers):
        return "fleet's parallel linears are kept (see their own entries)"
    if not all(isinstance(layer, nn.Linear) for layer in layers):
        if not (all(isinstance(layer, ColumnParallelLinear) and not layer.gather_output for layer in columns)
                and isinstance(row, RowParallelLinear) and row.input_is_parallel):
            return ", ".join(type(layer).__name__ for layer in layers) + ": not plain Linear nor our parallel linears"
        if len({_group_key(layer) for layer in layers}) != 1 or \
                len({bool(layer.sequence_parallel) for layer in layers}) != 1:
            return "the parallel linears differ in group or sequence_parallel"
    inter, hidden = (int(n) for n in row.weight.shape)
    for layer, width in zip(columns, local_widths):
        if list(layer.weight.shape) != [hidden, width]:
            return f"{type(layer).__name__} weight {list(layer.weight.shape)} is not [{hidden}, {width}]"
    return None


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

    def astype(self, dtype):
        """Mistral's forward casts the logits to float32 before its criterion: ours computes the loss in
        float32 anyway, so that cast is the identity here."""
        if str(dtype).split(".")[-1] != "float32":
            raise NotImplementedError(f"deferred logits: only a float32 cast is supported, got {dtype}")
        return self


class FusedLMHead(nn.Layer):
    """A PaddleNLP causal-LM head (``HeadSpec``: LLaMA's, GPT's, Qwen2's, Mistral's...) owning the same weight
    under the same name. ``defer`` (set by the model's pre-hook for a labelled call) makes it return
    ``DeferredLogits``. Otherwise, on one device, it calls the original head (kept out of the sublayers and
    the state dict), so the logits are exactly the original's; with a vocabulary-parallel weight
    (``tensor_parallel_degree > 1``) or ``sequence_parallel`` it computes them with our comm ops
    (``paddlenlp_parallel.parallel_logits``: fleet's ``parallel_matmul`` has no CPU kernels), sharded
    over the vocabulary or gathered as ``tensor_parallel_output`` (the call's, else the config's) says."""

    def __init__(self, head: nn.Layer, spec: HeadSpec | None = None):
        super().__init__()
        spec = spec or _spec_of(head, "heads", HeadSpec())
        self.config, self.transpose_y = head.config, spec.transpose(head)
        self.weight_name = spec.weight
        setattr(self, spec.weight, getattr(head, spec.weight))
        object.__setattr__(self, "_original_head", head)  # not a sublayer: its weight is ours already
        weight = self.head_weight
        self.tp_group = comm.model_parallel_group() if getattr(weight, "is_distributed", False) else None
        self.sequence_parallel = bool(getattr(self.config, "sequence_parallel", False)) and spec.gathers_sequence
        self.defer = False

    @property
    def head_weight(self):
        return getattr(self, self.weight_name)

    def forward(self, hidden_states, tensor_parallel_output=None):
        """hidden_states [batch, seq, hidden] (sequence parallel: [batch * seq / n, hidden]) -> logits
        [batch, seq, vocab or vocab / n] (DeferredLogits if ``defer``)."""
        if self.defers():
            return DeferredLogits(hidden_states, self.head_weight, self.transpose_y, self.tp_group,
                                  self.sequence_parallel)
        if self.tp_group is None and not self.sequence_parallel:
            return self._original_head(hidden_states, tensor_parallel_output)
        if tensor_parallel_output is None:
            tensor_parallel_output = bool(self.config.tensor_parallel_output) and self.tp_group is not None
        return parallel_logits(hidden_states, self.head_weight, self.transpose_y, self.tp_group,
                               self.sequence_parallel, self.config.seq_length, tensor_parallel_output)

    def defers(self) -> bool:
        return self.defer

    def extra_repr(self) -> str:
        ranks = self.tp_group.world_size if self.tp_group is not None else 1
        return (f"{self.weight_name}={list(self.head_weight.shape)}, transpose_y={self.transpose_y}, "
                f"tensor_parallel={ranks}, sequence_parallel={self.sequence_parallel}")


class FusedLMHeadPipe(FusedLMHead):
    """The LM head of a pipeline model's last stage (``LlamaLMHeadPipe`` and kin). Fleet's ``PipelineParallel``
    calls the stages' ``forward`` and then ``_loss_fn`` on the output without passing labels through the model, and
    its ``train_batch`` always computes the loss: so this head defers while the layer is in training mode, and in
    eval mode (``eval_batch``, generation, where the loss is optional) computes the logits as the original."""

    def defers(self) -> bool:
        return self.training

    @property
    def embedding_weight(self):
        """The attribute PaddleNLP's ``SharedLayerDesc`` names as the shared weight (``shared_weight_attr``)."""
        return self.head_weight


class FusedCausalLMCriterion(nn.Layer):
    """A PaddleNLP causal-LM criterion (``CriterionSpec``): on ``DeferredLogits`` the same mean loss through
    ``linear_cross_entropy`` (float32, no logits held; vocabulary parallel over the head's group, the labels cut
    to this rank's sequence chunk under sequence parallel); on real logits the original criterion (kept as the
    ``original`` sublayer: it has no parameters, so the state dict is unchanged). Under tensor parallelism
    every rank returns the same (global) loss, as PaddleNLP's."""

    def __init__(self, criterion: nn.Layer, spec: CriterionSpec | None = None, backend: str = "auto"):
        super().__init__()
        spec = spec or _spec_of(criterion, "criteria", CriterionSpec())
        self.original = criterion
        loss_func = getattr(criterion, "loss_func", None)
        self.ignore_index = int(getattr(criterion, "ignore_index", getattr(loss_func, "ignore_index", -100)))
        self.count, self.takes_loss_mask = spec.count, spec.loss_mask
        self.backend = backend

    def forward(self, prediction_scores, masked_lm_labels, *args, **kwargs):
        """prediction_scores: logits [batch, seq, vocab] or DeferredLogits; masked_lm_labels [batch, seq]
        int; GPT's and Bloom's optional ``loss_mask`` [batch * seq] float; DeepSeek's (empty) ``mtp_logits``.
        Returns the scalar float32 loss."""
        if not isinstance(prediction_scores, DeferredLogits):
            return self.original(prediction_scores, masked_lm_labels, *args, **kwargs)
        if kwargs.get("mtp_logits"):
            raise NotImplementedError("multi-token-prediction logits: the swap leaves such a head alone")
        loss_mask = (args[0] if args else kwargs.get("loss_mask")) if self.takes_loss_mask else None
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
            if self.count == "valid_labels":
                mask = (labels.reshape([-1]) != self.ignore_index).astype("float32")
            else:  # PaddleNLP counts the tokens with a positive loss (ignored ones have 0)
                mask = (token_loss > 0).astype("float32")
            return paddle.sum(token_loss * mask) / paddle.clip(mask.sum(), min=1.0)  # count 0 gives 0

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, count={self.count}, backend={self.backend}"


def _lm_head_blocker(head, head_spec: HeadSpec) -> str | None:
    config = head.config
    for degree in ("sep_parallel_degree", "context_parallel_degree"):
        if int(getattr(config, degree, 1) or 1) > 1:
            return f"{degree} > 1: the criterion's loss concat over that group is kept (not wired in)"
    if getattr(config, "use_fused_linear_cross_entropy", False):
        return ("use_fused_linear_cross_entropy=True: PaddleNLP bypasses lm_head for its own fused loss "
                "(paddlenlp_fused.integrations.enable() points that loss at our op)")
    if int(getattr(config, "num_nextn_predict_layers", 0) or 0) > 0:
        return "num_nextn_predict_layers > 0: the multi-token-prediction losses are kept (not wired in)"
    weight = getattr(head, head_spec.weight)
    if getattr(weight, "is_distributed", False) and comm.model_parallel_group() is None:
        return "the head's weight is marked distributed but fleet's model-parallel group has one rank (or none)"
    return None


def _labels_of(signature: inspect.Signature, owner, args, kwargs):
    try:
        return signature.bind(owner, *args, **kwargs).arguments.get("labels")
    except TypeError:  # a call the forward itself will reject; let it
        return None


def _swap_lm_head(owner: nn.Layer, head_spec: HeadSpec, criterion_spec: CriterionSpec, backend: str):
    """(new head, new criterion) for ``owner`` (a causal-LM model), hooks installed, or the reason not."""
    blocker = _lm_head_blocker(owner.lm_head, head_spec)
    if blocker:
        return blocker
    signature = inspect.signature(type(owner).forward)
    if "labels" not in signature.parameters:
        return f"{type(owner).__name__}.forward takes no labels"
    head = FusedLMHead(owner.lm_head, head_spec)
    criterion = FusedCausalLMCriterion(owner.criterion, criterion_spec, backend)

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
    blocker = _mlp_blocker([layer.linear1], layer.linear2, [int(layer.linear2.weight.shape[0])])
    if blocker:
        return blocker
    fused = FusedGPTMLP(layer, backend)
    fused.install(layer)
    return fused


def _rms_norm(old, spec: RMSNormSpec, backend: str) -> FusedRMSNorm:
    new = FusedRMSNorm(int(old.weight.shape[0]), epsilon=getattr(old, spec.eps), weight_offset=spec.weight_offset,
                       backend=backend)
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


def _replace(root: nn.Layer, path: str, new: nn.Layer) -> None:
    parent = root
    *parents, name = path.split(".")
    for part in parents:
        parent = parent._sub_layers[part]
    parent._sub_layers[name] = new


def _spec_of(layer, table: str, default):
    """The ``FAMILIES`` spec of ``layer``'s class (``table``: "heads" or "criteria"), else ``default``."""
    family = _module_family(type(layer).__module__)
    return getattr(FAMILIES[family], table).get(type(layer).__name__, default) if family else default


def _module_family(module: str) -> str | None:
    """The FAMILIES key of a PaddleNLP class's module (``paddlenlp.transformers.qwen2.modeling`` -> qwen2)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["paddlenlp", "transformers"] and parts[2] in FAMILIES:
        return parts[2]
    return None


def _family_classes(names: List[str]) -> Dict[type, Tuple[str, str, object]]:
    """{class: (handler, family, spec)} of the given families (``handler`` picks the swap in ``_new_layer``;
    PaddleNLP is imported here: it is optional). Classes an installed PaddleNLP lacks are passed over."""
    import importlib

    found: Dict[type, Tuple[str, str, object]] = {}
    for name in names:
        family = FAMILIES[name]
        modeling = importlib.import_module(f"paddlenlp.transformers.{family.module}.modeling")
        entries = [(cls, ("rms_norm", spec)) for cls, spec in family.rms_norms.items()]
        entries += [(cls, ("layer_norm", None)) for cls in family.layer_norms]
        entries += [(cls, ("gated_mlp", spec)) for cls, spec in family.gated_mlps.items()]
        entries += [(cls, ("bloom_mlp", None)) for cls in family.bloom_mlps]
        entries += [(cls, ("gpt_mlp", None)) for cls in family.gpt_mlps]
        entries += [(cls, ("mamba_mixer", None)) for cls in family.mamba_mixers]
        entries += [(cls, ("lm_head", spec)) for cls, spec in family.heads.items()]
        entries += [(cls, ("criterion", spec)) for cls, spec in family.criteria.items()]
        entries += [(cls, ("attention", None)) for cls in family.attention]
        entries += [(cls, ("left", why)) for cls, why in family.left.items()]
        for cls_name, (handler, spec) in entries:
            cls = nn.LayerNorm if cls_name == _PLAIN_LAYER_NORM else getattr(modeling, cls_name, None)
            if cls is not None:
                found[cls] = (handler, name, spec)
    return found


def _entry(classes, layer, default=(None, None, None)):
    """``classes``' entry for ``layer``: its class's, else its nearest listed base class's (a user subclass)."""
    return next((classes[cls] for cls in type(layer).__mro__ if cls in classes), default)


def _mlp_kind(family: str, path: str) -> str:
    return f"{family}_expert" if ".experts." in f".{path}." else f"{family}_mlp"


def _new_layer(path: str, layer, classes, options: dict, backend: str):
    """(kind, the layer replacing ``layer`` or the reason not), or (None, None) for a layer not swapped.
    Kind ``gpt_mlp`` installs a ``FusedGPTMLP`` on the decoder layer itself (kept in place)."""
    column, row, _, embedding = fleet_classes()
    if isinstance(layer, column + row):
        return "parallel_linear", parallel_linear(layer, backend) if options["tensor_parallel"] \
            else "tensor_parallel=False"
    if isinstance(layer, embedding):
        return "vocab_parallel_embedding", VocabParallelEmbedding(layer) if options["tensor_parallel"] \
            else "tensor_parallel=False"
    handler, family, spec = _entry(classes, layer)
    if handler == "rms_norm":
        return "rms_norm", _rms_norm(layer, spec, backend) if options["norms"] else "norms=False"
    if handler == "layer_norm":
        return "layer_norm", _layer_norm(layer, backend) if options["norms"] else "norms=False"
    if handler in ("gated_mlp", "bloom_mlp", "gpt_mlp"):
        kind = _mlp_kind(family, path)
        if not options["mlp"]:
            return kind, "mlp=False"
        if handler == "gated_mlp":
            return kind, _gated_mlp(layer, spec, backend)
        return kind, _bloom_mlp(layer, backend) if handler == "bloom_mlp" else _gpt_mlp(layer, backend)
    if handler == "mamba_mixer":
        return "mamba_mixer", _mamba_mixer(layer, backend) if options["mamba"] else "mamba=False"
    if handler == "left":
        return spec
    return None, None


def _swap_lm_heads(model, classes, lm_head: bool, backend: str, report: SwapReport, counts: Counter, replaced):
    for path, owner in [("", model)] + list(model.named_sublayers()):
        head, criterion = owner._sub_layers.get("lm_head"), owner._sub_layers.get("criterion")
        head_entry, criterion_entry = _entry(classes, head, None), _entry(classes, criterion, None)
        if not (head_entry and head_entry[0] == "lm_head" and criterion_entry and criterion_entry[0] == "criterion"):
            continue
        prefix = path + "." if path else ""
        new = _swap_lm_head(owner, head_entry[2], criterion_entry[2], backend) if lm_head else "lm_head=False"
        if isinstance(new, str):
            report.skipped.append((prefix + "lm_head", new))
            report.kinds[prefix + "lm_head"] = "lm_head"
            continue
        for name, layer in zip(("lm_head", "criterion"), new):
            report.swapped_paths.append((prefix + name, f"{type(owner._sub_layers[name]).__name__} -> "
                                                        f"{type(layer).__name__}"))
            report.kinds[prefix + name] = name
            owner._sub_layers[name] = layer
            replaced.append(prefix + name)
            counts[name] += 1


def _pipeline_head_blocker(model, stage, head_entry, criterion_index) -> str | None:
    if model._num_virtual_pipeline_stages > 1:
        return "virtual pipeline stages > 1: the interleaved chunks' run functions are not wired in"
    if model._recompute_interval > 0:
        return "pipeline recompute_interval > 0: fleet's recompute of the last segment needs tensor outputs"
    if not (head_entry and head_entry[0] == "lm_head"):
        shared = any(stage is layer for layer in model.shared_layers.values())
        return (f"the last stage layer is {type(stage).__name__}, not a family's LM head"
                + (" (a tied model on one stage: PaddleNLP runs the shared embedding layer there, its own forward "
                   "fails the same)" if shared else ""))
    if criterion_index is None:
        names = ", ".join(type(fn).__name__ for fn in model._loss_fn)
        return f"the pipeline's loss function ({names}) is not a family's pretraining criterion: it needs the logits"
    return _lm_head_blocker(stage, head_entry[2])


def _swap_pipeline_head(model, classes, lm_head: bool, backend: str, report: SwapReport, counts: Counter,
                        replaced) -> bool:
    """A fleet ``PipelineLayer`` (PaddleNLP's ``*ForCausalLMPipe``): its last stage layer, the LM head, ->
    ``FusedLMHeadPipe`` (in ``run_function`` and wherever it is a sublayer: ``shared_layers`` for a tied head)
    and its pretraining criterion in ``_loss_fn`` -> ``FusedCausalLMCriterion``. Returns whether ``model`` is a
    pipeline layer."""
    try:
        from paddle.distributed.fleet.meta_parallel import PipelineLayer
    except ImportError:  # a Paddle build without fleet has no pipeline models
        return False
    if not isinstance(model, PipelineLayer):
        return False
    if model._stage_id != model._num_stages - 1:
        report.notes.append(f"pipeline stage {model._stage_id} of {model._num_stages}: no LM head here (the last "
                            "stage's swap fuses it)")
        return True
    stage = model.run_function[-1] if model.run_function else None
    head_entry = _entry(classes, stage, None) if isinstance(stage, nn.Layer) else None
    criterion_index = next((i for i, fn in enumerate(model._loss_fn)
                            if isinstance(fn, nn.Layer) and (_entry(classes, fn, None) or ("",))[0] == "criterion"),
                           None)
    parents = [(prefix, parent, name) for prefix, parent in model.named_sublayers(include_self=True)
               for name, layer in parent._sub_layers.items() if layer is stage]
    path = next((f"{prefix}.{name}" if prefix else name for prefix, _, name in parents), "run_function[-1]")
    if head_entry and head_entry[0] == "left":  # reported by the sublayer pass, with its family's reason
        return True
    reason = _pipeline_head_blocker(model, stage, head_entry, criterion_index) if lm_head else "lm_head=False"
    report.kinds[path] = "lm_head"
    if reason:
        report.skipped.append((path, reason))
        return True
    head = FusedLMHeadPipe(stage, head_entry[2])
    head.train(stage.training)
    original = model._loss_fn[criterion_index]
    criterion = FusedCausalLMCriterion(original, _entry(classes, original)[2], backend)
    model.run_function[-1] = head
    for _, parent, name in parents:
        parent._sub_layers[name] = head
    model._loss_fn[criterion_index] = criterion
    loss_path = f"_loss_fn[{criterion_index}]"
    report.kinds[loss_path] = "criterion"
    report.swapped_paths += [(path, f"{type(stage).__name__} -> FusedLMHeadPipe"),
                             (loss_path, f"{type(original).__name__} -> FusedCausalLMCriterion")]
    replaced.append(path)
    counts["lm_head"] += 1
    counts["criterion"] += 1
    report.notes.append(PIPELINE_HEAD_NOTE)
    return True


def swap_fused_layers(model: nn.Layer, norms: bool = True, mlp: bool = True, mamba: bool = True,
                      lm_head: bool = True, tensor_parallel: bool = True, backend: str = "auto") -> SwapReport:
    """Replace, in place, the norms (``norms``), MLPs and MoE experts' MLPs (``mlp``), Mamba mixers
    (``mamba``), the causal-LM head + criterion (``lm_head``: labelled calls then compute the loss with
    ``linear_cross_entropy`` and return logits=None) and fleet's tensor-parallel linears and
    vocabulary-parallel embeddings (``tensor_parallel``) of a PaddleNLP model of one of the ``FAMILIES`` with
    paddlenlp_fused layers that own the same parameters; ``backend`` is given to every new layer ("auto"
    follows ``use_backend``). Returns a ``SwapReport``: per kind what was swapped, what was left and why. Call
    it after ``fleet.init`` (for a tensor-parallel model) and before wrapping the model for distributed
    training or building a static graph; an optimizer built before it stays valid (same parameters)."""
    if not isinstance(model, nn.Layer):
        raise TypeError(f"model: expected a paddle.nn.Layer, got {type(model).__name__}")
    if backend not in ("auto", "triton", "cuda", "reference"):
        raise ValueError(f"backend: expected one of 'auto', 'triton', 'cuda', 'reference', got {backend!r}")
    import paddlenlp.transformers  # noqa: F401  (the optional dependency: its ImportError says what is missing)

    present = [layer for _, layer in model.named_sublayers(include_self=True)]
    modules = sorted({type(layer).__module__ for layer in present if type(layer).__module__.startswith("paddlenlp.")})
    families = sorted({_module_family(module) for module in modules} - {None})
    classes = _family_classes(families)
    options = dict(norms=norms, mlp=mlp, mamba=mamba, tensor_parallel=tensor_parallel)
    report, counts = SwapReport(families=families), Counter()
    replaced: List[str] = []
    # fleet's parallel layers first, so that the MLP swaps find ours under an MLP / GPT layer
    _swap_sublayers(model, {}, options, backend, report, counts, replaced, parallel_only=True)
    _swap_lm_heads(model, classes, lm_head, backend, report, counts, replaced)
    pipeline = _swap_pipeline_head(model, classes, lm_head, backend, report, counts, replaced)
    _swap_sublayers(model, classes, options, backend, report, counts, replaced, parallel_only=False)
    report.swapped = dict(counts)
    if not families:
        where = ", ".join(modules) or f"{type(model).__module__} (not PaddleNLP's)"
        report.notes.append(f"{type(model).__name__}: no family swap_fused_layers knows (its classes come from "
                            f"{where}); known: {', '.join(FAMILIES)}")
    if counts["lm_head"] and not pipeline:
        report.notes.append(LOGITS_NOTE)
    for name in families:
        report.notes += [note for note in FAMILIES[name].notes if note not in report.notes]
    if any(_entry(classes, layer)[0] == "attention" for layer in present):
        report.notes.append(ATTENTION_NOTE)
    if any(getattr(param, "sequence_parallel", False) for param in model.parameters()):
        report.notes.append(SEQUENCE_PARALLEL_NOTE)
    return report


def _swap_sublayers(model, classes, options, backend, report: SwapReport, counts: Counter, replaced,
                    parallel_only: bool) -> None:
    fleet = sum(fleet_classes()[:2], ()) + fleet_classes()[3]
    for path, layer in list(model.named_sublayers()):
        if any(path.startswith(done + ".") for done in replaced) or (parallel_only != isinstance(layer, fleet)):
            continue
        kind, new = _new_layer(path, layer, classes, options, backend)
        if kind is None or new is None:  # not ours to swap, or a FusedGPTMLP installed by an earlier swap
            continue
        report.kinds[path] = kind
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
