"""Swap paddlenlp_fused layers into PaddleNLP models, in place, keeping their parameters.

    from paddlenlp.transformers import LlamaForCausalLM
    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers
    model = LlamaForCausalLM(config); report = swap_fused_layers(model); print(report)

What is swapped (PaddleNLP 3.0.0b4 class names):

- norms: ``LlamaRMSNorm`` and ``MambaRMSNorm`` -> ``FusedRMSNorm``; ``GPTLayerNorm`` -> ``FusedLayerNorm``;
- mlp: ``LlamaMLP`` (fused ``gate_up_fused_proj`` or separate ``gate_proj``/``up_proj``) ->
  ``FusedLlamaMLP``, the same function through ``fused_mlp_func(activation="swiglu")``;
- mamba: PaddleNLP's ``MambaMixer`` -> ours (``layers.mamba.MambaMixer``).

The new layers take over the very same ``Parameter`` objects under the same attribute names, so the
state dict keeps its keys, an optimizer built before the swap keeps updating the live parameters, and
parameter attributes set by PaddleNLP (``sequence_parallel``, ``no_weight_decay``...) travel along.

Not swapped this round, and reported as such: the tensor-parallel MLPs (``tensor_parallel_degree >
1``: PaddleNLP's own ``ColumnParallelLinear``/``RowParallelLinear`` stay), GPT's MLP (its
``linear1``/``linear2`` are applied inline in ``GPTDecoderLayer.forward``, not in a sublayer of their
own) and the LM head + criterion (``LinearCrossEntropy`` is not wired in yet).

PaddleNLP is imported inside ``swap_fused_layers``: ``paddlenlp_fused`` itself never needs it.
"""

from __future__ import annotations

import dataclasses
import types
from collections import Counter
from typing import Dict, List, Tuple

import paddle
from paddle import nn

from ..layers.mamba import MambaMixer
from ..layers.norm import FusedLayerNorm, FusedRMSNorm
from ..ops.fused_dense import fused_mlp_func

NOT_SWAPPED_THIS_ROUND = (
    "lm_head + criterion: LinearCrossEntropy is not wired into PaddleNLP models yet",
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
             "mamba_mixer": ()}
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
                      backend: str = "auto") -> SwapReport:
    """Replace, in place, the norms (``norms``), LLaMA MLPs (``mlp``) and Mamba mixers (``mamba``)
    of a PaddleNLP LLaMA / GPT / Mamba model with paddlenlp_fused layers that own the same
    parameters; ``backend`` is given to every new layer ("auto" follows ``use_backend``). Returns
    a ``SwapReport``. Call it before wrapping the model for distributed training or building a
    static graph; an optimizer built before it stays valid (same parameters)."""
    if not isinstance(model, nn.Layer):
        raise TypeError(f"model: expected a paddle.nn.Layer, got {type(model).__name__}")
    if backend not in ("auto", "triton", "cuda", "reference"):
        raise ValueError(f"backend: expected one of 'auto', 'triton', 'cuda', 'reference', got {backend!r}")
    kinds = _classes()
    report, counts = SwapReport(), Counter()
    replaced: List[str] = []
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
