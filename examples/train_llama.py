"""Train a small LLaMA-style decoder on synthetic data, with or without paddlenlp_fused.

    python examples/train_llama.py --steps 60             # tiny config, CPU, well under two minutes
    python examples/train_llama.py --no-fused --steps 60  # the plain Paddle composition
    python examples/train_llama.py --size base --device gpu
    python -m paddle.distributed.launch --nproc_per_node 2 examples/train_llama.py \
        --tensor-parallel 2 --sequence-parallel           # fleet mode: 2 processes (gloo on a CPU)

Fleet mode (``--tensor-parallel N`` > 1, or ``--sequence-parallel``; needs PaddleNLP) trains PaddleNLP's
``LlamaForCausalLM`` built with ``tensor_parallel_degree=N`` (and ``sequence_parallel``) after
``fleet.init``, with its layers swapped for ours by ``swap_fused_layers`` (fleet's own parallel layers
have no CPU kernels, so ``--no-fused`` needs ``--device gpu`` there). ``paddle.distributed.launch`` on
a CPU-only Paddle build picks the gloo backend by itself. Launch N processes (no data parallelism here:
fleet's hybrid set-up of dp 2 x mp 2 hung in group creation on gloo when tried). Rank 0 prints the
progress line and writes the plot; the others log to ``log/workerlog.<rank>``.

The data is a fixed random Markov chain over the vocabulary, so the loss has a known floor (the
chain's entropy, printed) that a working model approaches. With ``--fused`` the MLP's gated
activation is ``paddlenlp_fused.swiglu`` (the Triton kernel on a GPU, or under TRITON_INTERPRET=1;
the pure-Paddle reference otherwise); the layers that land later (norms, fused MLP, linear
cross-entropy) slot into the same model. Writes a loss-curve PNG at the end.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

import paddlenlp_fused

SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, intermediate=176, seq=64, batch=8),
    "base": dict(vocab=32000, hidden=1024, layers=8, heads=16, intermediate=2816, seq=1024, batch=8),
}


class RMSNorm(nn.Layer):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x):
        x32 = x.astype("float32")
        x32 = x32 * paddle.rsqrt((x32 * x32).mean(-1, keepdim=True) + self.eps)
        return x32.astype(x.dtype) * self.weight


class MLP(nn.Layer):
    def __init__(self, hidden, intermediate, fused):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias_attr=False)
        self.down = nn.Linear(intermediate, hidden, bias_attr=False)
        self.fused = fused

    def forward(self, x):
        h = self.gate_up(x)
        return self.down(paddlenlp_fused.swiglu(h) if self.fused else F.swiglu(h))


class Block(nn.Layer):
    def __init__(self, cfg, fused):
        super().__init__()
        self.heads = cfg["heads"]
        self.norm1, self.norm2 = RMSNorm(cfg["hidden"]), RMSNorm(cfg["hidden"])
        self.qkv = nn.Linear(cfg["hidden"], 3 * cfg["hidden"], bias_attr=False)
        self.proj = nn.Linear(cfg["hidden"], cfg["hidden"], bias_attr=False)
        self.mlp = MLP(cfg["hidden"], cfg["intermediate"], fused)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape([b, s, 3, self.heads, d // self.heads]).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.reshape([b, s, d]))
        return x + self.mlp(self.norm2(x))


class TinyLlama(nn.Layer):
    def __init__(self, cfg, fused):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.blocks = nn.LayerList([Block(cfg, fused) for _ in range(cfg["layers"])])
        self.norm = RMSNorm(cfg["hidden"])
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"], bias_attr=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def markov_chain(vocab, rng):
    """A sparse random transition matrix (each token has 4 likely successors) and its entropy rate."""
    logits = rng.standard_normal((vocab, vocab)) - 4.0
    for row in logits:
        row[rng.choice(vocab, 4, replace=False)] += 6.0
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    stationary = np.full(vocab, 1.0 / vocab)
    for _ in range(200):
        stationary = stationary @ probs
    entropy = float(-(stationary[:, None] * probs * np.log(probs)).sum())
    return probs, entropy


def sample_batch(probs, batch, seq, rng):
    cdf = probs.cumsum(1)
    tokens = np.empty((batch, seq + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, probs.shape[0], batch)
    for t in range(seq):
        u = rng.random(batch)[:, None]
        tokens[:, t + 1] = np.minimum((u > cdf[tokens[:, t]]).sum(1), probs.shape[0] - 1)
    return paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])


def fit(model, opt, probs, cfg, steps, rng, logits_of=lambda output: output, loss_of=None, after_backward=None,
        show=True):
    """Train ``steps`` steps on batches of the chain with a progress line (``show``); returns the losses.
    ``logits_of`` takes the logits out of whatever the model returns; ``loss_of(model, inputs, labels)``
    replaces the logits + cross-entropy step when the model computes its own loss; ``after_backward``
    runs between backward and the optimizer step (gradient all-reduces)."""
    losses, tokens_seen, start = [], 0, time.time()
    for step in range(1, steps + 1):
        inputs, labels = sample_batch(probs, cfg["batch"], cfg["seq"], rng)
        if loss_of is not None:
            loss = loss_of(model, inputs, labels)
        else:
            logits = logits_of(model(inputs))
            loss = F.cross_entropy(logits.astype("float32").reshape([-1, cfg["vocab"]]), labels.reshape([-1]))
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        tokens_seen += inputs.size
        done = int(30 * step / steps)
        if show:
            sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{steps} loss {losses[-1]:.4f} "
                             f"{tokens_seen / (time.time() - start):,.0f} tok/s")
            sys.stdout.flush()
    if show:
        print(f"\n{steps} steps in {time.time() - start:.1f} s")
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit("loss is not finite")
    return losses


def plot_losses(losses, entropy, label, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(5, 3.2))
    plt.plot(losses, label=label)
    plt.axhline(entropy, ls="--", c="gray", label="chain entropy")
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    print(f"loss curve: {path}")


def example_args(description, sizes, plot, argv=None, default_lr=3e-3, fleet=False):
    """The flags every example takes (and, with ``fleet``, ``--tensor-parallel`` / ``--sequence-parallel``);
    sets Paddle's device and seed from them."""
    parser = argparse.ArgumentParser(description=description)
    if fleet:
        parser.add_argument("--tensor-parallel", type=int, default=1,
                            help="tensor-parallel degree (fleet mode; run under paddle.distributed.launch)")
        parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallel (fleet mode)")
    parser.add_argument("--size", choices=sorted(sizes), default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=default_lr)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=plot)
    args = parser.parse_args(argv)
    paddle.set_device(args.device)
    paddle.seed(args.seed)
    return args


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
    cfg = SIZES[args.size]
    paddle.seed(args.seed)  # the same replicated weights on every rank (fleet seeds the sharded ones)
    model = build_paddlenlp_llama(cfg, tp, rank, args.sequence_parallel)
    if args.fused:
        from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

        report = swap_fused_layers(model)
        if leader:
            print(report)
    opt = paddle.optimizer.AdamW(args.lr, parameters=model.parameters(), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)  # the chain and batches of the single-process run, on every rank
    probs, entropy = markov_chain(cfg["vocab"], rng)

    def after_backward():  # the norm weights' gradients are partial sums over the sequence shards
        if args.sequence_parallel:
            allreduce_sequence_parallel_grads(model)

    def loss_of(model, inputs, labels):
        return model(input_ids=inputs, labels=labels, return_dict=True).loss

    label = f"{'fused' if args.fused else 'plain'} LLaMA tp{tp}{'+sp' if args.sequence_parallel else ''} ({args.size})"
    if leader:
        print(f"{label}, {world} processes: loss floor (chain entropy) {entropy:.3f}, "
              f"uniform {math.log(cfg['vocab']):.3f}")
    losses = fit(model, opt, probs, cfg, args.steps, rng, loss_of=loss_of, after_backward=after_backward,
                 show=leader)
    print(f"rank {dist.get_rank()}: final loss {np.mean(losses[-5:]):.4f} (start {losses[0]:.4f}, "
          f"floor {entropy:.3f})")
    if leader:
        plot_losses(losses, entropy, label, args.plot)
    return losses


def main(argv=None):
    args = example_args(__doc__.splitlines()[0], SIZES, "train_llama_loss.png", argv, fleet=True)
    if args.tensor_parallel > 1 or args.sequence_parallel:
        return main_fleet(args)
    rng = np.random.default_rng(args.seed)
    cfg = SIZES[args.size]
    model = TinyLlama(cfg, args.fused)
    opt = paddle.optimizer.AdamW(args.lr, parameters=model.parameters(), weight_decay=0.0)
    probs, entropy = markov_chain(cfg["vocab"], rng)
    print(f"{'fused' if args.fused else 'plain'} {args.size}: "
          f"{sum(int(np.prod(p.shape)) for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"loss floor (chain entropy) {entropy:.3f}, uniform {math.log(cfg['vocab']):.3f}")

    losses = fit(model, opt, probs, cfg, args.steps, rng)
    print(f"final loss {np.mean(losses[-5:]):.4f} (start {losses[0]:.4f}, floor {entropy:.3f})")
    plot_losses(losses, entropy, f"{'fused' if args.fused else 'plain'} ({args.size})", args.plot)
    return losses


if __name__ == "__main__":
    main()
