"""GPU kernels and their launchers. Imports no framework: launchers take Paddle or torch tensors
(or compile-only ``SpecTensor``s) and read them through ``paddlenlp_fused.runtime.tensor``."""
