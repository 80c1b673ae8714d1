"""paddlenlp_fused: fused Paddle layers for LLM and state-space-model training.

``import paddlenlp_fused`` is cheap: layers, ops and the backend helpers load on first attribute
access, and ``paddlenlp_fused.kernels`` imports without Paddle.
"""

from __future__ import annotations

from ._lazy import lazy_exports
from .runtime.versions import check_versions as _check_versions

_check_versions()  # a clear ImportError for an unsupported Paddle (before any op fails obscurely)

__version__ = "0.1.0"

# The one export map: public name -> module that defines it (relative to this package).
# ``paddlenlp_fused.ops`` serves the ``ops.*`` entries from this same map.
_EXPORTS = {
    # backend choice
    "use_backend": "runtime.backend",
    "available_backends": "runtime.backend",
    "default_backend": "runtime.backend",
    "BackendUnavailableError": "runtime.backend",
    # gated activations
    "swiglu": "ops.gated_activation",
    "geglu": "ops.gated_activation",
    "gated_activation": "ops.gated_activation",
    # norms
    "FusedLayerNorm": "layers.norm",
    "FusedRMSNorm": "layers.norm",
    "GatedRMSNorm": "layers.norm",
    "layer_norm_fn": "ops.norm",
    "rms_norm_fn": "ops.norm",
    "rmsnorm_gated_fn": "ops.norm",
    # losses
    "LinearCrossEntropy": "layers.linear_cross_entropy",
    "linear_cross_entropy": "ops.cross_entropy",
    "cce_linear_cross_entropy": "ops.cross_entropy",
    "FlashContrastiveLoss": "layers.contrastive",
    "cal_flash_loss": "ops.contrastive",
    "flash_contrastive_loss": "ops.contrastive",
    # dense, MLP, tensor parallel
    "FusedDense": "layers.fused_dense",
    "FusedMLP": "layers.fused_dense",
    "ColumnParallelLinear": "layers.tensor_parallel",
    "RowParallelLinear": "layers.tensor_parallel",
    "ParallelFusedMLP": "layers.tensor_parallel",
    "fused_dense_func": "ops.fused_dense",
    "fused_mlp_func": "ops.fused_dense",
    # Mamba-1
    "MambaMixer": "layers.mamba",
    "MambaInferenceCache": "layers.mamba",
    "selective_scan_fn": "ops.mamba",
    "causal_conv1d_fn": "ops.causal_conv1d",
    "causal_conv1d_update": "ops.causal_conv1d",
    "causal_conv1d_varlen_states": "ops.causal_conv1d",
    "selective_state_update": "ops.mamba",
    "mamba_inner_fn": "ops.mamba",
    # Mamba-2
    "Mamba2Block": "layers.mamba2",
    "Mamba2InferenceParams": "layers.mamba2",
    "mamba_chunk_scan_combined": "ops.ssd",
    "mamba_split_conv1d_scan_combined": "ops.mamba2",
    "mamba2_state_update": "ops.mamba2",
    # optimizer, PaddleNLP
    "FusedAdamW": "optimizer.adamw",
    "swap_fused_layers": "integrations.paddlenlp",
}

lazy_exports(globals(), _EXPORTS)
