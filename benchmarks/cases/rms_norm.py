"""RMSNorm fwd+bwd, x [16384, 4096] bf16 with weight (PERFORMANCE.md): our Triton and CUDA kernels
against torch ``F.rms_norm`` (eager and torch.compile), Liger-Kernel, flash-attn's Triton RMSNorm and
mamba_ssm's Triton gated RMSNorm (no gate) in the same process (with ``--sweeps``, plus the
hidden-size sweep); the code is ``layer_norm``'s (``run_norm``), whose docstring says what is
counted."""

from __future__ import annotations

from cases.layer_norm import run_norm


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
    return run_norm(provider, quick, is_rms=True, sweep=sweep)
