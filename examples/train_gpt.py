"""Train PaddleNLP's GPT on synthetic data, as is or with paddlenlp_fused swapped in.

    python examples/train_gpt.py --steps 60             # tiny config, CPU, well under two minutes
    python examples/train_gpt.py --no-fused --steps 60  # PaddleNLP's own layers
    python examples/train_gpt.py --size base --device gpu

Needs PaddleNLP (``pip install -e .[paddlenlp]``). With ``--fused`` the model's layers are replaced
in place by ``paddlenlp_fused.integrations.paddlenlp.swap_fused_layers`` (its report is printed);
the parameters, and so the state dict, stay PaddleNLP's. The data is the fixed random Markov chain
of ``train_llama.py`` (loss floor = the chain's entropy). Writes a loss-curve PNG at the end.
``train()`` here is shared with ``train_mamba.py``.
"""

from __future__ import annotations

import math

import numpy as np
import paddle

from train_llama import example_args, fit, markov_chain, plot_losses

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
                       attention_probs_dropout_prob=0.0)
    return GPTForCausalLM(config)


def _logits(output):
    """PaddleNLP returns logits bare, in a tuple, or in an output object, depending on the model."""
    if hasattr(output, "logits"):
        return output.logits
    return output[0] if isinstance(output, (tuple, list)) else output


def train(name, sizes, build_model, argv=None, default_lr=3e-3):
    """Parse the common flags, build ``build_model(sizes[size])``, swap in our layers under
    ``--fused``, train on the Markov chain with a progress line and plot the loss curve."""
    args = example_args(f"Train PaddleNLP's {name} on synthetic data", sizes, f"train_{name.lower()}_loss.png",
                        argv, default_lr=default_lr)
    rng = np.random.default_rng(args.seed)
    cfg = sizes[args.size]
    model = build_model(cfg)
    if args.fused:
        from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

        print(swap_fused_layers(model))
    opt = paddle.optimizer.AdamW(args.lr, parameters=model.parameters(), weight_decay=0.0)
    probs, entropy = markov_chain(cfg["vocab"], rng)
    label = f"{'fused' if args.fused else 'plain'} {name} {args.size}"
    print(f"{label}: {sum(int(np.prod(p.shape)) for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"loss floor (chain entropy) {entropy:.3f}, uniform {math.log(cfg['vocab']):.3f}")

    losses = fit(model, opt, probs, cfg, args.steps, rng, logits_of=_logits)
    print(f"final loss {np.mean(losses[-5:]):.4f} (start {losses[0]:.4f}, floor {entropy:.3f})")
    plot_losses(losses, entropy, label, args.plot)
    return losses


def main(argv=None):
    return train("GPT", SIZES, build_gpt, argv)


if __name__ == "__main__":
    main()
