"""Train PaddleNLP's Mamba (Mamba-1) as is, or with paddlenlp_fused's layers swapped in.

    python examples/train_mamba.py --steps 60             # tiny config, CPU
    python examples/train_mamba.py --no-fused --steps 60  # PaddleNLP's own mixer (its slow path on a CPU)
    python examples/train_mamba.py --size base --device gpu

Needs PaddleNLP (``pip install -e .[paddlenlp]``). With ``--fused`` its ``MambaMixer`` and
``MambaRMSNorm`` are replaced in place by ours (``swap_fused_layers``, keeping the parameters: the
mixer runs ``mamba_inner_fn``), the loss of the (tied) LM head is ``linear_cross_entropy`` on the
backbone's hidden states, and the optimizer is ``FusedAdamW``. ``--no-fused``: PaddleNLP's layers, its
logits and ``cross_entropy``, and ``paddle.optimizer.AdamW``. PaddleNLP's ``MambaForCausalLM`` shifts
``labels`` inside its forward; the data here is already shifted, so both paths take the backbone's
hidden states and compute the loss outside. Data, flags, progress line and PNG: ``common.py``.
"""

from __future__ import annotations

import paddlenlp_fused as pf
from common import cross_entropy
from train_gpt import train

SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, state=16, seq=32, batch=8),
    "base": dict(vocab=32000, hidden=768, layers=24, state=16, seq=1024, batch=8),
}


def build_mamba(cfg):
    try:
        from paddlenlp.transformers import MambaConfig, MambaForCausalLM
    except ImportError as exc:
        raise SystemExit(f"this example needs PaddleNLP >= 3.0.0b4 (pip install -e .[paddlenlp]): {exc}")
    # initializer_range 0.02 (mamba_ssm's; PaddleNLP's default 0.1): the tied embedding's own token then
    # no longer dominates the first logits (the base model starts near ln V, not at 64-75)
    config = MambaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                         state_size=cfg["state"], conv_kernel=4, expand=2, initializer_range=0.02)
    return MambaForCausalLM(config)


def build_mamba_fused(cfg):
    """``build_mamba`` with our ops serving PaddleNLP's fast-path names while its mixers are built (they
    warn at construction that the fast path is missing; ``swap_fused_layers`` replaces them next)."""
    from paddlenlp_fused.integrations import disable, enable

    enable()
    try:
        return build_mamba(cfg)
    finally:
        disable()


def mamba_loss(model, inputs, labels):
    hidden = model.backbone(inputs, return_dict=True).last_hidden_state
    if model.config.tie_word_embeddings:  # lm_head multiplies by the embedding [vocab, hidden], transposed
        weight, transpose_y = model.backbone.embeddings.weight, True
    else:
        weight, transpose_y = model.lm_head.weight, False
    if isinstance(model.backbone.layers[0].mixer, pf.MambaMixer):  # swapped: no [tokens, vocab] logits
        return pf.linear_cross_entropy(hidden, weight, labels, transpose_y=transpose_y)
    return cross_entropy(model.lm_head(hidden), labels)


def main(argv=None):
    return train("Mamba", SIZES, build_mamba, argv, loss_of=mamba_loss, build_fused=build_mamba_fused,
                 fused_extras=["linear_cross_entropy (LM head + loss)"])


if __name__ == "__main__":
    main()
