"""Train PaddleNLP's Mamba (Mamba-1) on synthetic data, as is or with paddlenlp_fused swapped in.

    python examples/train_mamba.py --steps 60             # tiny config, CPU, well under two minutes
    python examples/train_mamba.py --no-fused --steps 60  # PaddleNLP's own mixer (its slow path)
    python examples/train_mamba.py --size base --device gpu

Needs PaddleNLP (``pip install -e .[paddlenlp]``). With ``--fused`` its ``MambaMixer`` and
``MambaRMSNorm`` are replaced in place by ours (``swap_fused_layers``), keeping the parameters.
Same data, progress line and loss-curve PNG as ``train_gpt.py``, whose ``train()`` this uses.
"""

from __future__ import annotations

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
    config = MambaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                         state_size=cfg["state"], conv_kernel=4, expand=2)
    return MambaForCausalLM(config)


def main(argv=None):
    return train("Mamba", SIZES, build_mamba, argv)


if __name__ == "__main__":
    main()
