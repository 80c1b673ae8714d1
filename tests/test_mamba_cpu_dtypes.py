"""MambaMixer and Mamba2Block take float16 and bfloat16 (as float32) on the CPU (Paddle's CPU build has no
half-precision matmul or add: the layers' projections compute in float32 and cast back, as the
references do), on every backend that runs on the CPU, against the float32 layer with the same
(rounded) weights and inputs.

Bound: the layer rounds its in_proj, conv, scan and out_proj outputs to the dtype, as the plain
composition in that dtype would, so the baseline is the chain's error, taken as two units of roundoff
(measured over 150 seeds, reference backend: at most 1.43 units for bfloat16, 1.56 for float16, on the
output and the input's gradient), i.e. a bound of min(1e-2, 4 units) (docs/numerics.md)."""

import numpy as np
import paddle
import pytest

import paddlenlp_fused as pf
from paddlenlp_fused.testing.numerics import UNIT_ROUNDOFF, assert_close

BATCH, SEQLEN, D_MODEL = 2, 8, 16


def _build(kind, backend):
    if kind == "MambaMixer":
        return pf.MambaMixer(d_model=D_MODEL, d_state=4, use_bias=True, backend=backend)
    return pf.Mamba2Block(D_MODEL, d_state=4, headdim=8, chunk_size=4, bias=True, backend=backend)


def _run(layer, x, grad_out):
    x = x.detach()
    x.stop_gradient = False
    out = layer(x)
    (out.astype("float32") * grad_out).sum().backward()
    return out, x.grad


@pytest.mark.parametrize("kind", ["MambaMixer", "Mamba2Block"])
# (the fix is in the layers' own projections, the same for both backends: Triton's interpreter, slow,
# runs bfloat16 only; the ops' Triton kernels in each dtype, and the float32 layers against float64,
# are tested in test_mamba.py / test_mamba2.py)
@pytest.mark.parametrize("backend, dtype", [("reference", "bfloat16"), ("reference", "float16"), ("triton", "bfloat16")])
def test_mamba_layers_in_each_dtype_on_cpu(kind, backend, dtype):
    layer = _build(kind, backend)
    layer.to(dtype=dtype)
    reference = _build(kind, "reference")  # float32 on the same rounded weights
    reference.set_state_dict({name: value.astype("float32") for name, value in layer.state_dict().items()})
    x32 = paddle.to_tensor(np.random.randn(BATCH, SEQLEN, D_MODEL).astype(np.float32))
    x = x32.astype(dtype)
    grad_out = paddle.to_tensor(np.random.randn(BATCH, SEQLEN, D_MODEL).astype(np.float32))
    out, dx = _run(layer, x, grad_out)
    assert out.dtype == x.dtype and dx.dtype == x.dtype
    ref_out, ref_dx = _run(reference, x.astype("float32"), grad_out)
    chain = 2 * UNIT_ROUNDOFF[dtype]
    assert_close(f"{kind} out", out.astype("float32").numpy(), ref_out.numpy(), dtype, baseline_err=chain)
    assert_close(f"{kind} dx", dx.astype("float32").numpy(), ref_dx.numpy(), dtype, baseline_err=chain)
