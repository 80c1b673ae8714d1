"""Train a small LLaMA-style decoder on synthetic data, with or without paddlenlp_fused.

    python examples/train_llama.py --steps 60             # tiny config, CPU, well under two minutes
    python examples/train_llama.py --no-fused --steps 60  # the plain Paddle composition
    python examples/train_llama.py --size base --device gpu

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


def fit(model, opt, probs, cfg, steps, rng, logits_of=lambda output: output):
    """Train ``steps`` steps on batches of the chain with a progress line; returns the losses.
    ``logits_of`` takes the logits out of whatever the model returns."""
    losses, tokens_seen, start = [], 0, time.time()
    for step in range(1, steps + 1):
        inputs, labels = sample_batch(probs, cfg["batch"], cfg["seq"], rng)
        logits = logits_of(model(inputs))
        loss = F.cross_entropy(logits.astype("float32").reshape([-1, cfg["vocab"]]), labels.reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        tokens_seen += inputs.size
        done = int(30 * step / steps)
        sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{steps} loss {losses[-1]:.4f} "
                         f"{tokens_seen / (time.time() - start):,.0f} tok/s")
        sys.stdout.flush()
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


def example_args(description, sizes, plot, argv=None, default_lr=3e-3):
    """The flags every example takes; sets Paddle's device and seed from them."""
    parser = argparse.ArgumentParser(description=description)
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


def main(argv=None):
    args = example_args(__doc__.splitlines()[0], SIZES, "train_llama_loss.png", argv)
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
