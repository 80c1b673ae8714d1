"""PaddleNLP ``Trainer`` runs of a tiny model, plain or with our layers and ``FusedAdamW``, that record
what the tests compare: the loss of every optimizer step (as the Trainer logs it), the global
gradient norm the clip computed at every step, and the final parameters (full tensors, the shards of a
tensor-parallel run gathered).

``train(family, args, layers=..., fused_adamw=...)`` builds the model from one seed (a tensor-parallel
model's shards are cut from the same full weights), swaps our layers in (``layers``) and makes
``FusedAdamW`` the optimizer (``fused_adamw``), runs ``Trainer.train`` and returns a ``Run``. Runs
inside a ``run_distributed`` body where the ``TrainingArguments`` ask for several processes (they call
``fleet.init`` themselves).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional
from unittest import mock

import numpy as np

VOCAB, SEQ = 64, 8
SAMPLES = 32
CONFIGS = {
    "llama": dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, seq_length=SEQ),
    "gpt": dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, seq_length=SEQ),
    "mamba": dict(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4,
                  time_step_rank=2),
}
BASE_ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
                 weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                 save_strategy="no", seed=7, device="cpu", no_cuda=True, disable_tqdm=True, report_to=[],
                 dataloader_num_workers=0, fp16=False, bf16=False)


@dataclasses.dataclass
class Run:
    losses: List[float]  # per optimizer step, as the Trainer logged it (rounded to 8 decimals)
    grad_norms: List[float]  # the global norm the clip saw before each step
    params: Dict[str, np.ndarray]  # full tensors after the last step
    optimizer: str  # class name of the optimizer that stepped (fleet's wrapper unwrapped)
    report: Optional[object] = None  # SwapReport where our layers were swapped in


def _model_classes(family):
    from paddlenlp import transformers as tr

    return {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM), "gpt": (tr.GPTConfig, tr.GPTForCausalLM),
            "mamba": (tr.MambaConfig, tr.MambaForCausalLM)}[family]


def build_model(family: str, tensor_parallel_degree: int = 1, tensor_parallel_rank: int = 0,
                sequence_parallel: bool = False, seed: int = 0, **config_attrs):
    """The model with the full weights drawn from ``seed``; with ``tensor_parallel_degree > 1`` this
    rank's shards of those same weights. ``config_attrs``: set on the config (recompute and kin).
    Parameter names are those a fresh process gives (optimizer checkpoints are keyed by them, so a run
    resumed in this process finds the saved run's)."""
    import paddle
    from paddle.utils import unique_name

    config_cls, model_cls = _model_classes(family)

    def make(**parallel):
        config = config_cls(**CONFIGS[family], **parallel)
        for key, value in config_attrs.items():
            setattr(config, key, value)
        paddle.seed(seed)
        with unique_name.guard():
            return model_cls(config)

    full = make()
    if tensor_parallel_degree == 1:
        return full
    model = make(tensor_parallel_degree=tensor_parallel_degree, tensor_parallel_rank=tensor_parallel_rank,
                 sequence_parallel=sequence_parallel)
    weights = full.state_dict()
    for name, param in model.named_parameters():
        value = weights[name].numpy()
        if getattr(param, "is_distributed", False):
            value = np.split(value, tensor_parallel_degree, axis=param.split_axis)[tensor_parallel_rank]
        param.set_value(value)
    return model


def build_pipe_model(seed: int = 0):
    """PaddleNLP's ``LlamaForCausalLMPipe`` (a fleet ``PipelineLayer``) of ``CONFIGS["llama"]``, after
    ``fleet.init``. ``PipelineLayer`` reads ``ParallelEnv().device_id``, which a CPU build does not set
    (Paddle 3.3.1: ``AttributeError: 'ParallelEnv' object has no attribute '_device_id'``): device 0 is
    given it."""
    import paddle
    import paddle.distributed as dist
    from paddle.utils import unique_name
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLMPipe

    paddle.seed(seed)
    with mock.patch.object(dist.ParallelEnv, "device_id", property(lambda self: 0)), unique_name.guard():
        return LlamaForCausalLMPipe(LlamaConfig(**CONFIGS["llama"]))


def pipe_loss(model, ids):
    """A ``PipelineLayer``'s loss run in one process: its stage layers in order, then its loss function."""
    hidden = ids
    for layer in model.run_function:
        hidden = layer(hidden)
    return model._loss_fn[0](hidden, ids)


class TokenDataset:
    """``SAMPLES`` fixed random token sequences (labels = inputs: the causal-LM models shift them)."""

    def __init__(self, seed: int = 11):
        self.ids = np.random.default_rng(seed).integers(0, VOCAB, (SAMPLES, SEQ)).astype("int64")

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _inner(optimizer):
    """The optimizer under fleet's wrappers (HybridParallelOptimizer, DygraphShardingOptimizer, ...)."""
    while hasattr(optimizer, "_inner_opt"):
        optimizer = optimizer._inner_opt
    return optimizer


def _recorder(losses: List[float], norms: List[float]):
    """A callback that appends each logged training loss to ``losses`` (PaddleNLP 3.0.0b4's ``Trainer.log``
    empties ``state.log_history``, so the log is read as it is written) and, before each optimizer step,
    wraps the clip the optimizers are given (Paddle's ``ClipGradByGlobalNorm``, or fleet's
    ``HybridParallelClipGrad`` that replaces it) so the global norm it computes is appended to ``norms``.
    An optimizer that ignores the clip fleet installs records no norm: the comparison then fails."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad)
    from paddle.nn import ClipGradByGlobalNorm
    from paddlenlp.trainer import TrainerCallback

    def wrap(clip):
        if getattr(clip, "_records_norm", False):
            return
        if isinstance(clip, HybridParallelClipGrad):
            original = clip._global_norm

            def global_norm(dist, not_dist):  # reduces both sums in place over the hybrid groups
                original(dist, not_dist)
                norms.append(float(np.sqrt(dist.item() + not_dist.item())))  # item(): numpy 2.4 refuses float([1])
            clip._global_norm = global_norm
        elif isinstance(clip, ClipGradByGlobalNorm):
            original = clip._dygraph_clip

            def dygraph_clip(params_grads):
                total = sum((g.astype("float32") ** 2).sum().item() for p, g in params_grads
                            if g is not None and getattr(p, "need_clip", True))
                norms.append(float(np.sqrt(total)))
                return original(params_grads)
            clip._dygraph_clip = dygraph_clip
        else:
            raise TypeError(f"the optimizer's clip: expected a global-norm clip, got {type(clip).__name__}")
        clip._records_norm = True

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_optimizer_begin(self, args, state, control, optimizer=None, **kwargs):
            clips = {id(c): c for c in (getattr(optimizer, "_grad_clip", None),
                                        getattr(_inner(optimizer), "_grad_clip", None)) if c is not None}
            for clip in clips.values():
                wrap(clip)

    return Recorder()


def trainer_class(fused_adamw: bool):
    """PaddleNLP's Trainer reading the data in order (the same batches in every layout and on resume),
    with ``FusedAdamW`` built where the Trainer builds its AdamW when ``fused_adamw`` (the documented way:
    ``create_optimizer`` overridden; the Trainer refuses ``optimizers=`` under sharding)."""
    from paddle.io import DistributedBatchSampler
    from paddlenlp.trainer import Trainer

    from ..optimizer import FusedAdamW

    class OrderedTrainer(Trainer):
        def _get_train_sampler(self):
            return DistributedBatchSampler(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                                           shuffle=False, num_replicas=self.args.dataset_world_size,
                                           rank=self.args.dataset_rank, drop_last=True)

    if not fused_adamw:
        return OrderedTrainer

    class FusedAdamWTrainer(OrderedTrainer):
        def create_optimizer(self, lr_scheduler=None):
            if self.optimizer is None:
                decay = {p.name for n, p in self.model.named_parameters()
                         if not any(nd in n for nd in ("bias", "norm"))}
                self.optimizer = FusedAdamW(
                    learning_rate=self.lr_scheduler if lr_scheduler is None else lr_scheduler,
                    beta1=self.args.adam_beta1, beta2=self.args.adam_beta2, epsilon=self.args.adam_epsilon,
                    parameters=self.model.parameters(), weight_decay=self.args.weight_decay,
                    apply_decay_param_fun=lambda name: name in decay, moment_dtype="float32",
                    grad_clip=paddle_clip(self.args.max_grad_norm))
            return self.optimizer

    return FusedAdamWTrainer


def paddle_clip(max_grad_norm):
    from paddle import nn

    return nn.ClipGradByGlobalNorm(max_grad_norm) if max_grad_norm > 0 else None


def full_params(model, mp_group=None) -> Dict[str, np.ndarray]:
    """The parameters as full arrays: a tensor-parallel shard all-gathered along its ``split_axis``."""
    import paddle
    import paddle.distributed as dist

    out = {}
    for name, param in model.named_parameters():
        value = param
        if mp_group is not None and mp_group.nranks > 1 and getattr(param, "is_distributed", False):
            parts = []
            dist.all_gather(parts, param.detach(), group=mp_group)
            value = paddle.concat(parts, axis=param.split_axis)
        out[name] = value.numpy().astype(np.float64)
    return out


def make_args(output_dir, **overrides):
    """``TrainingArguments`` of ``BASE_ARGS`` with ``overrides``. In a ``run_distributed`` child, which has
    called ``init_parallel_env`` (a ``paddle.distributed.launch`` child has not), PaddleNLP would skip its
    own ``fleet.init`` with the hybrid strategy it builds: it is made to see a fresh context."""
    from paddle.distributed.parallel import parallel_helper
    from paddlenlp.trainer import TrainingArguments

    with mock.patch.object(parallel_helper, "_is_parallel_ctx_initialized", lambda: False):
        return TrainingArguments(output_dir=str(output_dir), **dict(BASE_ARGS, **overrides))


def _broadcast_inputs(hcg, *inputs, **kwargs):
    """fleet's ``broadcast_input_data`` (the model-parallel ranks take rank 0's batch), which asserts a
    GPU/XPU device (Paddle 3.3.1: "Only support xpu, gpu and custom_device now, but this is cpu"), on
    ``paddle.distributed.broadcast``, which gloo runs."""
    import paddle
    import paddle.distributed as dist

    group, src = hcg.get_model_parallel_group(), hcg.get_model_parallel_group_src_rank()

    def visit(item):
        if isinstance(item, paddle.Tensor):
            dist.broadcast(item, src, group=group)
        elif isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif isinstance(item, (list, tuple)):
            for value in item:
                visit(value)

    visit(inputs)
    visit(kwargs)
    return inputs, kwargs


def train(family: str, args, layers: bool, fused_adamw: bool, resume_from_checkpoint=None, **config_attrs) -> Run:
    """One Trainer run under ``args`` (``make_args``; build them before the model: they initialise
    fleet): our layers swapped in when ``layers``, ``FusedAdamW`` the optimizer when ``fused_adamw``
    (else the Trainer's own AdamW). The model follows the arguments' tensor parallelism."""
    from paddle.distributed import fleet

    from ..integrations.paddlenlp import swap_fused_layers

    tp = args.tensor_parallel_degree
    hcg = fleet.get_hybrid_communicate_group() if tp > 1 else None
    model = build_model(family, tensor_parallel_degree=tp, tensor_parallel_rank=args.tensor_parallel_rank,
                        sequence_parallel=bool(args.sequence_parallel and tp > 1), **config_attrs)
    report = swap_fused_layers(model, backend="reference") if layers else None
    losses: List[float] = []
    norms: List[float] = []
    trainer = trainer_class(fused_adamw)(model=model, args=args, train_dataset=TokenDataset(),
                                   callbacks=[_recorder(losses, norms)])
    with contextlib.ExitStack() as stack:
        if tp > 1:
            from paddle.distributed.fleet.meta_parallel import tensor_parallel

            stack.enter_context(mock.patch.object(tensor_parallel, "broadcast_input_data", _broadcast_inputs))
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    params = full_params(model, hcg.get_model_parallel_group() if hcg is not None else None)
    return Run(losses=losses, grad_norms=norms, params=params, optimizer=type(_inner(trainer.optimizer)).__name__,
               report=report)
