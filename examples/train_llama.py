"""The main job: train a small LLaMA-style decoder built from paddlenlp_fused's layers, or the plain
Paddle composition of the same model (same parameters, same state-dict keys).

    python examples/train_llama.py --steps 60               # tiny config, CPU
    python examples/train_llama.py --no-fused --steps 60    # the plain Paddle composition
    python examples/train_llama.py --data text --steps 200  # bytes of the standard library's source
    python examples/train_llama.py --size base --device gpu
    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir /tmp/fleet_log examples/train_llama.py \
        --tensor-parallel 2 --sequence-parallel             # fleet mode: 2 processes (gloo on a CPU)

Model (``--fused``): embedding; per block ``FusedRMSNorm`` carrying the residual stream (each norm
adds the block's previous output to the residual and normalises the sum in one op), causal attention
(Paddle's ``scaled_dot_product_attention``), ``FusedMLP`` (SwiGLU, one ``fused_mlp_func`` call); a
final ``FusedRMSNorm``; ``LinearCrossEntropy`` as LM head and loss (no ``[tokens, vocab]`` logits);
``FusedAdamW`` (``--moment-dtype``: by default bfloat16 moments where it runs a kernel, float32 where it
runs its CPU reference, see ``common.moment_dtype``). ``--no-fused``: the residual add and RMSNorm, ``Linear`` + swiglu +
``Linear``, ``Linear`` head + ``cross_entropy`` and ``paddle.optimizer.AdamW``. The ops run Triton or
CUDA kernels on a GPU, Triton's interpreter on a CPU under ``TRITON_INTERPRET=1`` and the pure-Paddle
reference otherwise; the first lines printed say which layers and which backend run.

Fleet mode (``--tensor-parallel N`` > 1, or ``--sequence-parallel``; needs PaddleNLP) trains PaddleNLP's
``LlamaForCausalLM`` built with ``tensor_parallel_degree=N`` (and ``sequence_parallel``) after
``fleet.init``, with its layers swapped for ours by ``swap_fused_layers`` (fleet's own parallel layers
have no CPU kernels, so ``--no-fused`` needs ``--device gpu`` there). ``paddle.distributed.launch`` on
a CPU-only Paddle build picks the gloo backend by itself. Launch N processes (no data parallelism here:
fleet's hybrid set-up of dp 2 x mp 2 hung in group creation on gloo when tried). Rank 0 prints the
progress line and writes the plot; the others log under the launcher's ``--log_dir`` (default ``log/``).

Data, flags, progress line and loss-curve PNG: ``common.py``.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

import paddlenlp_fused as pf
from common import cross_entropy, describe, example_args, finish, fit, make_data, parameter_count, plot_title

SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, intermediate=176, seq=64, batch=8),
    "base": dict(vocab=32000, hidden=1024, layers=8, heads=16, intermediate=2816, seq=1024, batch=8),
}


class RMSNorm(nn.Layer):
    """The plain composition of ``FusedRMSNorm``: ``forward(x, residual)`` -> (rmsnorm(x + residual), x + residual)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x, residual=None):
        h = x if residual is None else x + residual
        h32 = h.astype("float32")
        out = (h32 * paddle.rsqrt((h32 * h32).mean(-1, keepdim=True) + self.eps)).astype(x.dtype) * self.weight
        return out if residual is None else (out, h)


class MLP(nn.Layer):
    """The plain composition of ``FusedMLP(activation="swiglu")``: the same ``fc1`` / ``fc2`` weights."""

    def __init__(self, hidden, intermediate):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * intermediate, bias_attr=False)
        self.fc2 = nn.Linear(intermediate, hidden, bias_attr=False)

    def forward(self, x):
        return self.fc2(F.swiglu(self.fc1(x)))


def _norm(hidden, fused):
    return pf.FusedRMSNorm(hidden, epsilon=1e-6) if fused else RMSNorm(hidden)


class Block(nn.Layer):
    """Pre-norm decoder block on the residual stream: ``forward(x, residual)`` -> (this block's output,
    the residual stream before it was added). ``residual`` None: ``x`` is the stream itself."""

    def __init__(self, cfg, fused):
        super().__init__()
        self.heads = cfg["heads"]
        self.norm1, self.norm2 = _norm(cfg["hidden"], fused), _norm(cfg["hidden"], fused)
        self.qkv = nn.Linear(cfg["hidden"], 3 * cfg["hidden"], bias_attr=False)
        self.proj = nn.Linear(cfg["hidden"], cfg["hidden"], bias_attr=False)
        self.mlp = pf.FusedMLP(cfg["hidden"], cfg["intermediate"], activation="swiglu", bias1=False, bias2=False) \
            if fused else MLP(cfg["hidden"], cfg["intermediate"])

    def forward(self, x, residual=None):
        if residual is None:
            h, residual = self.norm1(x), x
        else:
            h, residual = self.norm1(x, residual)
        b, s, d = h.shape
        q, k, v = self.qkv(h).reshape([b, s, 3, self.heads, d // self.heads]).unbind(2)
        att = self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).reshape([b, s, d]))
        h, residual = self.norm2(att, residual)
        return self.mlp(h), residual


class TinyLlama(nn.Layer):
    """``forward(tokens, labels)`` -> the mean cross-entropy (``labels`` None: the logits)."""

    def __init__(self, cfg, fused):
        super().__init__()
        self.fused = fused
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.blocks = nn.LayerList([Block(cfg, fused) for _ in range(cfg["layers"])])
        self.norm = _norm(cfg["hidden"], fused)
        # [hidden, vocab] either way (transpose_y=False: Linear's layout), so the state dicts match
        self.head = pf.LinearCrossEntropy(cfg["hidden"], cfg["vocab"], transpose_y=False) if fused else \
            nn.Linear(cfg["hidden"], cfg["vocab"], bias_attr=False)

    def forward(self, tokens, labels=None):
        x, residual = self.embed(tokens), None
        for block in self.blocks:
            x, residual = block(x, residual)
        h, _ = self.norm(x, residual)
        if labels is None:
            return paddle.matmul(h, self.head.weight)
        if self.fused:
            return self.head(h, labels)
        return cross_entropy(self.head(h), labels)


FUSED_LAYERS = ["FusedRMSNorm (residual add + norm)", "FusedMLP (swiglu)", "LinearCrossEntropy (LM head + loss)"]
PLAIN_LAYERS = ["add + RMSNorm composition", "Linear + swiglu + Linear", "Linear head + cross_entropy"]


def make_optimizer(model, args, weight_decay=0.0, apply_decay_param_fun=None):
    """FusedAdamW (``args.moment_dtype`` moments) under ``--fused``, else Paddle's AdamW: the same update."""
    if args.fused:
        return pf.FusedAdamW(args.lr, parameters=model.parameters(), weight_decay=weight_decay,
                             apply_decay_param_fun=apply_decay_param_fun, moment_dtype=args.moment_dtype)
    return paddle.optimizer.AdamW(args.lr, parameters=model.parameters(), weight_decay=weight_decay,
                                  apply_decay_param_fun=apply_decay_param_fun)


def build_paddlenlp_llama(cfg, tensor_parallel=1, rank=0, sequence_parallel=False):
    """PaddleNLP's LlamaForCausalLM in the size ``cfg``, built for ``tensor_parallel`` ranks (call it
    after ``fleet.init``)."""
    try:
        from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise SystemExit(f"fleet mode trains PaddleNLP's LLaMA: pip install -e .[paddlenlp] ({exc})")
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["seq"], seq_length=cfg["seq"],
                         rms_norm_eps=1e-6, tensor_parallel_degree=tensor_parallel, tensor_parallel_rank=rank,
                         sequence_parallel=sequence_parallel)
    return LlamaForCausalLM(config)


def parameter_counts(model, tensor_parallel):
    """(the whole model's, one rank's) parameter counts of a tensor-parallel model: a parameter marked
    ``is_distributed`` (fleet's and our parallel layers mark their shards) is 1/tensor_parallel of its
    layer's; the others are replicated whole on every rank."""
    per_rank = parameter_count(model)
    sharded = sum(int(np.prod(p.shape)) for p in model.parameters() if getattr(p, "is_distributed", False))
    return per_rank + (tensor_parallel - 1) * sharded, per_rank


def main_fleet(args):
    """Fleet mode: tensor (and sequence) parallel PaddleNLP LLaMA with our layers swapped in."""
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from paddlenlp_fused.layers.tensor_parallel import allreduce_sequence_parallel_grads

    world = dist.get_world_size()
    tp = args.tensor_parallel
    if tp < 2:
        raise SystemExit("--sequence-parallel splits the sequence over the tensor-parallel ranks: give "
                         "--tensor-parallel 2 or more")
    if tp != world:
        raise SystemExit(f"--tensor-parallel {tp}: launch that many processes (got {world}), e.g. "
                         f"python -m paddle.distributed.launch --nproc_per_node {tp} examples/train_llama.py ...")
    if not args.fused and args.device == "cpu":
        raise SystemExit("--no-fused in fleet mode runs fleet's own parallel layers, which have no CPU kernels "
                         "(c_identity, c_embedding...): use --device gpu, or --fused")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": tp, "pp_degree": 1, "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank, leader = hcg.get_model_parallel_rank(), dist.get_rank() == 0
    cfg = args.config
    paddle.seed(args.seed)  # the same replicated weights on every rank (fleet seeds the sharded ones)
    model = build_paddlenlp_llama(cfg, tp, rank, args.sequence_parallel)
    if args.fused:
        from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

        report = swap_fused_layers(model)
        if leader:
            print(report)
    opt = make_optimizer(model, args)
    rng = np.random.default_rng(args.seed)  # the data and batches of the single-process run, on every rank
    data = make_data(args.data, cfg["vocab"], rng)

    def after_backward():  # the norm weights' gradients are partial sums over the sequence shards
        if args.sequence_parallel:
            allreduce_sequence_parallel_grads(model)

    def loss_of(model, inputs, labels):
        return model(input_ids=inputs, labels=labels, return_dict=True).loss

    name = f"{'fused' if args.fused else 'plain'} PaddleNLP LLaMA tp{tp}{'+sp' if args.sequence_parallel else ''}"
    whole, per_rank = parameter_counts(model, tp)
    if leader:
        layers = ["swap_fused_layers (report above)" if args.fused else "fleet's parallel layers"]
        describe(f"{name} {args.size}, {world} processes", model, data, cfg["vocab"], layers, args,
                 parameters=f"{whole / 1e6:.2f}M parameters ({per_rank / 1e6:.2f}M on each rank)")
    losses = fit(model, opt, data, cfg, args.steps, rng, loss_of=loss_of, after_backward=after_backward,
                 show=leader)
    if leader:
        finish(losses, data, plot_title(name, args.size, args.fused), args.plot)
    else:  # into the launcher's worker log
        print(f"rank {dist.get_rank()}: final loss {np.mean(losses[-5:]):.4f} (start {losses[0]:.4f})")
    return losses


def main(argv=None):
    args = example_args(__doc__.splitlines()[0], SIZES, "train_llama", argv, fleet=True)
    if args.tensor_parallel > 1 or args.sequence_parallel:
        return main_fleet(args)
    rng = np.random.default_rng(args.seed)
    cfg = args.config
    model = TinyLlama(cfg, args.fused)
    opt = make_optimizer(model, args)
    data = make_data(args.data, cfg["vocab"], rng)
    label = f"{'fused' if args.fused else 'plain'} LLaMA {args.size}"
    describe(label, model, data, cfg["vocab"], FUSED_LAYERS if args.fused else PLAIN_LAYERS, args)
    losses = fit(model, opt, data, cfg, args.steps, rng, loss_of=lambda m, x, y: m(x, y))
    finish(losses, data, plot_title(f"{'fused' if args.fused else 'plain'} LLaMA", args.size, args.fused), args.plot)
    return losses


if __name__ == "__main__":
    main()
