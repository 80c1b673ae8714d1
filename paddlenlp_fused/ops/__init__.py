"""Functional ops: argument checks, backend dispatch and autograd over the kernels.

Loaded lazily, one module per op family, so importing one op does not compile or import the rest.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "swiglu": "gated_activation",
    "geglu": "gated_activation",
    "gated_activation": "gated_activation",
    "layer_norm_fn": "norm",
    "rms_norm_fn": "norm",
    "rmsnorm_gated_fn": "norm",
    "linear_cross_entropy": "linear_cross_entropy",
    "cce_linear_cross_entropy": "linear_cross_entropy",
    "cal_flash_loss": "contrastive",
    "flash_contrastive_loss": "contrastive",
    "fused_dense_func": "fused_dense",
    "fused_mlp_func": "fused_dense",
    "selective_scan_fn": "mamba",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
    "selective_state_update": "mamba",
    "mamba_inner_fn": "mamba",
    "mamba_chunk_scan_combined": "ssd",
    "mamba_split_conv1d_scan_combined": "mamba2",
    "mamba2_state_update": "mamba2",
}

lazy_exports(globals(), _EXPORTS)
