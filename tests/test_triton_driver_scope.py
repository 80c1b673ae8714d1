"""Triton's active driver and allocator are process-wide: every op must give back the ones active
before it (issue #16), so that a torch Triton kernel launched between our calls, or while Paddle runs
our backward later, sees its own driver. Here a foreign driver and allocator (standing for torch's)
are active around each op call; every Triton launch inside the op must see the interpreter driver,
and the foreign ones must be active again after the forward, after the backward and after a
non-autograd call, with the results those of a run without them."""

import numpy as np
import paddle
import pytest
from triton.backends.driver import DriverBase
from triton.runtime import _allocation, driver
from triton.runtime import interpreter as triton_interpreter

import paddlenlp_fused as pf
from paddlenlp_fused.runtime import triton_paddle
from paddlenlp_fused.runtime.interpreter import interpreter_driver


class ForeignDriver(DriverBase):
    """Stands for torch's driver: a launch of ours that asks it for anything fails."""

    @classmethod
    def is_active(cls):
        return False

    def _used(self, *_):
        raise AssertionError("a paddlenlp_fused launch used the foreign driver")

    map_python_to_cpp_type = get_current_target = get_active_torch_device = get_benchmarker = _used


def _foreign_allocator(size, alignment, stream):
    raise AssertionError("a paddlenlp_fused launch used the foreign allocator")


@pytest.fixture
def launches(monkeypatch):
    """The driver active at every Triton launch (the interpreter's grid executor runs each)."""
    seen = []
    run = triton_interpreter.GridExecutor.__call__

    def recording(self, *args, **kwargs):
        seen.append(driver._active)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(triton_interpreter.GridExecutor, "__call__", recording)
    return seen


@pytest.fixture
def foreign():
    """Makes the foreign driver and allocator active; puts back what was there after the test."""
    before = (driver._active, _allocation._allocator.get())
    active = ForeignDriver()
    driver.set_active(active)
    _allocation._allocator.set(_foreign_allocator)
    yield active
    driver._active = before[0]
    _allocation._allocator.set(before[1])


def _assert_given_back(active, launches, when):
    assert driver._active is active, f"{when}: Triton's driver is {driver._active!r}, not the one active before"
    assert _allocation._allocator.get() is _foreign_allocator, f"{when}: the allocator was not given back"
    assert triton_paddle._open_scopes == 0, when
    assert launches, f"{when}: no Triton launch (the case does not reach the kernels)"
    assert all(d is interpreter_driver() for d in launches), f"{when}: a launch saw {set(launches) - {None}}"
    launches.clear()


def _leaves(*shapes, scale=1.0):
    leaves = []
    for shape in shapes:
        leaf = paddle.to_tensor((np.random.randn(*shape) * scale).astype(np.float32))
        leaf.stop_gradient = False
        leaves.append(leaf)
    return leaves


def _tensor(*shape, scale=1.0):
    return paddle.to_tensor((np.random.randn(*shape) * scale).astype(np.float32))


def _fwd_bwd(forward, *leaves):
    """Runs ``forward(*leaves)``, calls ``between()`` (the op has returned; its backward has not
    run), then the backward; returns outputs and gradients."""
    def case(between):
        outs = forward(*leaves)
        outs = [t for t in (outs if isinstance(outs, (tuple, list)) else (outs,)) if t is not None]
        between("forward")
        sum(paddle.sum(t * t) for t in outs).backward()
        return outs + [leaf.grad for leaf in leaves]
    return case


def _layer_norm():
    x, w, b, res = _leaves((6, 16), (16,), (16,), (6, 16))
    return _fwd_bwd(lambda *t: pf.layer_norm_fn(*t, prenorm=True, backend="triton"), x, w, b, res)


def _rmsnorm_gated():
    x, w, z = _leaves((6, 16), (16,), (6, 16))
    return _fwd_bwd(lambda x, w, z: pf.rmsnorm_gated_fn(x, w, z, group_size=8, backend="triton"), x, w, z)


def _swiglu():
    return _fwd_bwd(lambda x: pf.swiglu(x, backend="triton"), *_leaves((5, 16)))


def _fused_dense():
    return _fwd_bwd(lambda *t: pf.fused_dense_func(*t, backend="triton"), *_leaves((5, 8), (8, 6), (6,)))


def _fused_mlp_no_grad():
    x, w1, w2, b1, b2 = (_tensor(*s, scale=0.5) for s in ((5, 8), (8, 6), (6, 4), (6,), (4,)))
    return lambda between: [pf.fused_mlp_func(x, w1, w2, b1, b2, activation="relu", backend="triton")]


def _linear_cross_entropy():
    hidden, weight = _leaves((6, 8), (11, 8))
    labels = paddle.to_tensor(np.random.randint(0, 11, (6,)).astype(np.int64))
    return _fwd_bwd(lambda h, w: pf.linear_cross_entropy(h, w, labels, backend="triton"), hidden, weight)


def _contrastive():
    q, k = _leaves((6, 8), (6, 8), scale=0.5)
    return _fwd_bwd(lambda q, k: pf.flash_contrastive_loss(q, k, scale=2.0, precision="ieee", backend="triton"), q, k)


def _scan_leaves(batch=2, dim=4, seqlen=7, dstate=3):
    u, delta, B, C, D, z = _leaves((batch, dim, seqlen), (batch, dim, seqlen), (batch, dstate, seqlen),
                                   (batch, dstate, seqlen), (dim,), (batch, dim, seqlen))
    A = paddle.to_tensor(-np.random.uniform(0.5, 1.5, (dim, dstate)).astype(np.float32))
    A.stop_gradient = False
    return u, delta, A, B, C, D, z


def _selective_scan():
    return _fwd_bwd(lambda *t: pf.selective_scan_fn(*t, delta_softplus=True, backend="triton"), *_scan_leaves())


def _selective_state_update():
    state, x, dt, B, C = (_tensor(*s) for s in ((2, 4, 3), (2, 4), (2, 4), (2, 1, 3), (2, 1, 3)))
    A = paddle.to_tensor(-np.random.uniform(0.5, 1.5, (4, 3)).astype(np.float32))
    return lambda between: [pf.selective_state_update(state, x, dt, A, B, C, dt_softplus=True, backend="triton"),
                            state]


def _causal_conv1d():
    return _fwd_bwd(lambda *t: pf.causal_conv1d_fn(*t, activation="silu", backend="triton"),
                    *_leaves((2, 5, 9), (5, 4), (5,)))


def _causal_conv1d_update():
    x, state, weight, bias = (_tensor(*s) for s in ((2, 5), (2, 5, 3), (5, 4), (5,)))
    return lambda between: [pf.causal_conv1d_update(x, state, weight, bias, "silu", backend="triton"), state]


def _causal_conv1d_varlen_states():
    x, cu_seqlens = _tensor(9, 5), paddle.to_tensor(np.array([0, 4, 9], dtype=np.int32))
    return lambda between: [pf.causal_conv1d_varlen_states(x, cu_seqlens, 3, backend="triton")]


def _mamba_inner():
    dim, dstate, rank = 4, 3, 2
    xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w, D = _leaves(
        (2, 2 * dim, 6), (dim, 4), (dim,), (dim, rank + 2 * dstate), (rank, dim), (dim, 5), (dim,), scale=0.5)
    A = paddle.to_tensor(-np.random.uniform(0.5, 1.5, (dim, dstate)).astype(np.float32))
    return _fwd_bwd(lambda *t: pf.mamba_inner_fn(*t, None, A, D=D, delta_softplus=True, backend="triton"),
                    xz, conv_w, conv_b, x_proj_w, delta_proj_w, out_proj_w)


def _chunk_scan():
    x, dt, B, C, D = _leaves((1, 12, 2, 4), (1, 12, 2), (1, 12, 1, 4), (1, 12, 1, 4), (2,))
    A = paddle.to_tensor(-np.random.uniform(0.5, 1.5, (2,)).astype(np.float32))
    return _fwd_bwd(lambda x, dt, B, C, D: pf.mamba_chunk_scan_combined(x, dt, A, B, C, 8, D=D, dt_softplus=True,
                                                                        backend="triton"), x, dt, B, C, D)


def _split_conv1d_scan_no_grad():
    nheads, headdim, dstate = 2, 4, 4
    dim = nheads * headdim
    zxbcdt, conv_w, conv_b, dt_bias, D, norm_w = (_tensor(*s, scale=0.5) for s in (
        (1, 10, 2 * dim + 2 * dstate + nheads), (dim + 2 * dstate, 4), (dim + 2 * dstate,), (nheads,), (nheads,),
        (dim,)))
    A = paddle.to_tensor(-np.random.uniform(0.5, 1.5, (nheads,)).astype(np.float32))
    return lambda between: [pf.mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, 8,
                                                                headdim=headdim, rmsnorm_weight=norm_w,
                                                                backend="triton")]


def _mamba2_state_update():
    state, x, dt, B, C = (_tensor(*s) for s in ((2, 2, 4, 3), (2, 2, 4), (2, 2), (2, 1, 3), (2, 1, 3)))
    A = paddle.to_tensor(-np.random.uniform(0.5, 1.5, (2,)).astype(np.float32))
    return lambda between: [pf.mamba2_state_update(state, x, dt, A, B, C, backend="triton"), state]


def _adamw_steps():
    params = [paddle.create_parameter([33], "float32"), paddle.create_parameter([4, 5], "float32")]
    grads = [_tensor(33), _tensor(4, 5)]
    for p in params:
        p.set_value(_tensor(*p.shape))
    opt = pf.FusedAdamW(learning_rate=0.1, parameters=params, backend="triton")

    def case(between):
        for step in range(2):
            if step:
                between("first step")
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        return list(params)
    return case


CASES = {
    "layer_norm_fn(residual, prenorm)": _layer_norm, "rmsnorm_gated_fn": _rmsnorm_gated, "swiglu": _swiglu,
    "fused_dense_func": _fused_dense, "fused_mlp_func(no grad)": _fused_mlp_no_grad,
    "linear_cross_entropy": _linear_cross_entropy, "flash_contrastive_loss": _contrastive,
    "selective_scan_fn": _selective_scan, "selective_state_update": _selective_state_update,
    "causal_conv1d_fn": _causal_conv1d, "causal_conv1d_update": _causal_conv1d_update,
    "causal_conv1d_varlen_states": _causal_conv1d_varlen_states, "mamba_inner_fn": _mamba_inner,
    "mamba_chunk_scan_combined": _chunk_scan, "mamba_split_conv1d_scan_combined(no grad)": _split_conv1d_scan_no_grad,
    "mamba2_state_update": _mamba2_state_update, "FusedAdamW.step": _adamw_steps,
}


@pytest.mark.parametrize("name", CASES)
def test_op_gives_triton_s_driver_back(name, launches, foreign):
    seed = np.random.randint(2**31)
    np.random.seed(seed)
    with_foreign = CASES[name]()(lambda when: _assert_given_back(foreign, launches, f"{name}: after the {when}"))
    _assert_given_back(foreign, launches, f"{name}: at the end")

    driver._active = None  # the same inputs again with Triton's own state (no driver chosen yet)
    np.random.seed(seed)
    alone = CASES[name]()(lambda when: None)
    assert driver._active is None
    for got, want in zip(with_foreign, alone):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_an_op_that_raises_gives_the_driver_back(launches, foreign):
    hidden, weight = _tensor(4, 8), _tensor(11, 8)
    with pytest.raises(ValueError, match="labels"):  # found by the kernel, raised after its launch
        pf.linear_cross_entropy(hidden, weight, paddle.to_tensor(np.array([0, 3, 11, 2])), backend="triton")
    _assert_given_back(foreign, launches, "after the error")


def test_nested_scopes_restore_only_when_the_outermost_ends(launches, foreign):
    x = _tensor(3, 8)

    @triton_paddle.triton_scoped
    def two_ops():
        first = pf.swiglu(x, backend="triton")
        assert driver._active is interpreter_driver(), "the inner op restored in the middle of the outer scope"
        return pf.geglu(first.tile([1, 2]), backend="triton")

    two_ops()
    _assert_given_back(foreign, launches, "after the outer scope")


def test_direct_kernel_calls_keep_the_driver_until_restored(foreign):
    """Outside any scope (a test or benchmark calling kernels directly) triton_args leaves the
    interpreter driver active until restore_triton_driver(); an op in between gives back that one."""
    triton_paddle.triton_args(_tensor(2))
    assert driver._active is interpreter_driver()
    pf.swiglu(_tensor(2, 4), backend="triton")
    assert driver._active is interpreter_driver()
    triton_paddle.restore_triton_driver()
    assert driver._active is foreign and _allocation._allocator.get() is _foreign_allocator
