"""Train a small Mamba-2 language model, a stack of paddlenlp_fused ``Mamba2Block``s.

    python examples/train_mamba2.py --steps 60              # tiny config, CPU
    python examples/train_mamba2.py --no-fused --steps 60   # plain layers, the blocks on the reference ops
    python examples/train_mamba2.py --size base --device gpu

Model: embedding, N x (``FusedRMSNorm`` carrying the residual stream -> ``Mamba2Block``), a final
``FusedRMSNorm``, ``LinearCrossEntropy`` as LM head and loss, ``FusedAdamW``. Each block runs
``mamba_split_conv1d_scan_combined``: conv, the chunked SSD scan (Triton forward and backward kernels),
gated RMSNorm and out_proj in one op, on the automatic backend (Triton / CUDA on a GPU, Triton's
interpreter under TRITON_INTERPRET=1, the pure-Paddle reference otherwise). ``--no-fused``: the plain
norms, ``Linear`` head + ``cross_entropy`` and ``paddle.optimizer.AdamW`` of ``train_llama.py``, and the
blocks forced onto the reference ops (``use_backend("reference")``: Paddle has no Mamba-2 of its own).
Weight decay is kept off ``dt_bias``, ``A_log`` and ``D`` (marked ``no_weight_decay``, as mamba_ssm).
Data, flags, progress line and PNG: ``common.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle.nn as nn

import paddlenlp_fused as pf
from common import cross_entropy, describe, example_args, finish, fit, make_data, plot_title
from train_llama import _norm, make_optimizer

SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, state=16, headdim=16, chunk=16, seq=64, batch=8),
    "base": dict(vocab=32000, hidden=768, layers=24, state=128, headdim=64, chunk=256, seq=1024, batch=8),
}


class TinyMamba2(nn.Layer):
    """``forward(tokens, labels)`` -> the mean cross-entropy."""

    def __init__(self, cfg, fused):
        super().__init__()
        self.fused = fused
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.norms = nn.LayerList([_norm(cfg["hidden"], fused) for _ in range(cfg["layers"])])
        self.mixers = nn.LayerList([
            pf.Mamba2Block(cfg["hidden"], d_state=cfg["state"], headdim=cfg["headdim"], chunk_size=cfg["chunk"],
                           layer_idx=i) for i in range(cfg["layers"])])
        self.norm = _norm(cfg["hidden"], fused)
        self.head = pf.LinearCrossEntropy(cfg["hidden"], cfg["vocab"], transpose_y=False) if fused else \
            nn.Linear(cfg["hidden"], cfg["vocab"], bias_attr=False)

    def forward(self, tokens, labels):
        x, residual = self.embed(tokens), None
        for norm, mixer in zip(self.norms, self.mixers):
            if residual is None:
                h, residual = norm(x), x
            else:
                h, residual = norm(x, residual)
            x = mixer(h)
        h, _ = self.norm(x, residual)
        if self.fused:
            return self.head(h, labels)
        return cross_entropy(self.head(h), labels)


def main(argv=None):
    args = example_args(__doc__.splitlines()[0], SIZES, "train_mamba2", argv)
    np.random.seed(args.seed)  # Mamba2Block draws dt_bias and A_log with numpy
    rng = np.random.default_rng(args.seed)
    cfg = args.config
    model = TinyMamba2(cfg, args.fused)
    # mamba_ssm keeps weight decay off dt_bias, A_log and D (marked no_weight_decay)
    no_decay = {p.name for p in model.parameters() if getattr(p, "no_weight_decay", False)}
    opt = make_optimizer(model, args, weight_decay=0.1,
                         apply_decay_param_fun=lambda name: name not in no_decay)
    data = make_data(args.data, cfg["vocab"], rng)
    label = f"{'fused' if args.fused else 'plain'} Mamba-2"
    layers = ["FusedRMSNorm (residual add + norm)", "Mamba2Block", "LinearCrossEntropy (LM head + loss)"] \
        if args.fused else ["add + RMSNorm composition", "Mamba2Block on the reference ops",
                            "Linear head + cross_entropy"]
    describe(f"{label} {args.size}", model, data, cfg["vocab"], layers, args)
    with contextlib.nullcontext() if args.fused else pf.use_backend("reference"):
        losses = fit(model, opt, data, cfg, args.steps, rng, loss_of=lambda m, x, y: m(x, y))
    finish(losses, data, plot_title(label, args.size, args.fused), args.plot)
    return losses


if __name__ == "__main__":
    main()
