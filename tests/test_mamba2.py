"""Mamba-2 block and ``mamba_split_conv1d_scan_combined`` against an explicit float64 composition.

The composition written here (in_proj matmul, split, a depthwise causal conv loop, silu, the float64
token-by-token recurrence ``ssd_recurrence_ref``, the gated RMSNorm formula, out_proj) checks values
and the gradients of every parameter; seqlen 11 with chunk 4 leaves a ragged last chunk. Prefill then
step-by-step decoding must equal the full forward, and packed ``cu_seqlens`` the per-sequence loop.
The op's single PyLayer equals its composition at both checkpoint levels; the decoding-step kernel
(interpreter) matches a float64 step in Mamba-2's and Mamba-1's layouts."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.triton.state_update import selective_state_update as state_update_launch
from paddlenlp_fused.layers.mamba2 import Mamba2Block, Mamba2InferenceParams
from paddlenlp_fused.ops.mamba2 import mamba2_state_update, mamba_split_conv1d_scan_combined
from paddlenlp_fused.reference.ssd import ssd_recurrence_ref
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.testing.numerics import assert_close, assert_sum_close
from paddlenlp_fused.runtime.triton_paddle import triton_args
from helpers import as_leaf64, randn, to64

D_MODEL, HEADDIM, D_STATE, D_CONV, CHUNK = 16, 8, 6, 4, 4  # d_inner 32, 4 heads


def _conv64(x, weight, bias):
    """Depthwise causal conv + silu, x [b, l, c], weight [c, w], written as a loop over taps."""
    width, seqlen = weight.shape[1], x.shape[1]
    padded = paddle.concat([paddle.zeros([x.shape[0], width - 1, x.shape[2]], dtype=x.dtype), x], axis=1)
    out = sum(padded[:, k:k + seqlen] * weight[:, k] for k in range(width))
    return F.silu(out + bias if bias is not None else out)


def _composition64(zxbcdt, conv_w, conv_b, dt_bias, A, D, ngroups, headdim, dt_limit, norm_w=None, eps=1e-5,
                   norm_before_gate=False, out_w=None, out_b=None, initial_states=None):
    """The Mamba-2 inner path in float64 from plain ops; returns (out, final ssm state)."""
    nheads = A.shape[0]
    dim = nheads * headdim
    dstate = (conv_w.shape[0] - dim) // (2 * ngroups)
    b, l, _ = zxbcdt.shape
    z, xBC, dt = paddle.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], axis=-1)
    xBC = _conv64(xBC, conv_w.reshape([conv_w.shape[0], -1]), conv_b)
    x, B, C = paddle.split(xBC, [dim, ngroups * dstate, ngroups * dstate], axis=-1)
    z4 = z.reshape([b, l, nheads, headdim])
    y, h = ssd_recurrence_ref(x.reshape([b, l, nheads, headdim]), dt, A, B.reshape([b, l, ngroups, dstate]),
                              C.reshape([b, l, ngroups, dstate]), D=D, z=None if norm_w is not None else z4,
                              dt_bias=dt_bias, initial_states=initial_states, dt_softplus=True, dt_limit=dt_limit)
    y = y.reshape([b, l, dim])
    if norm_w is not None:
        gate = F.silu(z)
        h_in = y if norm_before_gate else y * gate
        g = h_in.reshape([b, l, ngroups, dim // ngroups])
        normed = (g * paddle.rsqrt((g * g).mean(-1, keepdim=True) + eps)).reshape([b, l, dim]) * norm_w
        y = normed * gate if norm_before_gate else normed
    if out_w is not None:
        y = paddle.matmul(y, out_w) + (out_b if out_b is not None else 0.0)
    return y, h


def _block(ngroups, **kw):
    blk = Mamba2Block(D_MODEL, d_state=D_STATE, d_conv=D_CONV, headdim=HEADDIM, ngroups=ngroups, chunk_size=CHUNK,
                      layer_idx=0, **kw)
    # move the parameters off their structured init (D = 1, norm weight = 1) so every term shows
    for p in (blk.D, blk.norm.weight, blk.conv1d.bias, blk.out_proj.bias):
        if p is not None:
            p.set_value(p + paddle.to_tensor(np.random.randn(*p.shape).astype(np.float32) * 0.3))
    return blk


@pytest.mark.parametrize("ngroups,norm_before_gate,dt_limit,bias", [
    (1, False, (0.0, float("inf")), False),
    (2, True, (0.02, 0.08), True),
])
def test_block_matches_float64_composition(ngroups, norm_before_gate, dt_limit, bias):
    blk = _block(ngroups, norm_before_gate=norm_before_gate, dt_limit=dt_limit, bias=bias)
    u = randn((2, 11, D_MODEL), requires_grad=True)
    grad_out = randn((2, 11, D_MODEL))
    out = blk(u)
    (out * grad_out).sum().backward()

    params = {name: as_leaf64(p) for name, p in blk.named_parameters()}
    u64 = as_leaf64(u)
    zxbcdt = paddle.matmul(u64, params["in_proj.weight"]) + params.get("in_proj.bias", 0.0)
    ref, _ = _composition64(zxbcdt, params["conv1d.weight"], params["conv1d.bias"], params["dt_bias"],
                            -paddle.exp(params["A_log"]), params["D"], ngroups, HEADDIM, dt_limit,
                            params["norm.weight"], blk.norm.eps, norm_before_gate, params["out_proj.weight"],
                            params.get("out_proj.bias"))
    per_token = (ref * paddle.to_tensor(grad_out.numpy().astype(np.float64))).sum(axis=-1).flatten()
    per_head = [n for n in ("dt_bias", "A_log", "D") if n in params]
    terms = {n: np.zeros(params[n].shape) for n in per_head}
    for t in range(per_token.shape[0]):  # each token's term of the per-head gradients (sums over tokens)
        for n, g in zip(per_head, paddle.grad(per_token[t], [params[n] for n in per_head], retain_graph=True)):
            terms[n] += np.abs(g.numpy())
    per_token.sum().backward()
    assert_close("out", out.numpy(), ref.numpy(), "float32")
    assert_close("du", u.grad.numpy(), u64.grad.numpy(), "float32")
    for name, p in blk.named_parameters():
        assert p.grad is not None, name
        if name in terms:  # a few numbers, each summing every token's term: they can cancel (DESIGN.md)
            assert_sum_close(f"d{name}", p.grad.numpy(), params[name].grad.numpy(), terms[name], "float32")
        else:
            assert_close(f"d{name}", p.grad.numpy(), params[name].grad.numpy(), "float32")


def test_op_gate_without_norm_final_states_and_initial_states():
    """No rmsnorm / out_proj: y * silu(z); D per channel; initial and final states; gradients."""
    nheads, ngroups, dim = 4, 2, 4 * HEADDIM
    conv_dim = dim + 2 * ngroups * D_STATE
    args = dict(zxbcdt=randn((2, 9, 2 * dim + 2 * ngroups * D_STATE + nheads), requires_grad=True),
                conv_w=randn((conv_dim, 1, D_CONV), scale=0.5, requires_grad=True),
                conv_b=randn((conv_dim,), scale=0.3, requires_grad=True),
                dt_bias=randn((nheads,), scale=0.3, requires_grad=True),
                A=paddle.to_tensor(-np.exp(np.random.randn(nheads) * 0.5).astype(np.float32)),
                D=randn((nheads, HEADDIM), requires_grad=True),
                initial_states=randn((2, nheads, HEADDIM, D_STATE), requires_grad=True))
    args["A"].stop_gradient = False
    out, final = mamba_split_conv1d_scan_combined(
        args["zxbcdt"], args["conv_w"], args["conv_b"], args["dt_bias"], args["A"], args["D"], CHUNK,
        initial_states=args["initial_states"], return_final_states=True, ngroups=ngroups)
    grad_out = randn(out.shape)
    ((out * grad_out).sum() + final.sum()).backward()
    a64 = {k: as_leaf64(v) for k, v in args.items()}
    ref, ref_final = _composition64(a64["zxbcdt"], a64["conv_w"], a64["conv_b"], a64["dt_bias"], a64["A"], a64["D"],
                                    ngroups, HEADDIM, (0.0, float("inf")), initial_states=a64["initial_states"])
    ((ref * paddle.to_tensor(grad_out.numpy().astype(np.float64))).sum() + ref_final.sum()).backward()
    assert out.shape == [2, 9, dim] and final.dtype == paddle.float32
    assert_close("out", out.numpy(), ref.numpy(), "float32")
    assert_close("final_states", final.numpy(), ref_final.numpy(), "float32")
    for name in args:
        assert_close(f"d{name}", args[name].grad.numpy(), a64[name].grad.numpy(), "float32")


@pytest.mark.parametrize("prefill", [2, 6])  # fewer tokens than d_conv, and more
def test_prefill_then_decoding_equals_full_forward(prefill):
    blk = _block(2, dt_limit=(0.02, 0.05))  # clips both ways at the init range 0.001..0.1
    u = randn((2, 10, D_MODEL))
    with paddle.no_grad():
        full = blk(u)
        cache = Mamba2InferenceParams(max_seqlen=10, max_batch_size=2)
        outs = [blk(u[:, :prefill], inference_params=cache)]
        cache.seqlen_offset = prefill
        for t in range(prefill, 10):
            outs.append(blk(u[:, t:t + 1], inference_params=cache))
            cache.seqlen_offset += 1
    assert_close("decoded", paddle.concat(outs, axis=1).numpy(), full.numpy(), "float32")
    conv_state, ssm_state = cache.key_value_memory_dict[0]
    assert conv_state.shape == [2, blk.conv_dim, D_CONV] and ssm_state.shape == [2, 4, HEADDIM, D_STATE]


def test_step_matches_state_update_op_shapes():
    """``step`` on a fresh cache equals the first token of the full forward; 2- and 3-axis inputs."""
    blk = _block(1)
    u = randn((3, 1, D_MODEL))
    conv_state, ssm_state = blk.allocate_inference_cache(3, 8)
    with paddle.no_grad():
        stepped = blk.step(u, conv_state, ssm_state)
        assert stepped.shape == [3, 1, D_MODEL]
        assert_close("step", stepped.numpy(), blk(u).numpy(), "float32")
        assert blk.step(u[:, 0], *blk.allocate_inference_cache(3, 8)).shape == [3, D_MODEL]


def test_cu_seqlens_equals_per_sequence_loop():
    blk = _block(2)
    lengths = [5, 1, 7]
    seqs = [randn((1, n, D_MODEL)) for n in lengths]
    cu = paddle.to_tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    packed = blk(paddle.concat(seqs, axis=1), cu_seqlens=cu)
    loop = paddle.concat([blk(s) for s in seqs], axis=1)
    assert_close("packed", packed.numpy(), loop.numpy(), "float32")
    seq_idx = paddle.to_tensor(np.repeat(np.arange(3), lengths)[None].astype(np.int32))
    assert_close("seq_idx", blk(paddle.concat(seqs, axis=1), seq_idx=seq_idx).numpy(), loop.numpy(), "float32")


def test_bad_inputs():
    blk = _block(1)
    u = randn((2, 5, D_MODEL))
    with pytest.raises(ValueError, match="u: expected"):
        blk(randn((2, 5, D_MODEL + 1)))
    with pytest.raises(ValueError, match="cu_seqlens"):
        blk(u, cu_seqlens=paddle.to_tensor(np.array([0, 2, 5], dtype=np.int32)))  # batch 2
    with pytest.raises(ValueError, match="cu_seqlens"):
        blk(u[:1], cu_seqlens=paddle.to_tensor(np.array([0, 3, 4], dtype=np.int32)))  # does not reach seqlen
    with pytest.raises(NotImplementedError, match="packed"):
        blk(u[:1], cu_seqlens=paddle.to_tensor(np.array([0, 5], dtype=np.int32)),
            inference_params=Mamba2InferenceParams(8, 1))
    with pytest.raises(ValueError, match="headdim"):
        Mamba2Block(D_MODEL, headdim=5)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2Block(D_MODEL, headdim=HEADDIM, ngroups=3)
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        Mamba2Block(D_MODEL, headdim=HEADDIM, checkpoint_lvl=2)
    with pytest.raises(ValueError, match="backend"):
        Mamba2Block(D_MODEL, headdim=HEADDIM, backend="tpu")
    # its ops have no CUDA backend: the ops' error, at construction rather than at the first forward
    with pytest.raises(BackendUnavailableError, match="Mamba2Block: no 'cuda' implementation"):
        Mamba2Block(D_MODEL, headdim=HEADDIM, backend="cuda")
    with pytest.raises(ValueError, match="layer_idx"):
        Mamba2Block(D_MODEL, headdim=HEADDIM)(u, inference_params=Mamba2InferenceParams(8, 2))
    A, D = blk._A(), blk.D
    zxbcdt = blk.in_proj(u)
    conv_w, conv_b = blk.conv1d.weight, blk.conv1d.bias
    with pytest.raises(ValueError, match="zxbcdt: expected last axis"):
        mamba_split_conv1d_scan_combined(zxbcdt[..., 1:], conv_w, conv_b, blk.dt_bias, A, D, CHUNK, headdim=HEADDIM)
    with pytest.raises(ValueError, match="headdim: required"):
        mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, blk.dt_bias, A, D, CHUNK)
    with pytest.raises(ValueError, match="outproj_weight"):
        mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, blk.dt_bias, A, D, CHUNK, headdim=HEADDIM,
                                         outproj_weight=blk.out_proj.weight.T)
    with pytest.raises(ValueError, match="activation"):
        mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, blk.dt_bias, A, D, CHUNK, headdim=HEADDIM,
                                         activation="relu")
    with pytest.raises(TypeError, match="zxbcdt"):
        mamba_split_conv1d_scan_combined(zxbcdt.numpy(), conv_w, conv_b, blk.dt_bias, A, D, CHUNK, headdim=HEADDIM)
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, blk.dt_bias, A, D, CHUNK, headdim=HEADDIM,
                                         checkpoint_lvl=2)
    state, BC = paddle.zeros([2, 4, HEADDIM, D_STATE]), paddle.zeros([2, 1, D_STATE])
    with pytest.raises(ValueError, match="x: expected"):
        mamba2_state_update(state, paddle.zeros([2, 4, HEADDIM + 1]), paddle.zeros([2, 4]), A, BC, BC)
    with pytest.raises(ValueError, match="D: expected"):
        mamba2_state_update(state, paddle.zeros([2, 4, HEADDIM]), paddle.zeros([2, 4]), A, BC, BC,
                            D=paddle.zeros([4, HEADDIM + 1]))
    with pytest.raises(ValueError, match="B: expected"):
        mamba2_state_update(state, paddle.zeros([2, 4, HEADDIM]), paddle.zeros([2, 4]), A, paddle.zeros([2, 3, 6]), BC)


# ----------------------------------------------------------------------------------------------
# the single PyLayer against the composition


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
def test_pylayer_matches_float64_composition(checkpoint_lvl):
    """backend auto (the op's PyLayer over the Triton kernels in the interpreter) against the float64
    composition written here, as the reference-backend composition is in the tests above: outputs,
    final states and the gradients of every input, with initial states, norm and out_proj, and a
    gradient for the final states too."""
    nheads, ngroups, dim = 4, 2, 4 * HEADDIM
    conv_dim = dim + 2 * ngroups * D_STATE
    args = dict(zxbcdt=randn((1, 7, 2 * dim + 2 * ngroups * D_STATE + nheads), requires_grad=True),
                conv_w=randn((conv_dim, 1, D_CONV), scale=0.5, requires_grad=True),
                conv_b=randn((conv_dim,), scale=0.3, requires_grad=True),
                dt_bias=randn((nheads,), scale=0.3, requires_grad=True),
                A=paddle.to_tensor(-np.exp(np.random.randn(nheads) * 0.5).astype(np.float32)),
                D=randn((nheads,), requires_grad=True), initial_states=randn((1, nheads, HEADDIM, D_STATE),
                                                                             requires_grad=True),
                norm_w=paddle.to_tensor(1 + 0.3 * np.random.randn(dim).astype(np.float32)),
                out_w=randn((dim, 5), scale=0.3, requires_grad=True), out_b=randn((5,), requires_grad=True))
    args["A"].stop_gradient = args["norm_w"].stop_gradient = False
    out, final = mamba_split_conv1d_scan_combined(
        args["zxbcdt"], args["conv_w"], args["conv_b"], args["dt_bias"], args["A"], args["D"], CHUNK,
        initial_states=args["initial_states"], return_final_states=True, rmsnorm_weight=args["norm_w"],
        rmsnorm_eps=1e-5, outproj_weight=args["out_w"], outproj_bias=args["out_b"], headdim=HEADDIM,
        ngroups=ngroups, checkpoint_lvl=checkpoint_lvl)
    grad_out, grad_final = randn(out.shape), randn(final.shape)
    ((out * grad_out).sum() + (final * grad_final).sum()).backward()
    a64 = {k: as_leaf64(v) for k, v in args.items()}
    ref, ref_final = _composition64(a64["zxbcdt"], a64["conv_w"], a64["conv_b"], a64["dt_bias"], a64["A"], a64["D"],
                                    ngroups, HEADDIM, (0.0, float("inf")), a64["norm_w"], 1e-5, False, a64["out_w"],
                                    a64["out_b"], initial_states=a64["initial_states"])
    ((ref * paddle.to_tensor(to64(grad_out))).sum() + (ref_final * paddle.to_tensor(to64(grad_final))).sum()).backward()
    assert_close("out", out.numpy(), ref.numpy(), "float32")
    assert_close("final_states", final.numpy(), ref_final.numpy(), "float32")
    for name in args:
        assert_close(f"d{name}", args[name].grad.numpy(), a64[name].grad.numpy(), "float32")


def test_checkpoint_levels_give_identical_gradients():
    """Level 0 keeps the conv output, level 1 recomputes it: the same gradients, bit for bit; no
    final states asked for, z-gate without norm, seq_idx restarts."""
    nheads, ngroups, dim = 4, 1, 4 * HEADDIM
    conv_dim = dim + 2 * ngroups * D_STATE
    zxbcdt = randn((1, 6, 2 * dim + 2 * ngroups * D_STATE + nheads))
    conv_w, conv_b = randn((conv_dim, D_CONV), scale=0.5), randn((conv_dim,), scale=0.3)
    dt_bias, A, D = randn((nheads,), scale=0.3), -paddle.exp(randn((nheads,), scale=0.5)), randn((nheads, HEADDIM))
    seq_idx = paddle.to_tensor(np.array([[0, 0, 0, 1, 1, 1]], dtype=np.int32))
    grad_out = randn((1, 6, dim))
    grads = []
    for level in (0, 1):
        leaves = [t.detach() for t in (zxbcdt, conv_w, conv_b, dt_bias, A, D)]
        for t in leaves:
            t.stop_gradient = False
        out = mamba_split_conv1d_scan_combined(*leaves, CHUNK, seq_idx=seq_idx, ngroups=ngroups,
                                               checkpoint_lvl=level)
        (out * grad_out).sum().backward()
        grads.append([t.grad.numpy() for t in leaves])
    for g0, g1 in zip(*grads):
        np.testing.assert_array_equal(g0, g1)


# ----------------------------------------------------------------------------------------------
# the decoding-step kernel (interpreter) in both layouts


def _step64(state, x, dt, A, B, C, D, z, dt_limit):
    """float64 step; every argument already broadcast to [..., p] / [..., p, n] (dt after bias)."""
    dt = np.clip(np.log1p(np.exp(dt)), *dt_limit)
    new = state * np.exp(dt[..., None] * A) + (dt * x)[..., None] * B
    y = (new * C).sum(-1) + D * x
    return new, (y * z / (1 + np.exp(-z)) if z is not None else y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mamba2_state_update_kernel_matches_float64(dtype):
    """The op on the Triton kernel: ngroups 2 of 6 heads, headdim 5, dstate 3, D per row, z, dt_limit."""
    batch, nheads, headdim, dstate, ngroups = 2, 6, 5, 3, 2
    state = randn((batch, nheads, headdim, dstate), dtype)
    state64 = to64(state)
    x, z = randn((batch, nheads, headdim), dtype), randn((batch, nheads, headdim), dtype)
    dt, dt_bias = randn((batch, nheads), dtype), randn((nheads,))
    A = -paddle.exp(randn((nheads,)))
    B, C = randn((batch, ngroups, dstate), dtype), randn((batch, ngroups, dstate), dtype)
    D = randn((nheads, headdim))
    y = mamba2_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_limit=(0.2, 0.8), backend="triton")
    per_head = lambda M: np.repeat(to64(M), nheads // ngroups, axis=1)[:, :, None, :]  # noqa: E731
    dt64 = np.broadcast_to((to64(dt) + to64(dt_bias))[..., None], x.shape)
    new, ref = _step64(state64, to64(x), dt64, to64(A)[:, None, None], per_head(B), per_head(C), to64(D), to64(z),
                       (0.2, 0.8))
    assert_close("state", to64(state), new, dtype)
    assert_close("y", to64(y), ref, dtype)


def test_state_update_launcher_untied_and_mamba1_layouts():
    """The launcher itself: Mamba-2 with A [h, p, n] and dt [b, h, p] (untied), and Mamba-1's
    [b, d, n] state with grouped B/C (dim 10 in 2 groups), D and dt_bias per channel, no z."""
    batch, nheads, headdim, dstate = 2, 3, 4, 5
    state = randn((batch, nheads, headdim, dstate))
    state64 = to64(state)
    x, dt = randn((batch, nheads, headdim)), randn((batch, nheads, headdim))
    A, dt_bias, D = -paddle.exp(randn((nheads, headdim, dstate))), randn((nheads, headdim)), randn((nheads,))
    B, C = randn((batch, 1, dstate)), randn((batch, 1, dstate))
    out = paddle.full([batch, nheads, headdim], float("nan"))
    state_update_launch(*triton_args(state, x, dt, A, B, C, out, D, None, dt_bias), dt_softplus=True)
    new, ref = _step64(state64, to64(x), to64(dt) + to64(dt_bias), to64(A), to64(B)[:, :, None, :],
                       to64(C)[:, :, None, :], to64(D)[:, None], None, (0.0, np.inf))
    assert_close("untied state", to64(state), new, "float32")
    assert_close("untied out", to64(out), ref, "float32")

    dim, groups = 10, 2
    state = randn((batch, dim, dstate))
    state64 = to64(state)
    x, dt = randn((batch, dim)), randn((batch, dim))
    A, dt_bias, D = -paddle.exp(randn((dim, dstate))), randn((dim,)), randn((dim,))
    B, C = randn((batch, groups, dstate)), randn((batch, groups, dstate))
    out = paddle.full([batch, dim], float("nan"))
    state_update_launch(*triton_args(state, x, dt, A, B, C, out, D, None, dt_bias), dt_softplus=True)
    per_dim = lambda M: np.repeat(to64(M), dim // groups, axis=1)  # noqa: E731
    new, ref = _step64(state64, to64(x), to64(dt) + to64(dt_bias), to64(A), per_dim(B), per_dim(C), to64(D), None,
                       (0.0, np.inf))
    assert_close("mamba1 state", to64(state), new, "float32")
    assert_close("mamba1 out", to64(out), ref, "float32")
