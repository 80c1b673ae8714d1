"""SwiGLU / GeGLU kernels on the GPU against float64, poisoned outputs, odd and large shapes."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd
from paddlenlp_fused.testing.numerics import assert_close

DTYPES = ("float32", "float16", "bfloat16")
SHAPES = [(1, 1), (7, 33), (1000, 5), (333, 1537), (4096, 14336), (3, 40000)]  # (M, H)


def _act64(a, activation):
    if activation == "silu":
        return a / (1 + np.exp(-a)), None
    u = np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)
    t = np.tanh(u)
    return 0.5 * a * (1 + t), t


def _reference(x, dy, activation):
    H = x.shape[1] // 2
    gate, up = x[:, :H], x[:, H:]
    act, t = _act64(gate, activation)
    if activation == "silu":
        s = 1 / (1 + np.exp(-gate))
        dact = s * (1 + gate * (1 - s))
    else:
        dact = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * gate**2)
    return act * up, np.concatenate([dy * up * dact, dy * act], axis=1)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fwd_bwd_match_float64(provider, shape, dtype, activation):
    M, H = shape
    x = provider.randn((M, 2 * H), dtype, scale=2.0)
    dy = provider.randn((M, H), dtype)
    out = provider.poisoned((M, H), dtype)
    dx = provider.poisoned((M, 2 * H), dtype)
    gated_activation_fwd(x, out, activation)
    gated_activation_bwd(x, dy, dx, activation)
    provider.synchronize()
    ref_out, ref_dx = _reference(provider.to_numpy(x), provider.to_numpy(dy), activation)
    assert_close("out", provider.to_numpy(out), ref_out, dtype)
    assert_close("dx", provider.to_numpy(dx), ref_dx, dtype)


@pytest.mark.xdist_group("huge")
def test_rows_past_2_31_elements(provider):
    """x has 2^31 + 2H elements: 64-bit row offsets."""
    H = 16384
    M = (2**31) // (2 * H) + 1
    x = provider.randn((M, 2 * H), "bfloat16")
    out = provider.poisoned((M, H), "bfloat16")
    gated_activation_fwd(x, out, "silu")
    provider.synchronize()
    tail_x = provider.to_numpy(x[-2:])
    ref, _ = _reference(tail_x, np.zeros((2, H)), "silu")
    assert_close("tail rows", provider.to_numpy(out[-2:]), ref, "bfloat16")
