"""Triton kernels, one family per module: the ``@triton.jit`` kernels, their launchers and a
``compile_cases()`` generator that the compile-only check (sm_90, sm_80) runs."""
