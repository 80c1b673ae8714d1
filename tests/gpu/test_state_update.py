"""The decoding-step kernel (``kernels/triton/state_update.py``) on the GPU against a float64 numpy
step: Mamba-1's layout and Mamba-2's multi-head layout (tied and untied A), every dtype, odd
shapes, dt_limit, and a state past 2^31 elements (64-bit offsets). Outputs are poisoned (NaN)."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton.state_update import selective_state_update
from paddlenlp_fused.testing.numerics import assert_close, silu

DTYPES = ("float32", "float16", "bfloat16")


def _step64(state, x, dt, A, B, C, D, z, dt_bias, softplus, dt_limit=(0.0, np.inf)):
    """float64 step on numpy arrays already broadcast to the state's layout [..., p, n]: dt, x, z,
    D [..., p]; A [..., p, n] or broadcastable; B, C [..., n] per row (expanded by the caller)."""
    dt = dt + (dt_bias if dt_bias is not None else 0.0)
    if softplus:
        dt = np.where(dt <= 20, np.log1p(np.exp(np.minimum(dt, 20))), dt)
    dt = np.clip(dt, *dt_limit)
    new = state * np.exp(dt[..., None] * A) + (dt * x)[..., None] * B
    y = (new * C).sum(-1)
    if D is not None:
        y = y + D * x
    if z is not None:
        y = y * silu(z)
    return new, y


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba1_layout_matches_float64(provider, dtype):
    batch, dim, dstate, groups = 3, 130, 16, 2
    state = provider.randn((batch, dim, dstate), dtype)
    state0 = provider.to_numpy(state)
    x, dt, z = (provider.randn((batch, dim), dtype) for _ in range(3))
    A = provider.from_numpy(-np.exp(np.random.randn(dim, dstate)), "float32")
    B, C = provider.randn((batch, groups, dstate), dtype), provider.randn((batch, groups, dstate), dtype)
    D, dt_bias = provider.randn((dim,), "float32"), provider.randn((dim,), "float32")
    out = provider.poisoned((batch, dim), dtype)
    selective_state_update(state, x, dt, A, B, C, out, D, z, dt_bias, dt_softplus=True)
    provider.synchronize()
    n = {k: provider.to_numpy(v) for k, v in dict(x=x, dt=dt, z=z, A=A, B=B, C=C, D=D, b=dt_bias).items()}
    per_dim = lambda M: np.repeat(M, dim // groups, axis=1)  # noqa: E731
    new, y = _step64(state0, n["x"], n["dt"], n["A"], per_dim(n["B"]), per_dim(n["C"]), n["D"], n["z"], n["b"], True)
    assert_close("state", provider.to_numpy(state), new, dtype)
    assert_close("out", provider.to_numpy(out), y, dtype)


def _multihead_case(provider, dtype, batch, nheads, headdim, dstate, ngroups, tied, D_per_row, with_z, dt_limit,
                    state_dtype=None):
    state = provider.randn((batch, nheads, headdim, dstate), state_dtype or dtype)
    state0 = provider.to_numpy(state)
    x = provider.randn((batch, nheads, headdim), dtype)
    z = provider.randn((batch, nheads, headdim), dtype) if with_z else None
    if tied:
        dt, dt_bias = provider.randn((batch, nheads), dtype), provider.randn((nheads,), "float32")
        A = provider.from_numpy(-np.exp(np.random.randn(nheads)), "float32")
    else:
        dt, dt_bias = provider.randn((batch, nheads, headdim), dtype), provider.randn((nheads, headdim), "float32")
        A = provider.from_numpy(-np.exp(np.random.randn(nheads, headdim, dstate)), "float32")
    B, C = (provider.randn((batch, ngroups, dstate), dtype) for _ in range(2))
    D = provider.randn((nheads, headdim) if D_per_row else (nheads,), "float32")
    out = provider.poisoned((batch, nheads, headdim), dtype)
    selective_state_update(state, x, dt, A, B, C, out, D, z, dt_bias, dt_softplus=True, dt_limit=dt_limit)
    provider.synchronize()
    n = {k: provider.to_numpy(v) if v is not None else None
         for k, v in dict(x=x, dt=dt, z=z, A=A, B=B, C=C, D=D, b=dt_bias).items()}
    per_head = lambda M: np.repeat(M, nheads // ngroups, axis=1)[:, :, None, :]  # noqa: E731
    if tied:
        dt64 = np.broadcast_to(n["dt"][..., None], (batch, nheads, headdim))
        bias64 = np.broadcast_to(n["b"][:, None], (nheads, headdim))
        A64 = n["A"][:, None, None]
    else:
        dt64, bias64, A64 = n["dt"], n["b"], n["A"]
    D64 = n["D"] if D_per_row else n["D"][:, None]
    new, y = _step64(state0, n["x"], dt64, A64, per_head(n["B"]), per_head(n["C"]), D64, n["z"], bias64, True,
                     dt_limit)
    assert_close("state", provider.to_numpy(state), new, state_dtype or dtype)
    assert_close("out", provider.to_numpy(out), y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 8, 64, 128, 1), (3, 6, 33, 17, 3), (1, 1, 1, 1, 1), (5, 12, 80, 64, 4)],
                         ids=str)  # (batch, nheads, headdim, dstate, ngroups)
def test_mamba2_layout_matches_float64(provider, dtype, shape):
    batch, nheads, headdim, dstate, ngroups = shape
    _multihead_case(provider, dtype, batch, nheads, headdim, dstate, ngroups, tied=True, D_per_row=False,
                    with_z=True, dt_limit=(0.0, float("inf")))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_options(provider, dtype):
    """Untied A [h, p, n], D per row, no z, dt_limit clipping both ways, an fp32 state with
    half-precision inputs."""
    _multihead_case(provider, dtype, 2, 4, 24, 16, 2, tied=False, D_per_row=True, with_z=False,
                    dt_limit=(0.3, 0.9))
    _multihead_case(provider, dtype, 3, 6, 16, 32, 3, tied=True, D_per_row=True, with_z=True,
                    dt_limit=(0.1, 0.5), state_dtype="float32")


@pytest.mark.xdist_group("huge")
def test_state_past_2_31_elements(provider):
    """A bf16 state of 2049 * 64 * 64 * 256 > 2^31 elements: the last batch rows are right."""
    batch, nheads, headdim, dstate = 2049, 64, 64, 256
    state = provider.randn((batch, nheads, headdim, dstate), "bfloat16")
    tail0 = provider.to_numpy(state[-2:])
    x = provider.randn((batch, nheads, headdim), "bfloat16")
    dt = provider.randn((batch, nheads), "bfloat16")
    A = provider.from_numpy(-np.exp(np.random.randn(nheads)), "float32")
    B, C = (provider.randn((batch, 1, dstate), "bfloat16") for _ in range(2))
    out = provider.poisoned((batch, nheads, headdim), "bfloat16")
    selective_state_update(state, x, dt, A, B, C, out, dt_softplus=True)
    provider.synchronize()
    n = {k: provider.to_numpy(v[-2:]) for k, v in dict(x=x, dt=dt, B=B, C=C).items()}
    new, y = _step64(tail0, n["x"], np.broadcast_to(n["dt"][..., None], n["x"].shape),
                     provider.to_numpy(A)[:, None, None], n["B"][:, :, None, :], n["C"][:, :, None, :],
                     None, None, None, True)
    assert_close("state tail", provider.to_numpy(state[-2:]), new, "bfloat16")
    assert_close("out tail", provider.to_numpy(out[-2:]), y, "bfloat16")
    assert not np.isnan(provider.to_numpy(out[:: batch // 7])).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("multihead", [False, True])
def test_state_batch_indices(provider, dtype, multihead):
    """state_batch_indices: a cache of 11 slots, 6 rows in any order, two padding rows (-1): those
    output 0 and the slots no row names are bit-unchanged; Mamba-1 (odd dim 130, dstate 16, groups)
    and Mamba-2 (tied A, 6 heads of 33, dstate 17, 3 groups); out poisoned; int32 and int64 indices."""
    idx = np.array([9, -1, 0, 4, -1, 10])
    batch, slots = len(idx), 11
    if multihead:
        nheads, headdim, dstate, groups = 6, 33, 17, 3
        lead = (nheads, headdim)
        dt, dt_bias = provider.randn((batch, nheads), dtype), provider.randn((nheads,), "float32")
        A = provider.from_numpy(-np.exp(np.random.randn(nheads)), "float32")
        D = provider.randn((nheads,), "float32")
    else:
        dim, dstate, groups = 130, 16, 2
        lead = (dim,)
        dt, dt_bias = provider.randn((batch, dim), dtype), provider.randn((dim,), "float32")
        A = provider.from_numpy(-np.exp(np.random.randn(dim, dstate)), "float32")
        D = provider.randn((dim,), "float32")
    cache = provider.randn((slots,) + lead + (dstate,), dtype)
    cache0 = provider.to_numpy(cache)
    x, z = provider.randn((batch,) + lead, dtype), provider.randn((batch,) + lead, dtype)
    B, C = provider.randn((batch, groups, dstate), dtype), provider.randn((batch, groups, dstate), dtype)
    out = provider.poisoned((batch,) + lead, dtype)
    selective_state_update(cache, x, dt, A, B, C, out, D, z, dt_bias, dt_softplus=True,
                           state_batch_indices=provider.from_numpy(idx, "int64" if dtype == "float16" else "int32"))
    provider.synchronize()
    n = {k: provider.to_numpy(v) for k, v in dict(x=x, dt=dt, z=z, A=A, B=B, C=C, D=D, b=dt_bias).items()}
    live = idx >= 0
    if multihead:  # broadcast the per-head dt, A, D and the grouped B, C over [b, h, p, n]
        per_head = lambda M: np.repeat(M, nheads // groups, axis=1)[:, :, None, :]  # noqa: E731
        new, y = _step64(cache0[idx[live]], n["x"][live], np.repeat(n["dt"][live][..., None], headdim, -1),
                         n["A"][:, None, None], per_head(n["B"][live]), per_head(n["C"][live]),
                         n["D"][:, None], n["z"][live], n["b"][:, None], True)
    else:
        per_dim = lambda M: np.repeat(M, dim // groups, axis=1)  # noqa: E731
        new, y = _step64(cache0[idx[live]], n["x"][live], n["dt"][live], n["A"], per_dim(n["B"][live]),
                         per_dim(n["C"][live]), n["D"], n["z"][live], n["b"], True)
    got, after = provider.to_numpy(out), provider.to_numpy(cache)
    assert (got[~live] == 0).all()
    untouched = [s for s in range(slots) if s not in idx]
    np.testing.assert_array_equal(after[untouched], cache0[untouched])
    assert_close("state", after[idx[live]], new, dtype)
    assert_close("out", got[live], y, dtype)
