"""paddlenlp_fused: fused Paddle layers for LLM and state-space-model training.

``import paddlenlp_fused`` is cheap: layers, ops and the backend helpers load on first attribute
access, and ``paddlenlp_fused.kernels`` imports without Paddle.
"""

from __future__ import annotations

from ._lazy import lazy_exports
from .runtime.versions import check_versions as _check_versions

_check_versions()  # a clear ImportError for an unsupported Paddle (before any op fails obscurely)

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS = {
    "use_backend": "runtime.backend",
    "available_backends": "runtime.backend",
    "default_backend": "runtime.backend",
    "BackendUnavailableError": "runtime.backend",
    "swiglu": "ops.gated_activation",
    "geglu": "ops.gated_activation",
    "FusedLayerNorm": "layers.norm",
    "FusedRMSNorm": "layers.norm",
    "GatedRMSNorm": "layers.norm",
    "layer_norm_fn": "ops.norm",
    "rms_norm_fn": "ops.norm",
    "rmsnorm_gated_fn": "ops.norm",
    "LinearCrossEntropy": "layers.linear_cross_entropy",
    "linear_cross_entropy": "ops.linear_cross_entropy",
    "cce_linear_cross_entropy": "ops.linear_cross_entropy",
    "FusedAdamW": "optimizer.adamw",
    "FlashContrastiveLoss": "layers.contrastive",
    "cal_flash_loss": "ops.contrastive",
    "flash_contrastive_loss": "ops.contrastive",
    "FusedDense": "layers.fused_dense",
    "FusedMLP": "layers.fused_dense",
    "ColumnParallelLinear": "layers.tensor_parallel",
    "RowParallelLinear": "layers.tensor_parallel",
    "ParallelFusedMLP": "layers.tensor_parallel",
    "fused_dense_func": "ops.fused_dense",
    "fused_mlp_func": "ops.fused_dense",
    "MambaMixer": "layers.mamba",
    "MambaInferenceCache": "layers.mamba",
    "selective_scan_fn": "ops.mamba",
    "causal_conv1d_fn": "ops.causal_conv1d",
    "causal_conv1d_update": "ops.causal_conv1d",
    "selective_state_update": "ops.mamba",
    "mamba_inner_fn": "ops.mamba",
    "swap_fused_layers": "integrations.paddlenlp",
    "mamba_chunk_scan_combined": "ops.ssd",
    "Mamba2Block": "layers.mamba2",
    "Mamba2InferenceParams": "layers.mamba2",
    "mamba_split_conv1d_scan_combined": "ops.mamba2",
    "mamba2_state_update": "ops.mamba2",
}

lazy_exports(globals(), _EXPORTS)
