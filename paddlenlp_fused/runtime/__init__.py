"""Backend choice, Triton drivers for Paddle and the interpreter, tensor accessors.

Imports no framework at import time: ``paddlenlp_fused.kernels`` depends on ``runtime.tensor`` and
must load where only torch (or nothing but Triton) is installed.
"""
