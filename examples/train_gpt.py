"""Train PaddleNLP's GPT as is, or with paddlenlp_fused's layers swapped in.

    python examples/train_gpt.py --steps 60             # tiny config, CPU
    python examples/train_gpt.py --no-fused --steps 60  # PaddleNLP's own layers
    python examples/train_gpt.py --size base --device gpu

Needs PaddleNLP (``pip install -e .[paddlenlp]``). With ``--fused`` the model's layers are replaced in
place by ``paddlenlp_fused.integrations.paddlenlp.swap_fused_layers`` (its report, printed, lists them:
``FusedLayerNorm`` for the layer norms, one ``fused_mlp_func`` call for the MLP, ``linear_cross_entropy``
for the LM head + criterion) and the optimizer is ``FusedAdamW``; the parameters, and so the state
dict, stay PaddleNLP's. ``--no-fused``: PaddleNLP's layers and ``paddle.optimizer.AdamW``. Data, flags,
progress line and loss-curve PNG: ``common.py``. ``train()`` here is shared with ``train_mamba.py``.
"""

from __future__ import annotations

import numpy as np

from common import IGNORE_INDEX, describe, example_args, finish, fit, make_data, plot_title
from train_llama import make_optimizer

SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, intermediate=256, seq=64, batch=8),
    "base": dict(vocab=32000, hidden=1024, layers=12, heads=16, intermediate=4096, seq=1024, batch=8),
}


def build_gpt(cfg):
    try:
        from paddlenlp.transformers import GPTConfig, GPTForCausalLM
    except ImportError as exc:
        raise SystemExit(f"this example needs PaddleNLP (pip install -e .[paddlenlp]): {exc}")
    config = GPTConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                       num_attention_heads=cfg["heads"], intermediate_size=cfg["intermediate"],
                       max_position_embeddings=cfg["seq"], hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, ignore_index=IGNORE_INDEX)  # GPT's default 0 is a token
    return GPTForCausalLM(config)


def labelled_loss(model, inputs, labels):
    """The loss PaddleNLP's causal LM computes from ``labels`` (GPT and LLaMA do not shift them; after
    the swap its LM head and criterion run ``linear_cross_entropy``)."""
    out = model(input_ids=inputs, labels=labels, return_dict=True)
    return out.loss


def train(name, sizes, build_model, argv=None, default_lr=3e-3, loss_of=labelled_loss, build_fused=None,
          fused_extras=()):
    """Parse the common flags, build ``build_model(sizes[size])`` (``build_fused`` instead under
    ``--fused`` when given), swap in our layers under ``--fused``, train with ``loss_of(model, inputs,
    labels)`` and plot the loss curve. ``fused_extras``: what else of ours the fused run uses, in words."""
    args = example_args(f"Train PaddleNLP's {name}", sizes, f"train_{name.lower()}", argv,
                        default_lr=default_lr)
    rng = np.random.default_rng(args.seed)
    cfg = args.config
    if args.fused:
        from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

        model = (build_fused or build_model)(cfg)
        report = swap_fused_layers(model)
        print(report)
        layers = [f"{kind} {count}" for kind, count in sorted(report.swapped.items())]
        layers += list(fused_extras)
    else:
        model = build_model(cfg)
        layers = ["PaddleNLP's own"]
    opt = make_optimizer(model, args)
    data = make_data(args.data, cfg["vocab"], rng)
    label = f"{'fused' if args.fused else 'plain'} {name}"
    describe(f"{label} {args.size}", model, data, cfg["vocab"], layers, args)
    losses = fit(model, opt, data, cfg, args.steps, rng, loss_of=loss_of)
    finish(losses, data, plot_title(label, args.size, args.fused), args.plot)
    return losses


def main(argv=None):
    return train("GPT", SIZES, build_gpt, argv)


if __name__ == "__main__":
    main()
