"""FusedAdamW on the CPU: the multi-tensor Triton kernel (interpreter) against the numpy reference
(bit for bit with round-to-nearest storage) and a float64 formula; the optimizer against
``paddle.optimizer.AdamW``; stochastic rounding; state-dict round trip; convergence with 16-bit
moments; state memory; bad input."""

import numpy as np
import paddle
import pytest

from paddlenlp_fused.kernels.triton.adamw import (BLOCK, ITERS, adamw_multi_tensor, all_aligned, hyper_rows, hyper_table,
                                                  offsets_table, plan_chunks, step_seed, table_aligned)
from paddlenlp_fused.optimizer.adamw import STEP_KEY, FusedAdamW
from paddlenlp_fused.reference import adamw as adamw_reference
from paddlenlp_fused.reference.adamw import (KernelGroup, _nearest_bits, adamw_multi_tensor_ref, adamw_step_ref,
                                             stochastic_round)
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.runtime import tensor as T
from paddlenlp_fused.testing.numerics import UNIT_ROUNDOFF, assert_close, rel_err
from helpers import randn, to64

# Paddle's CPU AdamW computes lr * sqrt(1 - beta2^t) / (1 - beta1^t) and eps * sqrt(1 - beta2^t)
# (we: -lr / (1 - beta1^t) and 1 / sqrt(1 - beta2^t)); the fp32 roundings differ by a few ulp a step.
PADDLE_ONE_STEP_BOUND = 1e-6
PADDLE_50_STEPS_BOUND = 1e-4
# two chunks (the second: a whole block and a ragged tail), size 1, odd 2-D, tiny
SHAPES = [(BLOCK * ITERS + BLOCK + 3,), (1,), (33, 65), (7,)]


def _mlp(seed=7, with_bf16_gain=False):
    """A tiny fp32 MLP under fixed parameter names (so two instances share state-dict keys); with
    a bf16 gain vector it also has a 16-bit parameter (master weights, a second launch group)."""
    with paddle.utils.unique_name.guard():
        paddle.seed(seed)
        model = paddle.nn.Sequential(paddle.nn.Linear(12, 40), paddle.nn.GELU(), paddle.nn.Linear(40, 3))
        if with_bf16_gain:
            model.gain = paddle.create_parameter([3], "bfloat16",
                                                 default_initializer=paddle.nn.initializer.Constant(1.0))
    return model


def _forward(model, x):
    y = model(x)
    if hasattr(model, "gain"):
        y = y * model.gain.astype("float32")
    return y


def _data(n=96, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 12)).astype(np.float32)
    y = np.tanh(x[:, :3] * 1.5 + x[:, 3:6] * x[:, 6:9]).astype(np.float32)
    return paddle.to_tensor(x), paddle.to_tensor(y)


def _train(model, opt, x, y, steps, scheduler=None):
    losses = []
    for _ in range(steps):
        loss = ((_forward(model, x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss))
    return losses


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _no_decay_for_bias(name):
    return not name.endswith(".b_0")


# --- the optimizer against paddle.optimizer.AdamW -----------------------------------------------------


def test_matches_paddle_adamw_one_and_50_steps():
    """fp32 params and moments, decay excluded for biases, global-norm clipping, a warmup+cosine
    schedule: both backends stay within the stated bounds of Paddle's AdamW and of each other."""
    x, y = _data()

    def run(make_opt, steps):
        model = _mlp()
        sched = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(3e-2, T_max=50), 5, 0.0,
                                                 3e-2)
        opt = make_opt(model, sched)
        _train(model, opt, x, y, steps, sched)
        return [p.numpy().copy() for p in model.parameters()], opt

    common = dict(weight_decay=0.05, apply_decay_param_fun=_no_decay_for_bias,
                  grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
    for steps, bound in ((1, PADDLE_ONE_STEP_BOUND), (50, PADDLE_50_STEPS_BOUND)):
        expected, paddle_opt = run(lambda m, s: paddle.optimizer.AdamW(s, parameters=m.parameters(), **common), steps)
        results = {}
        for backend in ("triton", "reference"):
            results[backend], opt = run(lambda m, s: FusedAdamW(s, parameters=m.parameters(), moment_dtype="float32",
                                                                backend=backend, **common), steps)
            for got, ref in zip(results[backend], expected):
                assert _rel(got, ref) <= bound, f"{backend}, {steps} steps: params off Paddle's AdamW"
            ours, theirs = opt.state_dict(), paddle_opt.state_dict()
            for key in theirs:
                if key.endswith("moment1_0") or key.endswith("moment2_0"):
                    assert _rel(ours[key].numpy(), theirs[key].numpy()) <= bound, key
                elif key.endswith("pow_acc_0"):
                    np.testing.assert_array_equal(ours[key].numpy(), theirs[key].numpy(), err_msg=key)
        for a, b in zip(results["triton"], results["reference"]):
            assert _rel(a, b) <= bound


def test_parameter_groups_match_paddle_and_backends_agree():
    """Groups with their own learning-rate scale, weight decay, betas and epsilon."""
    x, y = _data()

    def run(make_opt):
        model = _mlp()
        first, second = model[0], model[2]
        groups = [{"params": first.parameters(), "learning_rate": 0.5, "beta1": 0.8, "weight_decay": 0.2},
                  {"params": second.parameters(), "beta2": 0.99, "epsilon": 1e-6}]
        _train(model, make_opt(groups), x, y, 10)
        return [p.numpy().copy() for p in model.parameters()]

    expected = run(lambda g: paddle.optimizer.AdamW(1e-2, parameters=g, weight_decay=0.01))
    got = {b: run(lambda g: FusedAdamW(1e-2, parameters=g, weight_decay=0.01, moment_dtype="float32", backend=b))
           for b in ("triton", "reference")}
    for a, b, ref in zip(got["triton"], got["reference"], expected):
        assert _rel(a, b) <= PADDLE_50_STEPS_BOUND
        assert _rel(a, ref) <= PADDLE_50_STEPS_BOUND


def test_lr_ratio_and_found_inf():
    """lr_ratio scales each parameter's rate (Paddle's CPU AdamW lacks it: checked against a run
    with the same rate as a group scale); AMP's found_inf skips the step and keeps the step count."""
    x, y = _data()
    ratio = lambda p: 0.25 if p.name.endswith(".b_0") else 1.0  # noqa: E731
    model_a, model_b = _mlp(), _mlp()
    opt_a = FusedAdamW(1e-2, parameters=model_a.parameters(), lr_ratio=ratio, moment_dtype="float32")
    groups = [{"params": [p], "learning_rate": ratio(p)} for p in model_b.parameters()]
    opt_b = FusedAdamW(1e-2, parameters=groups, moment_dtype="float32")
    _train(model_a, opt_a, x, y, 3)
    _train(model_b, opt_b, x, y, 3)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    before = [p.numpy().copy() for p in model_a.parameters()]
    ((_forward(model_a, x) - y) ** 2).mean().backward()
    opt_a._set_auxiliary_var("found_inf", paddle.to_tensor(True))
    opt_a.step()
    assert opt_a._get_auxiliary_var("found_inf") is True
    assert int(opt_a.state_dict()[STEP_KEY][0]) == 3
    for a, b in zip(before, model_a.parameters()):
        np.testing.assert_array_equal(a, b.numpy())


# --- the kernel against the reference and float64 ------------------------------------------------------


def _group(param_dtype, moment_dtype, master, grad_dtype=None):
    params = [randn(s, param_dtype) for s in SHAPES]
    grads = [randn(s, grad_dtype or param_dtype, scale=0.3) for s in SHAPES]
    exp_avgs = [randn(s, moment_dtype, scale=0.05) for s in SHAPES]
    exp_avg_sqs = [(randn(s, "float32", scale=0.03) ** 2).astype(moment_dtype) for s in SHAPES]
    masters = [p.astype("float32") + randn(p.shape, scale=1e-3) for p in params] if master else None
    return params, grads, exp_avgs, exp_avg_sqs, masters


def _launch(tensors, hyper, seed=step_seed(5, 1), stochastic_rounding=False):
    params, grads, exp_avgs, exp_avg_sqs, masters = tensors
    chunk_tensor, first_chunk = plan_chunks([int(p.size) for p in params])
    offsets = offsets_table(params, grads, exp_avgs, exp_avg_sqs, masters, first_chunk)
    n = len(params)
    flat = triton_args(*params, *grads, *exp_avgs, *exp_avg_sqs, *(masters or []), paddle.to_tensor(chunk_tensor),
                       paddle.to_tensor(offsets), paddle.to_tensor(hyper))
    lists = [list(flat[k * n:(k + 1) * n]) for k in range(4)] + [list(flat[4 * n:5 * n]) if masters else None]
    adamw_multi_tensor(*lists, *flat[-3:], seed=seed, stochastic_rounding=stochastic_rounding)


def _clone(tensors):
    return [None if ts is None else [t.clone() for t in ts] for ts in tensors]


def _hyper_for_step(t):
    lr = np.array([3e-3, 1e-2, 5e-3, 2e-2])
    wd = np.array([0.1, 0.0, 0.05, 0.1])
    b1, b2 = np.array([0.9, 0.9, 0.8, 0.95]), np.array([0.999, 0.99, 0.999, 0.98])
    eps = np.full(4, 1e-8)
    b1p = np.float32(b1) ** t
    b2p = np.float32(b2) ** t
    # the float64 formula on the float32 values the optimizer holds
    exact = tuple(np.float32(a).astype(np.float64) for a in (lr, wd, b1, b2, eps, b1p, b2p))
    return hyper_rows(lr, wd, b1, b2, eps, b1p, b2p), exact


def _adamw64(p, g, m, v, w, lr, wd, b1, b2, eps, b1p, b2p):
    w = (w if w is not None else p) * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return w - lr / (1 - b1p) * m / (np.sqrt(v) / np.sqrt(1 - b2p) + eps), m, v


def test_hyper_table_and_beta_powers():
    """The optimizer's per-step scalars: ``hyper_table`` of per-tensor rows equals ``hyper_rows`` of the
    same columns bit for bit (fresh random values, float64 inputs taken as float32), and after 3 steps
    each beta-pow accumulator is beta^4 as repeated float32 products (Paddle's accumulators)."""
    rng = np.random.default_rng(29)
    n = 13
    columns = [rng.uniform(1e-4, 1e-1, n), rng.choice([0.0, 0.01, 0.1], n), rng.uniform(0.5, 0.99, n),
               rng.uniform(0.9, 0.99999, n), rng.choice([1e-8, 1e-6], n), rng.uniform(0.0, 0.99, n),
               rng.uniform(0.0, 0.999, n)]
    want = hyper_rows(*columns)
    np.testing.assert_array_equal(hyper_table(np.stack(columns, axis=-1)).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(hyper_table(np.stack(columns, axis=-1)[4]).view(np.uint32), want[4].view(np.uint32))
    model = _mlp()
    x, y = _data()
    opt = FusedAdamW(1e-2, beta1=0.85, beta2=0.995, parameters=model.parameters(), backend="reference")
    _train(model, opt, x, y, 3)
    want1, want2 = np.float32(0.85), np.float32(0.995)
    for _ in range(3):
        want1, want2 = want1 * np.float32(0.85), want2 * np.float32(0.995)
    state = opt.state_dict()
    for key, want_pow in (("beta1_pow_acc", want1), ("beta2_pow_acc", want2)):
        got = [v.numpy()[0] for k, v in state.items() if key in k]
        assert got and all(g.view(np.uint32) == want_pow.view(np.uint32) for g in got), (key, got, want_pow)

def _storage_rounding_err(x64, dtype):
    """The relative error of storing the exact float64 result in ``dtype``: more than the unit
    roundoff where float16 values are subnormal (second moments of small gradients, below 6.1e-5)."""
    return rel_err(paddle.to_tensor(x64).astype(dtype).astype("float64").numpy(), x64)


@pytest.mark.parametrize("param_dtype,moment_dtype,master", [
    ("float32", "float32", False), ("float32", "bfloat16", False), ("bfloat16", "bfloat16", True),
    ("bfloat16", "float32", True), ("float16", "float16", True), ("bfloat16", "bfloat16", False),
    ("float16", "bfloat16", False)])
def test_kernel_equals_reference_and_float64(param_dtype, moment_dtype, master):
    """Round-to-nearest storage, 4 tensors of odd sizes in one launch, 3 steps with per-tensor
    hyper-parameters: the kernel equals the reference bit for bit; one step is within DESIGN.md's
    bounds of the float64 formula."""
    ours = _group(param_dtype, moment_dtype, master)
    ref = _clone(ours)
    start = [[to64(t) for t in ts] if ts is not None else None for ts in ours]
    for t in (1, 2, 3):
        hyper, hyper64 = _hyper_for_step(t)
        _launch(ours, hyper)
        for i in range(len(SHAPES)):
            adamw_step_ref(*(ts[i] if ts is not None else None for ts in ref), hyper[i])
        for kind, got, want in zip(("param", "grad", "exp_avg", "exp_avg_sq", "master"), ours, ref):
            for i in range(len(SHAPES)) if got is not None else ():
                np.testing.assert_array_equal(to64(got[i]), to64(want[i]), err_msg=f"{kind}[{i}] step {t}")
        if t == 1:
            for i in range(len(SHAPES)):
                args = [None if ts is None else ts[i] for ts in start]
                w64, m64, v64 = _adamw64(*args, *(h[i] for h in hyper64))
                out_w = ours[4][i] if master else ours[0][i]
                assert_close(f"weight[{i}]", to64(out_w), w64, "float32" if master else param_dtype,
                             baseline_err=_storage_rounding_err(w64, param_dtype))
                assert_close(f"exp_avg[{i}]", to64(ours[2][i]), m64, moment_dtype,
                             baseline_err=_storage_rounding_err(m64, moment_dtype))
                assert_close(f"exp_avg_sq[{i}]", to64(ours[3][i]), v64, moment_dtype,
                             baseline_err=_storage_rounding_err(v64, moment_dtype))


@pytest.mark.parametrize("shift", [0, 1, 8])
def test_alignment_from_the_offsets_table(shift):
    """The per-step alignment check from the table agrees with reading every address, for tensors
    cut ``shift`` elements past 16-byte boundaries; unaligned, the kernel still equals the reference."""
    buffers = [paddle.zeros([4 * 64 + 16], dtype) for dtype in ("bfloat16", "bfloat16", "float32", "float32")]
    views = [[b[shift + 64 * i:shift + 64 * i + 40] for i in range(4)] for b in buffers]
    tensors = (views[0], views[1], views[2], views[3], None)
    offsets = offsets_table(*tensors, plan_chunks([40] * 4)[1])
    assert table_aligned(offsets, *tensors) == all_aligned(*tensors[:4]) == (shift % 8 == 0)
    for t in views[0] + views[1]:
        paddle.assign(randn([40], "bfloat16"), output=t)
    ref = _clone(tensors)
    hyper = np.repeat(hyper_rows(1e-2, 0.1, 0.9, 0.999, 1e-8, 0.9, 0.999), 4, axis=0)
    _launch(tensors, hyper)
    for i in range(4):
        adamw_step_ref(*(ts[i] if ts is not None else None for ts in ref), hyper[i])
        for got, want in zip(tensors[:4], ref[:4]):
            np.testing.assert_array_equal(to64(got[i]), to64(want[i]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_is_unbiased(dtype):
    """Kernel and reference: every moment (and the master-less param) lands on one of the two
    representable neighbours of the fp32 value, both occur, the mean is the fp32 value within 5
    standard errors; the kernel's draw is a function of the seed."""
    n = 2 * BLOCK
    x_true = 1 / 3  # m after one step from 0 with g = x_true / (1 - beta1): not representable
    g = paddle.full([n], x_true / 0.1, dtype="float32")

    def fresh():
        return ([paddle.full([n], 0.7, dtype=dtype)], [g.astype(dtype)], [paddle.zeros([n], dtype)],
                [paddle.zeros([n], dtype)], None)

    hyper = hyper_rows(1e-3, 0.0, 0.9, 0.999, 1e-8, 0.9, 0.999)
    outs = []
    for seed in (step_seed(1, 1), step_seed(1, 1), step_seed(2, 1)):
        tensors = fresh()
        _launch(tensors, hyper, seed=seed, stochastic_rounding=True)
        outs.append(tensors)
    np.testing.assert_array_equal(to64(outs[0][2][0]), to64(outs[1][2][0]))
    assert not np.array_equal(to64(outs[0][2][0]), to64(outs[2][2][0]))

    ref = fresh()
    adamw_step_ref(*(t[0] if t is not None else None for t in ref), hyper[0], stochastic_rounding=True,
                   random_key=(1, 1))
    g_used = to64(fresh()[1][0])[0]
    m32 = np.float32(np.float32(0.1) * np.float32(g_used))
    v32 = np.float32(np.float32(np.float32(0.001) * np.float32(g_used)) * np.float32(g_used))
    for tensors, who in ((outs[0], "kernel"), (ref, "reference")):
        for name, got, exact in (("exp_avg", tensors[2][0], m32), ("exp_avg_sq", tensors[3][0], v32)):
            values = to64(got)
            lo, hi = np.unique(values)
            assert lo < exact < hi, f"{who} {name}: {lo}, {hi} do not bracket {exact}"
            spread = (hi - lo) / 2 / np.sqrt(n)
            assert abs(values.mean() - exact) < 5 * spread, f"{who} {name}: mean {values.mean()} vs {exact}"
        assert len(np.unique(to64(tensors[0][0]))) == 2, f"{who}: master-less param not rounded stochastically"


def test_reference_stochastic_round_edges():
    x = paddle.to_tensor(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, 3.4e38, -1e-40], np.float32))
    r = paddle.to_tensor(np.full([8], 65535, np.int32))
    out = stochastic_round(x, "bfloat16", r).astype("float32").numpy()
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2])
    np.testing.assert_array_equal(out[3:6], [0.0, 0.0, 1.0])
    assert np.isfinite(out[6]) and out[7] <= 0



def test_reference_nearest_bfloat16_matches_its_definition():
    """The reference's round-to-nearest-even to bfloat16 (16-bit params from fp32 masters, moments
    without stochastic rounding) against the rule on the bit patterns in int64: up when the dropped
    16 bits exceed half an ulp, or equal it and the kept part is odd; NaN to 0x7FC0. Random values,
    exact ties both ways, the largest finite values (rounding to inf), inf, subnormals, zeros."""
    rng = np.random.default_rng(17)
    x = (rng.uniform(-1, 1, 30001) * np.exp(rng.uniform(np.log(1e-40), np.log(3e38), 30001))).astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x7F7F8000, 0x7F7EFFFF, 0x7F7FFFFF,
                     0x00008000, 0x00018000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x7FC00001,
                     0xFFFFFFFF], np.uint32).view(np.float32)
    x = np.concatenate([x, ties])
    bits = x.view(np.uint32).astype(np.int64)
    kept, dropped = bits >> 16, bits & 0xFFFF
    want = kept + ((dropped > 0x8000) | ((dropped == 0x8000) & (kept & 1 == 1)))
    want = np.where(np.isnan(x), 0x7FC0, want)
    np.testing.assert_array_equal(_nearest_bits(x, "bfloat16").astype(np.int64), want)

def _stochastic_round64(x, dtype, r16):
    """The reference's stochastic rounding from its definition, in float64: the representable
    neighbours lo (nearer zero) and hi of float32 ``x``; hi when r16 / 2^16 * |hi - lo| < |x - lo|."""
    if dtype == "bfloat16":
        lo = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        hi = (lo.view(np.uint32) + np.uint32(0x10000)).view(np.float32)
    else:
        with np.errstate(over="ignore"):
            nearest = x.astype(np.float16)
            lo = np.where(np.abs(nearest.astype(np.float32)) > np.abs(x), np.nextafter(nearest, np.float16(0)), nearest)
            hi = np.nextafter(lo, np.where(x < 0, np.float16(-np.inf), np.float16(np.inf)))
    lo, hi, x64 = lo.astype(np.float64), hi.astype(np.float64), x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(r16 / 65536.0 * np.abs(hi - lo) < np.abs(x64 - lo), hi, lo)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reference_stochastic_round_matches_its_definition(dtype):
    """Random float32 values over the 16-bit range plus the edges (largest finite, between it and
    inf, inf, subnormal, zero, values already representable) with random bits: equal to the
    float64 definition (bfloat16 is computed on the bit patterns, float16 in float32)."""
    rng = np.random.default_rng(11)
    top = 3.3e38 if dtype == "bfloat16" else 65000.0
    edges = [np.finfo(np.float32).max, 3.39e38, 3.3895e38, 65504.0, 65519.0, 65520.0, 1e-40, 6e-8, 3e-8, 1.0,
             0.0, np.inf]
    x = np.concatenate([rng.uniform(-1, 1, 20000) * np.exp(rng.uniform(np.log(1e-9), np.log(top), 20000)),
                        edges, np.negative(edges)]).astype(np.float32)
    for r in (rng.integers(0, 1 << 16, x.size), np.zeros(x.size, np.int64), np.full(x.size, 65535)):
        got = stochastic_round(paddle.to_tensor(x), dtype, paddle.to_tensor(r.astype(np.int32)))
        want = _stochastic_round64(x, dtype, r)
        np.testing.assert_array_equal(got.astype("float32").numpy().astype(np.float64), want)
    nan = stochastic_round(paddle.to_tensor(np.full([4], np.nan, np.float32)), dtype, paddle.zeros([4], "int32"))
    assert np.isnan(nan.astype("float32").numpy()).all()


@pytest.mark.parametrize("sizes", [[100003], [5, 40000, 0, 3, 70001, 1]])
def test_reference_random_bits_continue_across_blocks_and_tensors(sizes):
    """bf16 moments rounded stochastically on one tensor or a group spanning several of the
    reference's blocks: the random values are numpy SFC64's 64-bit outputs seeded by random_key +
    (output,), each cut into four uint16 (lowest first), over the group's elements in order, so the
    stored moments equal the definition applied to those draws."""
    n = sum(sizes)
    g32 = (np.random.default_rng(5).standard_normal(n) * 0.3).astype(np.float32)
    grads = [paddle.to_tensor(part) for part in np.split(g32, np.cumsum(sizes)[:-1])]
    tensors = ([paddle.ones([s]) for s in sizes], grads, [paddle.zeros([s], "bfloat16") for s in sizes],
               [paddle.zeros([s], "bfloat16") for s in sizes], None)
    hyper = hyper_rows(1e-3, 0.0, 0.9, 0.999, 1e-8, 0.9, 0.999)
    adamw_multi_tensor_ref(*tensors, np.repeat(hyper, len(sizes), axis=0), stochastic_rounding=True,
                           random_key=(4, 2, 9))
    m32 = g32 * np.float32(hyper[0, 1])  # from zero moments: one product each
    v32 = g32 * np.float32(hyper[0, 3]) * g32
    for k, (got, exact) in enumerate(((tensors[2], m32), (tensors[3], v32))):
        raw = np.random.SFC64(np.random.SeedSequence([4, 2, 9, k])).random_raw((n + 3) // 4)
        draws = raw.astype("<u8").view("<u2")[:n].astype(np.int64)
        stored = np.concatenate([to64(t) for t in got])
        np.testing.assert_array_equal(stored, _stochastic_round64(exact, "bfloat16", draws), err_msg=f"moment {k}")


# tensors that cross the reference's blocks (1 << 15 elements), tiny ones, an empty one
GROUP_SHAPES = [(3, 7), (20000,), (1,), (0,), (50001,), (129, 33), (5,)]


@pytest.mark.parametrize("param_dtype,moment_dtype,master", [
    ("float32", "float32", False), ("float32", "bfloat16", False), ("bfloat16", "bfloat16", True),
    ("float16", "float16", True), ("bfloat16", "bfloat16", False), ("float16", "float32", False)])
def test_reference_group_equals_per_tensor(param_dtype, moment_dtype, master):
    """Round-to-nearest storage: one adamw_multi_tensor_ref call over a group (per-tensor
    hyper-parameters that differ in some blocks and agree in others, a transposed grad) updates
    every tensor bit for bit as adamw_step_ref on each tensor alone, over 2 steps."""
    n = len(GROUP_SHAPES)
    params = [randn(s, param_dtype) for s in GROUP_SHAPES]
    grads = [randn(s[::-1], param_dtype, scale=0.3).t() if len(s) == 2 else randn(s, param_dtype, scale=0.3)
             for s in GROUP_SHAPES]
    assert not grads[0].is_contiguous()
    exp_avgs = [randn(s, moment_dtype, scale=0.05) for s in GROUP_SHAPES]
    exp_avg_sqs = [(randn(s, "float32", scale=0.03) ** 2).astype(moment_dtype) for s in GROUP_SHAPES]
    masters = [p.astype("float32") + randn(p.shape, scale=1e-3) for p in params] if master else None
    group = [params, grads, exp_avgs, exp_avg_sqs, masters]
    alone = _clone(group)
    for t in (1, 2):
        lr = np.array([3e-3, 1e-2, 1e-2, 1e-2, 1e-2, 5e-3, 2e-2])
        wd = np.array([0.1, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1])
        hyper = hyper_rows(lr, wd, 0.9, 0.999, 1e-8, np.float32(0.9) ** t, np.float32(0.999) ** t)
        adamw_multi_tensor_ref(*group, hyper)
        for i in range(n):
            adamw_step_ref(*(ts[i] if ts is not None else None for ts in alone), hyper[i])
        for kind, got, want in zip(("param", "grad", "exp_avg", "exp_avg_sq", "master"), group, alone):
            for i in range(n) if got is not None else ():
                np.testing.assert_array_equal(to64(got[i]), to64(want[i]), err_msg=f"{kind}[{i}] step {t}")


def test_reference_group_bad_input():
    ones = lambda n, dtype="float32": [paddle.ones([n], dtype) for _ in range(2)]  # noqa: E731
    hyper = np.repeat(hyper_rows(1e-3, 0.0, 0.9, 0.999, 1e-8, 0.9, 0.999), 2, axis=0)
    with pytest.raises(ValueError, match="expected 2 tensors in every list"):
        adamw_multi_tensor_ref(ones(3), ones(3)[:1], ones(3), ones(3), None, hyper)
    with pytest.raises(ValueError, match=r"hyper: expected shape \[2, 8\]"):
        adamw_multi_tensor_ref(ones(3), ones(3), ones(3), ones(3), None, hyper[:1])
    with pytest.raises(ValueError, match="params must share one dtype"):
        adamw_multi_tensor_ref([paddle.ones([3]), paddle.ones([3], "bfloat16")], ones(3), ones(3), ones(3), None, hyper)
    with pytest.raises(ValueError, match="exp_avgs must have the params' numbers of elements"):
        adamw_multi_tensor_ref(ones(3), ones(3), [paddle.ones([3]), paddle.ones([4])], ones(3), None, hyper)
    with pytest.raises(ValueError, match="exp_avg_sqs must be contiguous"):
        adamw_multi_tensor_ref(ones(4), ones(4), ones(4), [paddle.ones([2, 2]).t()] * 2, None, hyper)


@pytest.mark.parametrize("scratch", [1 << 20, 4096], ids=["one chunk", "chunks across tensors"])
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16", "float16"])
def test_kernel_group_matches_float64(moment_dtype, scratch, monkeypatch):
    """KernelGroup (float32 params and grads on Paddle's AdamW kernel): per-tensor learning rates,
    decays, betas and beta powers (so several kernel calls a step), a transposed grad, an empty
    tensor, 16-bit moments widened through scratch of ``scratch`` elements (so chunks that cut
    tensors); each of 3 steps from the stored state within DESIGN's bounds of the float64 formula,
    the moments' with the baseline of storing the exact value in their dtype."""
    monkeypatch.setattr(adamw_reference, "_SCRATCH", scratch)
    n = len(GROUP_SHAPES)
    params = [randn(s) for s in GROUP_SHAPES]
    grads = [randn(s[::-1], scale=0.3).t() if len(s) == 2 else randn(s, scale=0.3) for s in GROUP_SHAPES]
    exp_avgs = [randn(s, moment_dtype, scale=0.05) for s in GROUP_SHAPES]
    exp_avg_sqs = [(randn(s, "float32", scale=0.03) ** 2).astype(moment_dtype) for s in GROUP_SHAPES]
    group = KernelGroup(params, exp_avgs, exp_avg_sqs)
    lr = np.array([3e-3, 1e-2, 1e-2, 1e-2, 1e-2, 5e-3, 2e-2])
    wd = np.array([0.1, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1])
    b1, b2 = np.array([0.9, 0.9, 0.9, 0.8, 0.9, 0.9, 0.95]), np.array([0.999, 0.999, 0.99, 0.999, 0.999, 0.98, 0.999])
    for t in (1, 2, 3):
        start = [[to64(x) for x in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
        pows = np.float32(b1) ** (t + np.arange(n) % 2), np.float32(b2) ** (t + np.arange(n) % 2)
        table = np.stack([lr, wd, b1, b2, np.full(n, 1e-8), *pows], axis=-1).astype(np.float32)
        group.step(grads, table)
        for i in range(n):
            if not params[i].size:
                continue
            exact = (np.float64(v) for v in table[i])
            w64, m64, v64 = _adamw64(*(ts[i] for ts in start), None, *exact)
            assert_close(f"param[{i}] step {t}", to64(params[i]), w64, "float32")
            assert_close(f"exp_avg[{i}] step {t}", to64(exp_avgs[i]), m64, moment_dtype,
                         baseline_err=_storage_rounding_err(m64, moment_dtype))
            assert_close(f"exp_avg_sq[{i}] step {t}", to64(exp_avg_sqs[i]), v64, moment_dtype,
                         baseline_err=_storage_rounding_err(v64, moment_dtype))
        grads = [randn(g.shape, scale=0.3) for g in grads]


@pytest.mark.parametrize("scratch", [1 << 20, 4096], ids=["one chunk", "chunks across tensors"])
def test_kernel_group_stochastic_rounding_is_unbiased(scratch, monkeypatch):
    """bf16 moments rounded stochastically on the kernel path: every moment lands on one of the two
    bf16 neighbours of the float32 value Paddle's kernel computes, both occur, and the mean is that
    value within 5 standard errors; over tensors that chunks of ``scratch`` elements cut."""
    monkeypatch.setattr(adamw_reference, "_SCRATCH", scratch)
    sizes = [3000, 7001, 5]
    x_true = 1 / 3  # m after one step from 0 with g = x_true / (1 - beta1): not representable
    grads = [paddle.full([n], x_true / 0.1, dtype="float32") for n in sizes]
    params = [paddle.full([n], 0.7, dtype="float32") for n in sizes]
    moments = [[paddle.zeros([n], "bfloat16") for n in sizes] for _ in range(2)]
    table = np.tile(np.array([[1e-3, 0.0, 0.9, 0.999, 1e-8, 0.9, 0.999]], np.float32), (len(sizes), 1))
    KernelGroup(params, *moments).step(grads, table, stochastic_rounding=True, random_key=(7, 1, 0))
    g = np.float32(x_true / 0.1)
    m32 = (np.float32(1) - np.float32(0.9)) * g  # Paddle's kernel: (1 - beta1) g, (1 - beta2) g g
    v32 = (np.float32(1) - np.float32(0.999)) * g * g
    for name, got, exact in (("exp_avg", moments[0], m32), ("exp_avg_sq", moments[1], v32)):
        values = np.concatenate([to64(t) for t in got])
        lo, hi = np.unique(values)
        assert lo < exact < hi, f"{name}: {lo}, {hi} do not bracket {exact}"
        assert abs(values.mean() - exact) < 5 * (hi - lo) / 2 / np.sqrt(values.size), f"{name}: mean {values.mean()}"


def test_kernel_group_stochastic_rounding_follows_the_key():
    """bf16 moments rounded stochastically on the kernel path: the same random key gives the same
    moments bit for bit, another key other ones; a NaN gradient reaches the parameter."""
    shapes = [(40, 33), (5000,), (1,)]
    start = [(randn(s), randn(s, scale=0.3)) for s in shapes]

    def run(key, poison=False):
        params, grads = [p.clone() for p, _ in start], [g.clone() for _, g in start]
        if poison:
            grads[1][7] = float("nan")
        moments = [[paddle.zeros(s, "bfloat16") for s in shapes] for _ in range(2)]
        table = np.tile(np.array([[1e-3, 0.01, 0.9, 0.999, 1e-8, 0.9, 0.999]], np.float32), (len(shapes), 1))
        KernelGroup(params, *moments).step(grads, table, stochastic_rounding=True, random_key=key)
        return [to64(t) for t in params + moments[0] + moments[1]]

    first, again, other = run((3, 1, 0)), run((3, 1, 0)), run((3, 2, 0))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first[3:], other[3:]))
    assert np.isnan(run((3, 1, 0), poison=True)[1][7])


def _assert_backends_agree(got, want):
    """(name, dtype, values) lists of the reference path and the Triton kernel, round-to-nearest:
    float32 groups go through Paddle's AdamW kernel on the reference path, whose roundings differ
    from the kernel's, so float32 values agree within DESIGN's float32 bound and 16-bit values within
    their dtype's (a float32 difference can flip a rounding); the numpy groups (16-bit parameters)
    agree bit for bit either way."""
    assert [(n, d) for n, d, _ in got] == [(n, d) for n, d, _ in want]
    for (name, dtype, a), (_, _, b) in zip(got, want):
        assert rel_err(a, b) <= (1e-5 if dtype == "float32" else 2 * UNIT_ROUNDOFF[dtype]), name


def _mixed_model():
    """fp32 Linear layers, a bf16 and an fp16 gain (two more dtype groups), a frozen parameter and
    one that gets no gradient, under fixed names."""
    with paddle.utils.unique_name.guard():
        paddle.seed(11)
        model = paddle.nn.Sequential(paddle.nn.Linear(12, 40), paddle.nn.GELU(), paddle.nn.Linear(40, 3))
        for name, dtype in (("gain_bf16", "bfloat16"), ("gain_fp16", "float16"), ("frozen", "float32"),
                            ("unused", "float32")):
            setattr(model, name, paddle.create_parameter([3], dtype,
                                                         default_initializer=paddle.nn.initializer.Constant(1.0)))
        model.frozen.stop_gradient = True
    return model


def _mixed_forward(model, x):
    return model(x) * model.gain_bf16.astype("float32") * model.gain_fp16.astype("float32") * model.frozen


@pytest.mark.parametrize("moment_dtype", ["bfloat16", "float32"])
def test_reference_optimizer_equals_kernel_on_groups(moment_dtype):
    """The optimizer's reference path (one call per dtype group) against the Triton kernel in the
    interpreter, round-to-nearest: parameter groups with their own rates and betas, decay kept off the
    biases, fp32 / bf16 (master weights) / fp16 parameters, a frozen parameter and one without a
    gradient: agreeing over 3 steps (``_assert_backends_agree``), the frozen and unused ones untouched."""
    x, y = _data()
    results = {}
    for backend in ("triton", "reference"):
        model = _mixed_model()
        groups = [{"params": model[0].parameters() + [model.gain_fp16], "learning_rate": 0.5, "beta1": 0.8},
                  {"params": model[2].parameters() + [model.gain_bf16, model.frozen, model.unused], "beta2": 0.99}]
        opt = FusedAdamW(1e-2, parameters=groups, weight_decay=0.1, apply_decay_param_fun=_no_decay_for_bias,
                         moment_dtype=moment_dtype, stochastic_rounding=False, backend=backend)
        for _ in range(3):
            ((_mixed_forward(model, x) - y) ** 2).mean().backward()
            opt.step()
            opt.clear_grad()
        state = opt.state_dict()
        tensors = [(p.name, p) for p in model.parameters()] + sorted(
            (k, v) for k, v in state.items() if isinstance(v, paddle.Tensor) and k != STEP_KEY) + sorted(
            state["master_weights"].items())
        results[backend] = [(name, T.dtype_name(t), to64(t)) for name, t in tensors]
        np.testing.assert_array_equal(to64(model.frozen), np.ones(3))
        np.testing.assert_array_equal(to64(model.unused), np.ones(3))
        state_keys = [k for k, v in state.items() if isinstance(v, paddle.Tensor)]
        assert not any(model.unused.name in k or model.frozen.name in k for k in state_keys)
    _assert_backends_agree(results["reference"], results["triton"])


def test_reference_optimizer_follows_changing_groups():
    """The reference path keeps each dtype group's checked tensors and numpy views from step to step.
    A step where one parameter has no gradient (the group's members change) and one after a
    parameter's memory moved (``_share_buffer_to``) update every tensor as the Triton kernel does
    (round-to-nearest, ``_assert_backends_agree``): fp32, bf16 and fp16 parameters (master weights),
    odd sizes and tensors across the reference's blocks of 2^15 elements."""
    rng = np.random.default_rng(23)
    specs = [((3, 7), "float32"), ((40001,), "float32"), ((129, 333), "bfloat16"), ((5,), "float16"),
             ((1,), "float32"), ((33000,), "bfloat16"), ((70,), "float16")]
    values = [rng.standard_normal(shape).astype(np.float32) for shape, _ in specs]
    coefs = [[rng.standard_normal(shape).astype(np.float32) for shape, _ in specs] for _ in range(4)]
    results = {}
    for backend in ("triton", "reference"):
        with paddle.utils.unique_name.guard():  # the same names (state-dict keys) in both runs
            params = [paddle.create_parameter(list(shape), dtype, default_initializer=paddle.nn.initializer.Constant(0.0))
                      for shape, dtype in specs]
        for param, value in zip(params, values):
            param.set_value(paddle.to_tensor(value).astype(param.dtype))
        opt = FusedAdamW(1e-2, parameters=params, weight_decay=0.1, moment_dtype="bfloat16",
                         stochastic_rounding=False, backend=backend)
        for step in range(4):
            if step == 3:  # params[2] now lives in new memory, its values unchanged
                params[2].detach().clone()._share_buffer_to(params[2])
            left_out = 1 if step == 2 else None  # no gradient for params[1] in this step
            loss = sum((param.astype("float32") * paddle.to_tensor(coef)).sum()
                       for i, (param, coef) in enumerate(zip(params, coefs[step])) if i != left_out)
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
        state = opt.state_dict()
        tensors = [(p.name, p) for p in params] + [(k, state[k]) for k in sorted(state)
                                                     if isinstance(state[k], paddle.Tensor) and k != STEP_KEY]
        results[backend] = [(name, T.dtype_name(t), to64(t)) for name, t in tensors]
    _assert_backends_agree(results["reference"], results["triton"])

def test_reference_state_dict_round_trip_with_groups(tmp_path):
    """The reference path with stochastic rounding over several dtype groups: save after 3 steps,
    continue 3; a fresh model and optimizer loaded from the files take the same 3 steps bit for bit
    (the random streams are keyed by the saved step and seed)."""
    x, y = _data()

    def make():
        model = _mixed_model()
        return model, FusedAdamW(2e-2, parameters=model.parameters(), weight_decay=0.1, backend="reference")

    def train(model, opt, steps):
        losses = []
        for _ in range(steps):
            loss = ((_mixed_forward(model, x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        return losses

    model, opt = make()
    train(model, opt, 3)
    paddle.save(model.state_dict(), str(tmp_path / "model.pdparams"))
    paddle.save(opt.state_dict(), str(tmp_path / "opt.pdopt"))
    expected_losses = train(model, opt, 3)
    model2, opt2 = make()
    model2.set_state_dict(paddle.load(str(tmp_path / "model.pdparams")))
    opt2.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
    assert train(model2, opt2, 3) == expected_losses
    for a, b in zip(model.parameters(), model2.parameters()):
        np.testing.assert_array_equal(to64(a), to64(b))


# --- state dict, convergence, memory ----------------------------------------------------------------------


def test_state_dict_round_trip_gives_the_same_trajectory(tmp_path):
    """bf16 moments with stochastic rounding, a bf16 parameter with a master weight, a schedule:
    save after 4 steps, continue 4; a fresh model and optimizer loaded from the files take the same
    4 steps bit for bit."""
    x, y = _data()

    def make():
        model = _mlp(with_bf16_gain=True)
        sched = paddle.optimizer.lr.StepDecay(2e-2, step_size=3, gamma=0.5)
        return model, sched, FusedAdamW(sched, parameters=model.parameters(), weight_decay=0.1)

    model, sched, opt = make()
    _train(model, opt, x, y, 4, sched)
    paddle.save(model.state_dict(), str(tmp_path / "model.pdparams"))
    paddle.save(opt.state_dict(), str(tmp_path / "opt.pdopt"))
    assert list(opt.state_dict()["master_weights"]) == [model.gain.name]
    expected_losses = _train(model, opt, x, y, 4, sched)
    expected = [p.numpy().copy() for p in model.parameters()]

    model2, sched2, opt2 = make()
    model2.set_state_dict(paddle.load(str(tmp_path / "model.pdparams")))
    opt2.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
    assert sched2.last_epoch == 4
    assert _train(model2, opt2, x, y, 4, sched2) == expected_losses
    for a, b in zip(expected, model2.parameters()):
        np.testing.assert_array_equal(a, b.numpy())


def test_loads_paddle_adamw_checkpoint():
    """Paddle's AdamW state dict (same key layout) loads; moments are cast to bf16."""
    x, y = _data()
    model = _mlp()
    with paddle.utils.unique_name.guard():  # accumulator names as in a fresh process (suffix _0)
        paddle_opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        _train(model, paddle_opt, x, y, 2)  # the first step creates the accumulators
    opt = FusedAdamW(1e-2, parameters=model.parameters())
    opt.set_state_dict(paddle_opt.state_dict())
    ours = opt.state_dict()
    for key, value in paddle_opt.state_dict().items():
        assert _rel(ours[key].astype("float32").numpy(), value.numpy()) <= 2**-8, key


def _scheduled(lr=2e-2):
    return paddle.optimizer.lr.StepDecay(lr, step_size=2, gamma=0.5)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("direction", ["ours_to_paddle", "paddle_to_ours"])
def test_checkpoints_move_both_ways_with_paddle_adamw(direction, amsgrad):
    """3 steps with one optimizer and a schedule, its state dict into the other (ours: bfloat16
    moments, exported as float32 by default), 3 more steps: the same as 3 more steps of the
    first kind loaded from the same state dict (ours with float32 moments, so that only the
    arithmetic differs), schedule included."""
    x, y = _data()
    # beta2 small enough that the second moment falls, so AMSGrad's maximum matters
    fused = lambda m, s, dtype: FusedAdamW(s, parameters=m.parameters(), beta2=0.6, moment_dtype=dtype,  # noqa: E731
                                           stochastic_rounding=False, amsgrad=amsgrad, backend="reference")
    plain = lambda m, s: paddle.optimizer.AdamW(s, parameters=m.parameters(), beta2=0.6,  # noqa: E731
                                                amsgrad=amsgrad)
    model, sched = _mlp(), _scheduled()
    with paddle.utils.unique_name.guard():  # Paddle's accumulator names as in a fresh process (suffix _0)
        first = fused(model, sched, "bfloat16") if direction == "ours_to_paddle" else plain(model, sched)
        _train(model, first, x, y, 3, sched)
    state = first.state_dict()
    saved = [p.numpy().copy() for p in model.parameters()]
    assert all(v.dtype == paddle.float32 for k, v in state.items() if "moment" in k)
    assert any(k.endswith("moment2_max_0") for k in state) == amsgrad

    def resume(make):
        resumed = _mlp()
        for p, v in zip(resumed.parameters(), saved):
            p.set_value(v)
        sched = _scheduled()
        with paddle.utils.unique_name.guard():
            opt = make(resumed, sched)
            opt.set_state_dict({k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()})
            assert sched.last_epoch == 3
            _train(resumed, opt, x, y, 3, sched)
        return [p.numpy() for p in resumed.parameters()], opt

    theirs, paddle_opt = resume(plain)
    ours, fused_opt = resume(lambda m, s: fused(m, s, "float32"))
    for a, b in zip(ours, theirs):
        assert _rel(a, b) <= PADDLE_50_STEPS_BOUND
    for key, value in paddle_opt.state_dict().items():
        if "moment" in key:
            assert _rel(fused_opt.state_dict()[key].numpy(), value.numpy()) <= PADDLE_50_STEPS_BOUND, key


def test_bf16_moments_with_a_master_weight_load_into_paddle_adamw():
    """The issue's case: bfloat16 moments and a bfloat16 parameter with a float32 master weight
    load into Paddle's AdamW (which asserted float32 moments), values exact; with
    checkpoint_moment_dtype=None the checkpoint keeps bfloat16 moments and reloads into ours."""
    x, y = _data()
    model = _mlp(with_bf16_gain=True)
    opt = FusedAdamW(1e-2, parameters=model.parameters())
    _train(model, opt, x, y, 2)
    state = opt.state_dict()
    with paddle.utils.unique_name.guard():  # Paddle's accumulator names as in a fresh process (suffix _0)
        paddle_opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), multi_precision=True)
        paddle_opt.set_state_dict(dict(state, master_weights=dict(state["master_weights"])))
        # Paddle's CPU AdamW kernel has no bf16 variant; its accumulators are created as step() does
        paddle_opt._create_accumulators(paddle.static.default_main_program().global_block(), model.parameters())
    theirs = paddle_opt.state_dict()
    for key, value in state.items():
        if "moment" in key or "pow_acc" in key:
            np.testing.assert_array_equal(theirs[key].numpy(), value.numpy(), err_msg=key)
    np.testing.assert_array_equal(theirs["master_weights"][model.gain.name].numpy(),
                                  state["master_weights"][model.gain.name].numpy())

    compact = FusedAdamW(1e-2, parameters=model.parameters(), checkpoint_moment_dtype=None)
    compact.set_state_dict(state)
    kept = compact.state_dict()
    for key, value in state.items():
        if "moment" in key:
            assert kept[key].dtype == paddle.bfloat16
            np.testing.assert_array_equal(kept[key].astype("float32").numpy(), value.numpy(), err_msg=key)


def test_amsgrad_keeps_the_running_maximum():
    """AMSGrad on bfloat16 moments (round to nearest): after every step the stored maximum is the
    maximum of the previous one and the stored second moment (also of a bfloat16 parameter's master
    weight); the kernel path says it lacks it."""
    x, y = _data()
    model = _mlp(with_bf16_gain=True)
    opt = FusedAdamW(1e-2, parameters=model.parameters(), beta2=0.6, amsgrad=True, stochastic_rounding=False,
                     backend="reference")
    previous = None
    for _ in range(6):
        _train(model, opt, x, y, 1)
        now = {k: v.astype("float32").numpy() for k, v in opt.state_dict().items() if "moment2" in k}
        for key in (k for k in now if k.endswith("moment2_0")):
            v, v_max = now[key], now[key.replace("moment2_0", "moment2_max_0")]
            expected = v if previous is None else np.maximum(previous[key.replace("moment2_0", "moment2_max_0")], v)
            np.testing.assert_array_equal(v_max, expected)
        previous = now
    assert any((previous[k] > previous[k.replace("_max", "")]).any() for k in previous if "max" in k)
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        FusedAdamW(parameters=model.parameters(), amsgrad=True, backend="triton")
    kernel_path = FusedAdamW(parameters=model.parameters(), amsgrad=True)  # auto: the interpreter's kernel
    ((_forward(model, x) - y) ** 2).mean().backward()
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        kernel_path.step()


def test_tiny_model_200_steps_with_bf16_moments_reaches_paddle_loss():
    """bf16 moments, stochastic rounding, Triton kernel (interpreter): the mean loss of the last 10
    of 200 steps is within 1% of paddle.optimizer.AdamW's (fp32 moments)."""
    x, y = _data(n=128)
    final, first = {}, {}
    for name in ("paddle", "fused"):
        model = _mlp()
        params = model.parameters()
        opt = paddle.optimizer.AdamW(5e-3, parameters=params) if name == "paddle" else \
            FusedAdamW(5e-3, parameters=params, moment_dtype="bfloat16", stochastic_rounding=True)
        losses = _train(model, opt, x, y, 200)
        first[name], final[name] = losses[0], float(np.mean(losses[-10:]))
    print(f"loss: start {first}, mean of the last 10 steps {final}")
    assert first["paddle"] == first["fused"] and final["paddle"] < 0.2 * first["paddle"]  # it did train
    assert abs(final["fused"] - final["paddle"]) <= 0.01 * final["paddle"], final


def _state_bytes(state_dict):
    total = 0
    for key, value in state_dict.items():
        if isinstance(value, dict):
            total += _state_bytes(value)
        elif isinstance(value, paddle.Tensor) and key != STEP_KEY:
            total += value.size * value.element_size()
    return total


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_state_bytes_against_paddle_adamw(param_dtype):
    """Measured from the state dicts (moments as kept, checkpoint_moment_dtype=None): moments take
    half of Paddle's bytes. fp32 params: all state is moments, so the total is half too; bf16
    params with multi_precision: both keep a 4-byte master, so the total is 8 / 12 of Paddle's."""
    layer = paddle.nn.Linear(256, 64)
    layer.to(dtype=param_dtype)
    params = layer.parameters()
    paddle_opt = paddle.optimizer.AdamW(parameters=params, multi_precision=True)
    # Paddle's CPU AdamW kernel has no bf16 variant; its accumulators are created the way step() does
    paddle_opt._create_accumulators(paddle.static.default_main_program().global_block(), params)
    opt = FusedAdamW(parameters=params, multi_precision=True, checkpoint_moment_dtype=None)  # moments as kept
    ((layer(randn((4, 256)).astype(param_dtype)) if param_dtype == "float32" else
      sum((p.astype("float32") ** 2).sum() for p in params))).sum().backward()
    opt.step()
    ours, theirs = opt.state_dict(), paddle_opt.state_dict()
    moments = lambda sd: _state_bytes({k: v for k, v in sd.items() if "moment" in k})  # noqa: E731
    n = sum(p.size for p in params)
    assert moments(theirs) == 8 * n and moments(ours) == 4 * n
    ratio = _state_bytes(ours) / _state_bytes(theirs)
    expected = 0.5 if param_dtype == "float32" else 8 / 12
    assert abs(ratio - expected) < 1e-3, (ratio, _state_bytes(ours), _state_bytes(theirs))


# --- bad input --------------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    params = paddle.nn.Linear(3, 2).parameters()
    with pytest.raises(ValueError, match="moment_dtype"):
        FusedAdamW(parameters=params, moment_dtype="int8")
    with pytest.raises(ValueError, match="beta1"):
        FusedAdamW(parameters=params, beta1=1.0)
    with pytest.raises(ValueError, match="beta2"):
        FusedAdamW(parameters=params, beta2=-0.1)
    with pytest.raises(ValueError, match="epsilon"):
        FusedAdamW(parameters=params, epsilon=-1e-8)
    with pytest.raises(TypeError, match="learning_rate"):
        FusedAdamW("0.1", parameters=params)
    with pytest.raises(ValueError, match="parameters"):
        FusedAdamW(1e-3)
    with pytest.raises(ValueError, match="backend"):
        FusedAdamW(parameters=params, backend="tpu")
    # a known backend it lacks: the error every op raises for that, at construction
    with pytest.raises(BackendUnavailableError, match="FusedAdamW: no 'cuda' implementation"):
        FusedAdamW(parameters=params, backend="cuda")
    with pytest.raises(ValueError, match="checkpoint_moment_dtype"):
        FusedAdamW(parameters=params, checkpoint_moment_dtype="int8")
    with pytest.raises(TypeError, match="amsgrad"):
        FusedAdamW(parameters=params, amsgrad="yes")
    with pytest.raises(TypeError, match="apply_decay_param_fun"):
        FusedAdamW(parameters=params, apply_decay_param_fun=3)
    with pytest.raises(ValueError, match="unknown parameter-group options"):
        FusedAdamW(parameters=[{"params": params, "momentum": 0.9}])
    with pytest.raises(ValueError, match=r"parameters\[0\] beta1"):
        FusedAdamW(parameters=[{"params": params, "beta1": 2.0}])
    with pytest.raises(ValueError, match="more than one parameter group"):
        FusedAdamW(parameters=[{"params": params}, {"params": params[:1]}])
    with pytest.raises(TypeError, match="parameters: expected dtypes"):
        FusedAdamW(parameters=[paddle.create_parameter([2], "float64")])
    opt = FusedAdamW(parameters=params)
    with pytest.raises(ValueError, match="match no parameter"):
        opt.set_state_dict({"other_0.w_0_moment1_0": paddle.zeros([3, 2])})
    with pytest.raises(ValueError, match="expected shape"):
        key = f"{params[0].name}_moment%d_0"
        opt.set_state_dict({key % 1: paddle.zeros([2, 2]), key % 2: paddle.zeros([2, 2]),
                            f"{params[0].name}_beta1_pow_acc_0": paddle.ones([1]),
                            f"{params[0].name}_beta2_pow_acc_0": paddle.ones([1])})

    tensors = _group("float32", "float32", False)
    with pytest.raises(ValueError, match="grads: expected 4 tensors"):
        offsets_table(tensors[0], tensors[1][:3], *tensors[2:], np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="params: expected dtype"):
        _launch(([paddle.ones([3], "int32")], [paddle.ones([3])], [paddle.ones([3])], [paddle.ones([3])], None),
                hyper_rows(1e-3, 0, 0.9, 0.999, 1e-8, 0.9, 0.999))
    with pytest.raises(ValueError, match=r"exp_avgs\[0\]: expected 6 elements"):
        _launch(([paddle.ones([6])], [paddle.ones([6])], [paddle.ones([5])], [paddle.ones([6])], None),
                hyper_rows(1e-3, 0, 0.9, 0.999, 1e-8, 0.9, 0.999))
    with pytest.raises(ValueError, match="step"):
        step_seed(1, 0)
