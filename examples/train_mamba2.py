"""Train a small Mamba-2 language model (a stack of paddlenlp_fused ``Mamba2Block``s) on synthetic data.

    python examples/train_mamba2.py --steps 60              # tiny config, CPU, well under a minute
    python examples/train_mamba2.py --no-fused --steps 60   # the same model on the pure-Paddle reference ops
    python examples/train_mamba2.py --size base --device gpu

Model: embedding, N x (RMSNorm -> Mamba2Block, residual), RMSNorm, head. Data, progress line and
loss-curve PNG come from ``train_llama.py`` (the fixed random Markov chain whose entropy is the loss
floor). ``--fused`` runs the blocks on the automatic backend (Triton kernels for the conv and the
gated norm on a GPU or under TRITON_INTERPRET=1; the SSD scan is on its reference until its Triton
kernels land); ``--no-fused`` forces ``paddlenlp_fused.use_backend("reference")``. On a CPU without
TRITON_INTERPRET both run the reference ops (the interpreter makes the tiny run take minutes).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import paddle
import paddle.nn as nn

import paddlenlp_fused
from paddlenlp_fused.layers.mamba2 import Mamba2Block
from train_llama import RMSNorm, example_args, fit, markov_chain, plot_losses

SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, state=16, headdim=16, chunk=16, seq=64, batch=8),
    "base": dict(vocab=32000, hidden=768, layers=24, state=128, headdim=64, chunk=256, seq=1024, batch=8),
}


class TinyMamba2(nn.Layer):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.norms = nn.LayerList([RMSNorm(cfg["hidden"]) for _ in range(cfg["layers"])])
        self.mixers = nn.LayerList([
            Mamba2Block(cfg["hidden"], d_state=cfg["state"], headdim=cfg["headdim"], chunk_size=cfg["chunk"],
                        layer_idx=i) for i in range(cfg["layers"])])
        self.norm = RMSNorm(cfg["hidden"])
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"], bias_attr=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(self.norm(x))


def main(argv=None):
    args = example_args(__doc__.splitlines()[0], SIZES, "train_mamba2_loss.png", argv)
    np.random.seed(args.seed)  # Mamba2Block draws dt_bias and A_log with numpy
    rng = np.random.default_rng(args.seed)
    cfg = SIZES[args.size]
    model = TinyMamba2(cfg)
    # mamba_ssm keeps weight decay off dt_bias, A_log and D (marked no_weight_decay)
    no_decay = {p.name for p in model.parameters() if getattr(p, "no_weight_decay", False)}
    opt = paddle.optimizer.AdamW(args.lr, parameters=model.parameters(), weight_decay=0.1,
                                 apply_decay_param_fun=lambda name: name not in no_decay)
    probs, entropy = markov_chain(cfg["vocab"], rng)
    label = "fused" if args.fused else "reference"
    print(f"{label} {args.size}: {sum(int(np.prod(p.shape)) for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"loss floor (chain entropy) {entropy:.3f}, uniform {math.log(cfg['vocab']):.3f}")

    with contextlib.nullcontext() if args.fused else paddlenlp_fused.use_backend("reference"):
        losses = fit(model, opt, probs, cfg, args.steps, rng)
    print(f"final loss {np.mean(losses[-5:]):.4f} (start {losses[0]:.4f}, floor {entropy:.3f})")
    plot_losses(losses, entropy, f"Mamba-2 {label} ({args.size})", args.plot)
    return losses


if __name__ == "__main__":
    main()
