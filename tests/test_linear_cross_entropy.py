"""LinearCrossEntropy on the CPU: the Triton kernels (interpreter) and the reference against the plain
Paddle composition (matmul + cross_entropy in float64) in loss, lse and every gradient, for each
option; all-ignored batches; labels out of range; the gradient filter; launchers on poisoned
outputs; the layer (own and tied weights); the cut-cross-entropy argument order; bad input; and the
vocabulary-parallel loss (and sequence-parallel inputs) in 2 gloo processes equal to the dense one."""

import ctypes
import inspect
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.triton import linear_cross_entropy as K
from paddlenlp_fused.layers.linear_cross_entropy import LinearCrossEntropy
from paddlenlp_fused.ops import cross_entropy as lce_ops
from paddlenlp_fused.ops.cross_entropy import cce_linear_cross_entropy, linear_cross_entropy
from paddlenlp_fused.reference import linear_cross_entropy as ref
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.distributed import init_fleet, run_distributed
from paddlenlp_fused.testing.numerics import assert_close, assert_within, rel_err
from helpers import deterministic_settings

BACKENDS = ("triton", "reference")


# ----------------------------------------------------------------------------------------------
# a host GEMM for the cuda paths' orchestration on the CPU (cuBLASLt runs only on the GPU suite)

_NP = {"float32": (np.float32, 4), "float16": (np.float16, 2), "bfloat16": (np.uint16, 2)}


def _host_matrix(t, offset, rows, cols, ld, dtype=None):
    """A writable numpy view of rows x cols elements (row stride ld) at ``offset`` of a CPU tensor, read
    as ``dtype`` (default its own)."""
    dtype = dtype or str(t.dtype).rsplit(".", 1)[-1]
    np_dtype, size = _NP[dtype]
    count = (rows - 1) * ld + cols
    buf = (ctypes.c_char * (count * size)).from_address(t.data_ptr() + offset * size)
    flat = np.frombuffer(buf, dtype=np_dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (ld * size, size)), dtype


def _to64(x, dtype):
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _store(view, values, dtype):
    if dtype == "bfloat16":  # round to nearest even
        bits = values.astype(np.float32).view(np.uint32)
        view[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        view[...] = values.astype(view.dtype)


def host_gemm(a, b, d, *, m, n, k, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, a_offset=0, b_offset=0,
              d_offset=0, lda, ldb, ldd, heuristic=0, a_dtype=None, b_dtype=None):
    """kernels/cuda/gemm.gemm's contract in float64 on host memory: D = alpha op(A) op(B) + beta D
    (``heuristic``, cuBLASLt's choice of algorithm, changes nothing here)."""
    av, adt = _host_matrix(a, a_offset, *((k, m) if trans_a else (m, k)), lda, a_dtype)
    bv, bdt = _host_matrix(b, b_offset, *((n, k) if trans_b else (k, n)), ldb, b_dtype)
    dv, ddt = _host_matrix(d, d_offset, m, n, ldd)
    a64, b64 = _to64(av, adt), _to64(bv, bdt)
    out = alpha * ((a64.T if trans_a else a64) @ (b64.T if trans_b else b64))
    if beta:
        out = out + beta * _to64(dv, ddt)
    _store(dv, out, ddt)


def _path_stand_in(monkeypatch, backend):
    """('cuda-lean' / 'cuda-bounded') -> the op's cuda paths with host_gemm in place of cuBLASLt;
    'reference-blockwise' -> the reference's recomputing blocks of tokens (blocks too small for the
    test's logits); the other backends unchanged. Returns (backend argument, extra keywords)."""
    if backend == "reference-blockwise":
        monkeypatch.setattr(ref, "DEFAULT_BLOCK_ELEMENTS", 1000)
        return "reference", {}
    if not backend.startswith("cuda"):
        return backend, {}
    monkeypatch.setattr(lce_ops, "_choose_backend", lambda *args: "cuda")
    monkeypatch.setattr(lce_ops, "_gemm_for", lambda like, nbytes=None: host_gemm)
    bound = (K.tuning.GEMM_WORKSPACE[0] + 12000) / 2**30  # a few blocks of tokens at these sizes
    return "auto", ({"max_workspace_gib": bound} if backend == "cuda-bounded"
                    else {"max_workspace_gib": "lean", "vocab_chunk": 64})


def _inputs(dtype, shape, D, V, transpose_y, bias=False, ignore_index=-100, rng=np.random, ignore_frac=0.2):
    """hidden [*shape, D], weight, bias [V] (or None), labels [*shape] with some ignored; logits of O(3)."""
    hidden = paddle.to_tensor(rng.standard_normal((*shape, D)).astype(np.float32)).astype(dtype)
    w = rng.standard_normal((V, D) if transpose_y else (D, V)).astype(np.float32) * (3.0 / np.sqrt(D))
    weight = paddle.to_tensor(w).astype(dtype)
    b = paddle.to_tensor(rng.standard_normal(V).astype(np.float32)).astype(dtype) if bias else None
    labels = rng.randint(0, V, size=shape)
    labels[rng.random_sample(shape) < ignore_frac] = ignore_index
    for t in (hidden, weight, b):
        if t is not None:
            t.stop_gradient = False
    return hidden, weight, b, paddle.to_tensor(labels.astype(np.int64))


def _plain(hidden, weight, labels, bias, *, transpose_y, ignore_index=-100, reduction="mean", label_smoothing=0.0,
           z_loss=0.0, softcap=None, shift=False, round_to=None):
    """The plain composition on float tensors: logits = matmul (+ bias), optional softcap, then
    F.cross_entropy in float, the label-smoothing and z-loss terms, reduction. ``round_to`` rounds
    the logits (and through the casts' backward, their gradient) to a 16-bit dtype, as the
    composition in that dtype does. Returns (loss, per-token lse)."""
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    logits = paddle.matmul(hidden, weight, transpose_y=transpose_y)
    if bias is not None:
        logits = logits + bias
    if round_to is not None:
        logits = logits.astype(round_to).astype(hidden.dtype)
    if softcap is not None:
        logits = softcap * paddle.tanh(logits / softcap)
    valid = labels != ignore_index
    safe = paddle.where(valid, labels, paddle.zeros_like(labels))
    ce = F.cross_entropy(logits, safe.unsqueeze(-1), reduction="none").squeeze(-1)
    lse = paddle.logsumexp(logits, axis=-1)
    loss = (1 - label_smoothing) * ce + label_smoothing * (lse - logits.mean(axis=-1)) + z_loss * lse * lse
    loss = paddle.where(valid, loss, paddle.zeros_like(loss))
    if reduction == "mean":
        loss = loss.sum() / paddle.clip(valid.astype(loss.dtype).sum(), min=1)
    elif reduction == "sum":
        loss = loss.sum()
    return loss, lse


def _leaf(t, dtype="float64"):
    if t is None:
        return None
    leaf = paddle.to_tensor(t.astype("float32").numpy().astype(dtype))
    leaf.stop_gradient = False
    return leaf


def _scalar(loss, lse, weights):
    """A scalar that weights every output element (and lse, when returned) differently."""
    out = (loss * weights[0]).sum() if loss.ndim else loss * 1.5
    return out + (lse * weights[1]).sum() if lse is not None else out


CASES = {
    "fp32_vd_mean": dict(dtype="float32", shape=(37,), D=40, V=300, transpose_y=True),
    "fp32_dv_bias_smooth_zloss_softcap_chunks": dict(
        dtype="float32", shape=(29,), D=48, V=257, transpose_y=False, bias=True,
        opts=dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0, vocab_chunk=64)),
    "bf16_vd_bias_softcap_sum_shift_chunks": dict(
        dtype="bfloat16", shape=(2, 19), D=32, V=200, transpose_y=True, bias=True,
        opts=dict(softcap=3.0, reduction="sum", shift=True, vocab_chunk=64)),
    "bf16_dv_smooth_zloss_none_lse": dict(
        dtype="bfloat16", shape=(33,), D=48, V=130, transpose_y=False,
        opts=dict(label_smoothing=0.2, z_loss=1e-2, reduction="none", return_lse=True)),
    "fp16_vd_mean_ignore0": dict(dtype="float16", shape=(3, 7), D=24, V=96, transpose_y=True, ignore_index=0,
                                 opts=dict(ignore_index=0)),
}


@pytest.mark.parametrize("backend", BACKENDS + ("reference-blockwise", "cuda-lean", "cuda-bounded"))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_plain_composition(case, backend, monkeypatch):
    """Every path; the cuda paths' Python orchestration with a host GEMM (the GPU suite runs cuBLASLt).
    The bounded path routes reduction='none' / return_lse to the lean path."""
    c = CASES[case]
    dtype, opts = c["dtype"], dict(c.get("opts", {}))
    bounded = backend == "cuda-bounded" and opts.get("reduction") != "none" and not opts.get("return_lse")
    backend, extra = _path_stand_in(monkeypatch, backend)
    hidden, weight, bias, labels = _inputs(dtype, c["shape"], c["D"], c["V"], c["transpose_y"], c.get("bias", False),
                                           c.get("ignore_index", -100))
    out = linear_cross_entropy(hidden, weight, labels, bias, transpose_y=c["transpose_y"], backend=backend,
                               **{**opts, **extra})
    loss, lse = out if opts.get("return_lse") else (out, None)
    weights = [paddle.to_tensor(np.random.standard_normal(t.shape).astype(np.float32)) if t is not None and t.ndim
               else None for t in (loss, lse)]
    params = [t for t in (hidden, weight, bias) if t is not None]
    grads = paddle.grad(_scalar(loss, lse, weights), params)

    plain_opts = {k: v for k, v in opts.items() if k not in ("vocab_chunk", "return_lse")}
    leaves = [_leaf(t) for t in (hidden, weight, bias)]
    loss64, lse64 = _plain(*leaves[:2], labels, leaves[2], transpose_y=c["transpose_y"], **plain_opts)
    if opts.get("shift"):
        lse64 = None
    w64 = [None if w is None else w.astype("float64") for w in weights]
    grads64 = paddle.grad(_scalar(loss64, lse64 if lse is not None else None, w64),
                          [t for t in leaves if t is not None])

    assert loss.dtype == paddle.float32
    if lse is not None:
        assert lse.dtype == paddle.float32 and list(lse.shape) == list(labels.shape)
        assert_close("lse", lse.numpy(), lse64.numpy(), "float32")
    baselines = [None] * len(params)
    if dtype != "float32":  # the plain composition in this dtype: logits and their gradient rounded
        leaves32 = [_leaf(t, "float32") for t in params] + ([None] if bias is None else [])
        loss16, lse16 = _plain(leaves32[0], leaves32[1], labels, leaves32[2], transpose_y=c["transpose_y"],
                               round_to=dtype, **plain_opts)
        g16 = paddle.grad(_scalar(loss16, lse16 if lse is not None else None, weights),
                          [t for t in leaves32 if t is not None])
        baselines = [rel_err(g.astype(dtype).astype("float32").numpy(), g64.numpy()) for g, g64 in zip(g16, grads64)]
    if bounded and dtype != "float32":  # its logits are rounded to the input dtype once, as loss16's are
        assert_close("loss", loss.numpy(), loss64.numpy(), dtype, baseline_err=rel_err(loss16.numpy(), loss64.numpy()))
    else:
        assert_close("loss", loss.numpy(), loss64.numpy(), "float32")
    for name, g, g64, base in zip(("dhidden", "dweight", "dbias"), grads, grads64, baselines):
        assert g.dtype == params[0].dtype
        assert_close(name, g.astype("float32").numpy(), g64.numpy(), dtype, baseline_err=base)


@pytest.mark.parametrize("backend", BACKENDS + ("reference-blockwise",))
def test_all_ignored_batch_gives_zero_loss_and_gradients(backend, monkeypatch):
    backend, _ = _path_stand_in(monkeypatch, backend)
    hidden, weight, bias, labels = _inputs("bfloat16", (2, 9), 32, 70, True, bias=True, ignore_frac=1.0)
    for reduction in ("mean", "sum"):
        loss = linear_cross_entropy(hidden, weight, labels, bias, reduction=reduction, z_loss=1e-3, backend=backend)
        grads = paddle.grad(loss, [hidden, weight, bias])
        assert float(loss) == 0.0
        for g in grads:
            g32 = g.astype("float32").numpy()
            assert np.all(np.isfinite(g32)) and not np.any(g32)


def _low_precision_twin(t, dtype):
    """A fresh leaf holding ``t``'s values in ``dtype`` (None stays None)."""
    if t is None:
        return None
    twin = paddle.to_tensor(t.numpy()).astype(dtype)
    twin.stop_gradient = False
    return twin


def _assert_same(name, got, want):
    np.testing.assert_array_equal(got.astype("float32").numpy(), want.astype("float32").numpy(), err_msg=name)


def _written_out_loss(h, w, labels, ignore_index=-100):
    """Per-token loss ``lse - s_y`` (0 where ignored) in the leaves' dtype: the composition written
    out (Paddle's CPU F.cross_entropy clips a token's loss at 64)."""
    s = paddle.matmul(h, w, transpose_y=True)
    picked = paddle.take_along_axis(s, paddle.clip(labels, 0, s.shape[-1] - 1).unsqueeze(-1), axis=-1).squeeze(-1)
    return paddle.where(labels != ignore_index, paddle.logsumexp(s, axis=-1) - picked, paddle.zeros_like(picked))


@pytest.mark.parametrize("backend", BACKENDS + ("cuda-bounded",))
def test_logits_in_the_thousands_give_the_exact_loss(backend, monkeypatch):
    """Confident or diverging logits (std ~1500) at small T: each token's loss is lse minus the label's
    logit, not capped at 64 as Paddle's CPU F.cross_entropy caps it (the reference returned <= 64
    where float64 gives thousands), on every path; the mean over the labelled tokens too, and its
    gradients within the float32 composition's own error (softmax amplifies the logits' rounding
    by their size)."""
    backend, extra = _path_stand_in(monkeypatch, backend)
    hidden, weight, _, labels = _inputs("float32", (8,), 16, 40, True, ignore_frac=0.25)
    weight = _leaf(weight * 500.0, "float32")
    (h64, w64), (h32, w32) = ([_leaf(t, dtype) for t in (hidden, weight)] for dtype in ("float64", "float32"))
    loss64 = _written_out_loss(h64, w64, labels)
    assert float(loss64.max()) > 1000.0  # the regime of the cap
    if "max_workspace_gib" not in extra:  # the bounded path takes a scalar loss only
        per_token = linear_cross_entropy(hidden, weight, labels, reduction="none", backend=backend, **extra)
        assert_close("per-token loss", per_token.numpy(), loss64.numpy(), "float32")
    mean = linear_cross_entropy(hidden, weight, labels, backend=backend, **extra)
    n_valid = float((labels != -100).astype("float64").sum())
    mean64 = loss64.sum() / n_valid
    assert_close("mean", mean.numpy(), mean64.numpy(), "float32")
    grads = paddle.grad(mean, [hidden, weight])
    grads64 = paddle.grad(mean64, [h64, w64])
    grads32 = paddle.grad(_written_out_loss(h32, w32, labels).sum() / n_valid, [h32, w32])  # the baseline
    for name, g, g32, g64 in zip(("dhidden", "dweight"), grads, grads32, grads64):
        base = max(rel_err(g32.numpy(), g64.numpy()), 1e-5)
        assert_within(name, g.numpy(), g64.numpy(), 4.0 * base)


@pytest.mark.parametrize("backend", BACKENDS + ("cuda-lean", "cuda-bounded"))
def test_labels_out_of_range(backend, monkeypatch):
    """The same ValueError on every backend (the kernels' flag, read once per call)."""
    backend, extra = _path_stand_in(monkeypatch, backend)
    hidden, weight, _, labels = _inputs("float32", (6,), 16, 40, True, ignore_frac=0.0)
    bad = labels.clone()
    for value in (40, -3):
        bad[2] = value
        with pytest.raises(ValueError, match=rf"labels: expected values in \[0, 40\) or ignore_index=-100, "
                                             rf"got {value}$"):
            linear_cross_entropy(hidden, weight, bad, backend=backend, **extra)


def test_reference_label_check_counts_the_labelled_tokens():
    """The reference reads the labels on the host once: ``check_labels`` returns the number of labels
    that are not ignore_index, the mean's divisor (ignore_index outside and inside [0, V), none
    ignored, all ignored, int32 and 2-D labels)."""
    rng = np.random.default_rng(3)
    for ignore_index, dtype, frac in ((-100, "int64", 0.3), (0, "int64", 0.3), (7, "int32", 0.3), (-100, "int64", 0.0),
                                      (5, "int32", 1.0)):
        labels = rng.integers(0, 40, (6, 9))
        labels[rng.random((6, 9)) < frac] = ignore_index
        got = ref.check_labels(paddle.to_tensor(labels.astype(dtype)), 40, ignore_index)
        assert got == np.count_nonzero(labels != ignore_index), (ignore_index, dtype, frac)

def test_gradient_filter():
    hidden, weight, bias, labels = _inputs("bfloat16", (40,), 32, 150, False, bias=True)
    exact = paddle.grad(linear_cross_entropy(hidden, weight, labels, bias, transpose_y=False, backend="triton",
                                             vocab_chunk=64), [hidden, weight, bias])
    loss = linear_cross_entropy(hidden, weight, labels, bias, transpose_y=False, backend="triton", vocab_chunk=64,
                                filter_eps=1e-30)  # keeps every tile: the skipping loop, nothing skipped
    for g, e in zip(paddle.grad(loss, [hidden, weight, bias]), exact):
        np.testing.assert_array_equal(g.astype("float32").numpy(), e.astype("float32").numpy())
    loss_all = linear_cross_entropy(hidden, weight, labels, bias, transpose_y=False, backend="triton",
                                    filter_eps=2.0)  # above every |G| (<= 1): every tile skipped
    assert float(loss_all) == float(loss)
    dh, dw, db = paddle.grad(loss_all, [hidden, weight, bias])
    assert not np.any(dh.astype("float32").numpy()) and not np.any(dw.astype("float32").numpy())
    np.testing.assert_array_equal(db.astype("float32").numpy(), exact[2].astype("float32").numpy())  # unfiltered
    # separate filters: only the weight's GEMM skips (the hidden's gradient stays exact), and the reverse
    for keep_e, keep_c in ((False, True), (True, False)):
        loss_one = linear_cross_entropy(hidden, weight, labels, bias, transpose_y=False, backend="triton",
                                        vocab_chunk=64, filter_eps=2.0, filter_e_grad=keep_e, filter_c_grad=keep_c)
        dh, dw, _ = paddle.grad(loss_one, [hidden, weight, bias])
        filtered, exact_one = (dh, dw) if keep_e else (dw, dh)
        assert not np.any(filtered.astype("float32").numpy())
        # the filter's GEMM tiles may differ from the exact call's: the same sums, another rounding order
        assert_close("unfiltered gradient", exact_one.astype("float32").numpy(),
                     exact[1 if keep_e else 0].astype("float32").numpy(), "bfloat16", baseline_err=1e-3)
    with pytest.raises(ValueError, match="filter_eps"):
        linear_cross_entropy(hidden, weight, labels, transpose_y=False, filter_eps=-1.0)
    with pytest.raises(TypeError, match="filter_c_grad"):
        linear_cross_entropy(hidden, weight, labels, transpose_y=False, filter_c_grad="yes")


def test_auto_filter_threshold_follows_the_dtype():
    """'auto' is the input dtype's epsilon / 32 (Cut Cross-Entropy's rule), not a fixed 2^-12."""
    assert lce_ops._filter_eps("auto", "bfloat16") == 2.0**-12
    assert lce_ops._filter_eps("auto", "float16") == 2.0**-15
    assert lce_ops._filter_eps("auto", "float32") == 2.0**-28
    assert lce_ops._filter_eps(None, "bfloat16") is None


def test_default_takes_the_bounded_path_within_its_bound(monkeypatch):
    """The cuda backend's default (max_workspace_gib="auto") is the bounded path, its plan within
    DEFAULT_MAX_WORKSPACE_GIB (lowered here so that these tokens take 3 blocks), with the results of
    the same bound given as a number and, to the rounding of the bounded path's logits, of the lean
    path; where the bound holds no token's logits "auto" takes the lean path, a number raises; where
    the call needs the lean path, "auto" says nothing. The layer passes the default on."""
    backend, _ = _path_stand_in(monkeypatch, "cuda-bounded")
    n_tok, D, V = 12, 8, 20
    bound_bytes = K.tuning.GEMM_WORKSPACE[0] + 4 * 24 * 2 + 32 * n_tok  # 4 tokens of bf16 logits (V rounded to 24)
    monkeypatch.setattr(lce_ops, "DEFAULT_MAX_WORKSPACE_GIB", bound_bytes / 2**30)
    plans = []
    bounded_plan = K.bounded_plan
    monkeypatch.setattr(K, "bounded_plan", lambda *a, **k: plans.append(bounded_plan(*a, **k)) or plans[-1])
    hidden, weight, _, labels = _inputs("bfloat16", (n_tok,), D, V, True)

    def run(**options):
        plans.clear()
        loss = linear_cross_entropy(hidden, weight, labels, backend=backend, **options)
        return [loss] + list(paddle.grad(loss, [hidden, weight])), list(plans)

    default, default_plans = run()
    assert len(default_plans) == 1, "the default call did not take the bounded path"
    plan = default_plans[0]
    assert -(-n_tok // plan.tokens) == 3
    assert plan.tokens * plan.ld * 2 + plan.workspace + 32 * n_tok <= bound_bytes
    given, _ = run(max_workspace_gib=bound_bytes / 2**30)
    for name, a, b in zip(("loss", "dhidden", "dweight"), default, given):
        _assert_same(name, a, b)
    lean, lean_plans = run(max_workspace_gib="lean")
    assert not lean_plans
    for name, a, b in zip(("loss", "dhidden", "dweight"), default, lean):
        assert_close(name, a.astype("float32").numpy(), b.astype("float32").numpy(), "bfloat16")

    monkeypatch.setattr(lce_ops, "DEFAULT_MAX_WORKSPACE_GIB", 1e-6)  # holds no token's logits
    fallback, fallback_plans = run()
    assert not fallback_plans
    for name, a, b in zip(("loss", "dhidden", "dweight"), fallback, lean):
        _assert_same(name, a, b)
    with pytest.raises(ValueError, match="holds no token's logits"):
        linear_cross_entropy(hidden, weight, labels, backend=backend, max_workspace_gib=1e-6)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*max_workspace_gib")  # none for the default
        linear_cross_entropy(hidden, weight, labels, backend=backend, reduction="none")

    assert LinearCrossEntropy(D, V).options["max_workspace_gib"] == "auto"
    assert inspect.signature(linear_cross_entropy).parameters["max_workspace_gib"].default == "auto"


@pytest.mark.parametrize("backend", ("cuda-lean", "cuda-bounded"))
def test_cuda_paths_accumulate_fresh_gradients(backend, monkeypatch):
    """Two backward passes into the same leaves (and a tied use of the weight): each gradient is a fresh
    tensor, never one the op keeps, so Paddle's in-place accumulation doubles it; dW accumulated in fp32
    (accum_c_fp32) gives the same gradient."""
    backend, extra = _path_stand_in(monkeypatch, backend)
    hidden, weight, bias, labels = _inputs("bfloat16", (37,), 40, 130, True, bias=True)
    grads = []
    for accum in (False, True):
        for t in (hidden, weight, bias):
            t.clear_gradient()
        for _ in range(2):
            loss = linear_cross_entropy(hidden, weight, labels, bias, transpose_y=True, backend=backend,
                                        accum_c_fp32=accum, **extra)
            (loss * 2.0).backward()
        grads.append([t.grad.astype("float32").numpy() for t in (hidden, weight, bias)])
    single = paddle.grad(linear_cross_entropy(hidden, weight, labels, bias, transpose_y=True, backend="triton") * 2.0,
                         [hidden, weight, bias])
    for got_plain, got_fp32, one in zip(*grads, single):
        one = one.astype("float32").numpy()
        assert_close("accumulated", got_plain, 2 * one, "bfloat16", baseline_err=4e-3)
        assert_close("accumulated fp32 dW", got_fp32, 2 * one, "bfloat16", baseline_err=4e-3)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("transpose_y", [True, False])
def test_launchers_write_every_element(transpose_y, deterministic):
    """Outputs and workspaces poisoned with NaN; values against the reference stages. Deterministic:
    the bias gradient through the per-token-block partials (2 blocks of tokens, 3 vocabulary chunks)."""
    dtype, n_tok, D, V, start = "bfloat16", 21, 40, 90, 30  # this 'rank' holds ids [30, 120)
    hidden, weight, bias, labels = _inputs(dtype, (n_tok,), D, V, transpose_y, bias=True)
    labels = paddle.to_tensor(np.random.randint(0, 150, n_tok).astype(np.int64))
    nan = lambda shape, dt="float32": paddle.full(list(shape), float("nan"), dtype=dt)  # noqa: E731
    n_split = K.forward_splits(n_tok, V, dtype)
    partials, stats, loss = nan((4, n_split, n_tok)), nan((3, n_tok)), nan((n_tok,))
    K.lse_forward(*triton_args(hidden, weight, labels, bias, partials, stats), transpose_y=transpose_y,
                  vocab_start=start, softcap=5.0, need_sum=True)
    stats_ref = ref.lse_stats_ref(hidden, weight, labels, bias, transpose_y=transpose_y, vocab_start=start, softcap=5.0)
    assert_close("stats", stats.numpy(), stats_ref.numpy(), "float32")
    flag = paddle.full([1], -100, dtype="int64")
    K.token_loss(*triton_args(stats, labels, loss, flag), vocab_total=150, label_smoothing=0.1, z_loss=0.01)
    assert int(flag) == -100
    loss_ref = ref.token_loss_ref(stats, labels, vocab_total=150, label_smoothing=0.1, z_loss=0.01)
    assert_close("loss", loss.numpy(), loss_ref.numpy(), "float32")

    lse = stats[0].clone()
    coef_p = paddle.to_tensor(np.random.uniform(-1, 1, n_tok).astype(np.float32))
    coef_y = paddle.to_tensor(np.random.uniform(-1, 1, n_tok).astype(np.float32))
    scale = paddle.to_tensor([0.25], dtype="float32")
    ws = K.backward_workspace(n_tok, D, V, dtype, chunk=32)
    dh, dw, db = nan((n_tok, D), dtype), nan(weight.shape, dtype), nan((V,), dtype)
    work = (nan(ws.g, dtype), nan(ws.lo, dtype), paddle.full(list(ws.flags), 7, dtype="int8"),
            paddle.zeros(list(ws.dbias), dtype="float32"))
    parts = {"dbias_parts": triton_args(nan(ws.dbias_parts))[0]} if deterministic else {}
    K.lce_backward(*triton_args(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, dh, dw, db, *work),
                   transpose_y=transpose_y, vocab_start=start, vocab_total=150, softcap=5.0, label_smoothing=0.1,
                   **parts)
    # The reference on float32 copies of the same values: its gradients unrounded, not a second bf16 rounding.
    h32, w32, b32 = (t.astype("float32") for t in (hidden, weight, bias))
    want = ref.grads_ref(h32, w32, labels, b32, lse, coef_p * 0.25, coef_y * 0.25, transpose_y=transpose_y,
                         vocab_start=start, vocab_total=150, softcap=5.0, label_smoothing=0.1)
    for name, got, exp in zip(("dh", "dw", "db"), (dh, dw, db), want):
        assert_close(name, got.astype("float32").numpy(), exp.numpy(), dtype, baseline_err=4e-3)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("transpose_y", [True, False])
def test_chunked_launchers_write_every_element(transpose_y, deterministic, monkeypatch):
    """The lean and bounded launchers (host_gemm for cuBLASLt) with outputs and workspaces poisoned with
    NaN, odd last token blocks and vocabulary chunks, a vocabulary shard; against the reference stages.
    The lean backward's 16-bit G written over its fp32 logits in steps of 16 columns, 4 rows a program.
    Deterministic: the bias gradient through the partials workspace."""
    monkeypatch.setattr(K.tuning, "NARROW_GRAD_TILE", (4, 16, 1))
    dtype, n_tok, D, V, start, total = "bfloat16", 23, 40, 90, 30, 150
    hidden, weight, bias, labels = _inputs(dtype, (n_tok,), D, V, transpose_y, bias=True)
    labels = paddle.to_tensor(np.random.randint(0, total, n_tok).astype(np.int64))
    nan = lambda shape, dt="float32": paddle.full(list(shape), float("nan"), dtype=dt)  # noqa: E731
    opts = dict(transpose_y=transpose_y, vocab_start=start, softcap=5.0)
    want_stats = ref.lse_stats_ref(hidden, weight, labels, bias, **opts)
    h32, w32, b32 = (t.astype("float32") for t in (hidden, weight, bias))

    plan = K.lean_plan(n_tok, V, D, dtype, backward=False, tokens=10, vocab=32)
    state, stats = nan((4, n_tok)), nan((3, n_tok))
    K.lean_forward(host_gemm, *triton_args(hidden, weight, labels, bias, nan(*K.lean_workspace(plan, D)["logits"]),
                                           state, stats), plan=plan, need_sum=True, **opts)
    assert_close("lean stats", stats.numpy(), want_stats.numpy(), "float32")
    lse = stats[0].clone()
    coef_p = paddle.to_tensor(np.random.uniform(-1, 1, n_tok).astype(np.float32))
    coef_y = paddle.to_tensor(np.random.uniform(-1, 1, n_tok).astype(np.float32))
    dh, dw, db = nan((n_tok, D), dtype), nan(weight.shape, dtype), nan((V,), dtype)

    def parts(plan):
        return {"dbias_parts": triton_args(nan(K.chunk_dbias_parts_shape(plan)))[0]} if deterministic else {}

    plan = K.lean_plan(n_tok, V, D, dtype, backward=True, tokens=7, vocab=40)  # G written over the fp32 logits
    work = {k: nan(*v) for k, v in K.lean_workspace(plan, D).items()}
    K.lean_backward(host_gemm, *triton_args(hidden, weight, labels, bias, lse, coef_p, coef_y), 0.25,
                    *triton_args(dh, dw, db, work["logits"], work["dh_acc"], paddle.zeros([V])),
                    plan=plan, vocab_total=total, label_smoothing=0.1, **opts, **parts(plan))
    want = ref.grads_ref(h32, w32, labels, b32, lse, coef_p * 0.25, coef_y * 0.25, vocab_total=total,
                         label_smoothing=0.1, **opts)
    for name, got, exp in zip(("dh", "dw", "db"), (dh, dw, db), want):
        assert_close(f"lean {name}", got.astype("float32").numpy(), exp.numpy(), dtype, baseline_err=4e-3)

    bplan = K.bounded_plan(n_tok, V, dtype, K.tuning.GEMM_WORKSPACE[0] + 9 * 96 * 2)  # 9 tokens a block: 3 blocks
    assert bplan.tokens == 8 and bplan.ld == 96
    loss, flag = nan((n_tok,)), paddle.full([1], -100, dtype="int64")
    dh, dw, dbias_acc = nan((n_tok, D), dtype), nan(weight.shape, dtype), paddle.zeros([V])
    K.bounded_forward(host_gemm, *triton_args(hidden, weight, labels, bias, nan((bplan.tokens, bplan.ld), dtype),
                                              nan((3, bplan.tokens)), loss, flag, dh, dw, dbias_acc),
                      plan=bplan, alpha=0.5, vocab_total=total, label_smoothing=0.1, z_loss=0.01, **opts,
                      **parts(bplan))
    assert int(flag) == -100
    # the reference on the bf16-rounded logits the bounded path keeps: lse, then G with its coefficients
    rounded = paddle.matmul(h32, w32, transpose_y=transpose_y).astype(dtype).astype("float32")
    eye = paddle.eye(V, dtype="float32")  # [V, V] as the weight: the rounded logits pass through as they are
    stats_b = ref.lse_stats_ref(rounded, eye, labels, b32, transpose_y=True, vocab_start=start, softcap=5.0)
    loss_b = ref.token_loss_ref(stats_b, labels, vocab_total=total, label_smoothing=0.1, z_loss=0.01)
    assert_close("bounded loss", loss.numpy(), loss_b.numpy(), "float32")
    valid = (labels != -100).astype("float32")
    gb = ref.grads_ref(rounded, eye, labels, b32, stats_b[0], valid * (1 + 0.02 * stats_b[0]) * 0.5, valid * 0.5,
                       vocab_total=total, label_smoothing=0.1, transpose_y=True, vocab_start=start, softcap=5.0)
    g_logits = gb[0]  # d loss / d logits [T, V]: the "hidden" gradient through the identity weight
    want_dh = paddle.matmul(g_logits, w32, transpose_y=not transpose_y)
    want_dw = paddle.matmul(g_logits, h32, transpose_x=True)
    assert_close("bounded dh", dh.astype("float32").numpy(), want_dh.numpy(), dtype, baseline_err=4e-3)
    got_dw = dw.astype("float32").numpy() if transpose_y else dw.astype("float32").numpy().T
    assert_close("bounded dw", got_dw, want_dw.numpy(), dtype, baseline_err=4e-3)
    assert_close("bounded dbias", dbias_acc.numpy() * 0.5, gb[2].numpy(), "float32")


@pytest.mark.parametrize("backend", ("triton", "cuda-lean", "cuda-bounded"))
def test_deterministic_bias_gradient(backend, monkeypatch):
    """deterministic=True, and None under FLAGS_cudnn_deterministic, hand every path's launcher a
    dbias_parts workspace (False and the unset flag do not); the gradients stay within the float64
    composition's bounds (45 tokens: several token blocks add into each bias element); anything but
    None or a bool is a TypeError."""
    launcher = {"triton": "lce_backward", "cuda-lean": "lean_backward", "cuda-bounded": "bounded_forward"}[backend]
    seen = []
    real = getattr(K, launcher)
    monkeypatch.setattr(K, launcher, lambda *a, **k: (seen.append(k.get("dbias_parts") is not None), real(*a, **k))[1])
    backend, extra = _path_stand_in(monkeypatch, backend)
    hidden, weight, bias, labels = _inputs("float32", (45,), 24, 150, True, bias=True)
    opts = dict(transpose_y=True, label_smoothing=0.1, softcap=4.0, backend=backend, **extra)
    leaves = [_leaf(t) for t in (hidden, weight, bias)]
    grads64 = paddle.grad(_plain(leaves[0], leaves[1], labels, leaves[2], transpose_y=True, label_smoothing=0.1,
                                 softcap=4.0)[0], leaves)
    for deterministic, env in deterministic_settings(monkeypatch, ((True, None), (None, "1"), (False, "1"), (None, None))):
        loss = linear_cross_entropy(hidden, weight, labels, bias, deterministic=deterministic, **opts)
        grads = paddle.grad(loss, [hidden, weight, bias])
        if deterministic:
            for name, g, g64 in zip(("dhidden", "dweight", "dbias"), grads, grads64):
                assert_close(name, g.numpy(), g64.numpy(), "float32")
    assert seen == [True, True, False, False]
    for bad in (1, "true"):
        with pytest.raises(TypeError, match="deterministic: expected None, True or False"):
            linear_cross_entropy(hidden, weight, labels, bias, deterministic=bad, **opts)


def test_layer_own_and_tied_weights():
    D, V = 24, 64
    hidden, _, _, labels = _inputs("float32", (2, 5), D, V, True)
    layer = LinearCrossEntropy(D, V, has_bias=True)  # PaddleNLP LM head layout [D, V]
    assert list(layer.weight.shape) == [D, V] and len(layer.parameters()) == 2
    loss = layer(hidden, labels)
    np.testing.assert_allclose(float(loss), float(linear_cross_entropy(hidden, layer.weight, labels, layer.bias,
                                                                      transpose_y=False)), rtol=1e-6)
    loss.backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None

    embedding = paddle.nn.Embedding(V, D)  # tied: the LM head is the embedding's [V, D] weight
    tied = LinearCrossEntropy(D, V, transpose_y=True, weight=embedding.weight, reduction="sum", shift=True)
    model = paddle.nn.LayerList([embedding, tied])
    assert len(model.parameters()) == 1
    tokens = paddle.to_tensor(np.random.randint(0, V, (2, 6)))
    loss = tied(embedding(tokens), tokens)
    loss.backward()
    emb = embedding.weight.detach()
    emb.stop_gradient = False
    h = paddle.nn.functional.embedding(tokens, emb)
    expected = linear_cross_entropy(h, emb, tokens, reduction="sum", shift=True)
    (expected_grad,) = paddle.grad(expected, [emb])
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
    assert_close("tied grad", embedding.weight.grad.numpy(), expected_grad.numpy(), "float32")
    with pytest.raises(ValueError, match="weight: expected shape"):
        LinearCrossEntropy(D, V, transpose_y=False, weight=embedding.weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_amp_o1_float32_weights_with_low_precision_hidden(backend):
    """AMP O1: float32 master weights (own or a tied embedding's) with bfloat16 hidden, under
    ``auto_cast(level="O1")`` (a no-op in Paddle's CPU build; the op must agree): the matmul in the
    hidden's dtype as O1 casts it, the float32 weight and bias getting float32 gradients equal to the
    bfloat16 call's. Raised TypeError before."""
    D, V = 16, 40
    hidden, weight, bias, labels = _inputs("float32", (2, 5), D, V, True, bias=True)
    h16 = _low_precision_twin(hidden, "bfloat16")
    with paddle.amp.auto_cast(level="O1", dtype="bfloat16"):
        loss = linear_cross_entropy(h16, weight, labels, bias, backend=backend)
    grads = paddle.grad(loss, [h16, weight, bias])
    assert [g.dtype for g in grads] == [paddle.bfloat16, paddle.float32, paddle.float32]
    twins = [h16] + [_low_precision_twin(t, "bfloat16") for t in (weight, bias)]
    want = linear_cross_entropy(twins[0], twins[1], labels, twins[2], backend=backend)
    _assert_same("loss", loss, want)
    for name, g, w in zip(("dhidden", "dweight", "dbias"), grads, paddle.grad(want, twins)):
        _assert_same(name, g, w)

    embedding = paddle.nn.Embedding(V, D)  # float32, tied to the head
    tied = LinearCrossEntropy(D, V, transpose_y=True, weight=embedding.weight, backend=backend)
    tokens = paddle.to_tensor(np.random.randint(0, V, (2, 6)))
    with paddle.amp.auto_cast(level="O1", dtype="bfloat16"):
        h = embedding(tokens).astype("bfloat16")
        loss = tied(h, tokens)
    loss.backward()
    assert embedding.weight.grad.dtype == paddle.float32
    emb = embedding.weight.detach()  # the same with O1's casts spelled out: both uses add in float32
    emb.stop_gradient = False
    h = paddle.nn.functional.embedding(tokens, emb).astype("bfloat16")
    want = linear_cross_entropy(h, emb.astype("bfloat16"), tokens, transpose_y=True, backend=backend)
    _assert_same("tied loss", loss, want)
    _assert_same("tied grad", embedding.weight.grad, paddle.grad(want, [emb])[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_amp_autocast_casts_float32_inputs(backend, monkeypatch):
    """Inside an active auto_cast (simulated: Paddle's CPU build never enables it) float32 hidden,
    weight and bias run in its dtype, as the O1 white list casts matmul's inputs; their gradients
    come in float32."""
    hidden, weight, bias, labels = _inputs("float32", (7,), 16, 40, False, bias=True)
    monkeypatch.setattr(paddle.amp, "is_autocast_enabled", lambda *a, **k: True)
    monkeypatch.setattr(paddle.amp, "get_autocast_dtype", lambda *a, **k: paddle.bfloat16)
    loss = linear_cross_entropy(hidden, weight, labels, bias, backend=backend)
    grads = paddle.grad(loss, [hidden, weight, bias])
    monkeypatch.undo()
    assert all(g.dtype == paddle.float32 for g in grads)
    twins = [_low_precision_twin(t, "bfloat16") for t in (hidden, weight, bias)]
    want = linear_cross_entropy(twins[0], twins[1], labels, twins[2], backend=backend)
    _assert_same("loss", loss, want)
    for name, g, w in zip(("dhidden", "dweight", "dbias"), grads, paddle.grad(want, twins)):
        _assert_same(name, g, w)


def test_cut_cross_entropy_argument_order():
    e, c, _, targets = _inputs("float32", (2, 8), 16, 50, True)
    got = cce_linear_cross_entropy(e, c, targets, None, -100, 2.0, "sum", True)
    want = linear_cross_entropy(e, c, targets, softcap=2.0, reduction="sum", shift=True, transpose_y=True)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    # CCE's later positional arguments: filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad
    got = cce_linear_cross_entropy(e, c, targets, None, -100, 2.0, "sum", True, None, True, True, False, False)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    with pytest.raises(TypeError, match="accum_e_fp32"):
        cce_linear_cross_entropy(e, c, targets, accum_e_fp32=1)


def test_square_weight_needs_transpose_y():
    """A square weight reads either way: the op and the layer ask for transpose_y instead of guessing; a
    non-square weight's layout is read off its shape."""
    h, w, _, labels = _inputs("float32", (5,), 16, 16, True)
    with pytest.raises(ValueError, match="transpose_y: required for a square weight"):
        linear_cross_entropy(h, w, labels)
    with pytest.raises(ValueError, match="transpose_y: required for a square weight"):
        LinearCrossEntropy(16, 16, weight=w)
    assert LinearCrossEntropy(16, 16, transpose_y=True, weight=w).transpose_y
    h, w, _, labels = _inputs("float32", (5,), 16, 40, False)  # [D, V]
    np.testing.assert_allclose(float(linear_cross_entropy(h, w, labels)),
                               float(linear_cross_entropy(h, w, labels, transpose_y=False)), rtol=1e-6)
    np.testing.assert_allclose(float(linear_cross_entropy(h, w.t(), labels)),
                               float(linear_cross_entropy(h, w, labels, transpose_y=False)), rtol=1e-6)
    assert not LinearCrossEntropy(16, 40, weight=w).transpose_y
    assert LinearCrossEntropy(16, 40, weight=w.t()).transpose_y


def test_bad_input_raises_clear_errors():
    h, w, _, labels = _inputs("float32", (4,), 8, 10, True)
    with pytest.raises(TypeError, match="labels: expected dtype int64 or int32"):
        linear_cross_entropy(h, w, labels.astype("float32"))
    with pytest.raises(ValueError, match=r"labels: expected shape \[4\]"):
        linear_cross_entropy(h, w, labels[:3])
    with pytest.raises(ValueError, match=r"weight: expected \[D, V\] \(transpose_y=False\) with D=8"):
        linear_cross_entropy(h, w, labels, transpose_y=False)
    with pytest.raises(TypeError, match="weight: expected dtype float32"):
        linear_cross_entropy(h, w.astype("bfloat16"), labels)
    with pytest.raises(ValueError, match="bias: expected shape"):
        linear_cross_entropy(h, w, labels, bias=paddle.zeros([9]))
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, labels, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(h, w, labels, label_smoothing=1.0)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(h, w, labels, softcap=0.0)
    with pytest.raises(ValueError, match="shift"):
        linear_cross_entropy(h, w, labels, shift=4)
    with pytest.raises(ValueError, match="tp_group"):
        linear_cross_entropy(h, w, labels, tp_group="model")
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(h, w, labels, backend="cudnn")
    with pytest.raises(ValueError, match="max_workspace_gib"):  # the layer checks it at construction
        LinearCrossEntropy(8, 10, max_workspace_gib=0)
    for backend in BACKENDS:  # the bound is checked where it goes unused too
        for bad in (-1.0, None, "bounded", True):
            with pytest.raises(ValueError, match="max_workspace_gib: expected 'auto', 'lean' or a number of GiB > 0"):
                linear_cross_entropy(h, w, labels, max_workspace_gib=bad, backend=backend)
        with pytest.raises(ValueError, match="max_workspace_gib: .* holds no token's logits"):
            linear_cross_entropy(h, w, labels, max_workspace_gib=1e-6, backend=backend)


class _StandIn:
    """pytest's monkeypatch.setattr for a subprocess: the attributes come back on exit."""

    def __enter__(self):
        self.saved = []
        return self

    def setattr(self, obj, name, value):
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)


def _vocab_parallel_body():
    """Each rank holds half the vocabulary; losses and gradients equal the dense ones."""
    import paddle.distributed as dist

    hcg = init_fleet(mp_degree=2)
    rank = hcg.get_model_parallel_rank()
    rng = np.random.RandomState(1234)  # the same full tensors on both ranks
    n_tok, D, V = 12, 24, 80
    hidden, weight, bias, labels = _inputs("float32", (n_tok,), D, V, False, bias=True, rng=rng)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=6.0, transpose_y=False)
    dense = linear_cross_entropy(hidden, weight, labels, bias, backend="reference", **opts)
    d_h, d_w, d_b = paddle.grad(dense, [hidden, weight, bias])
    cols = slice(rank * V // 2, (rank + 1) * V // 2)
    for backend in ("triton", "reference", "cuda-lean", "cuda-bounded"):
        w_shard = paddle.to_tensor(weight.numpy()[:, cols])
        b_shard = paddle.to_tensor(bias.numpy()[cols])
        h = paddle.to_tensor(hidden.numpy())
        for t in (w_shard, b_shard, h):
            t.stop_gradient = False
        with _StandIn() as patch:  # this subprocess's own module: patched for the cuda paths only
            arg, extra = _path_stand_in(patch, backend)
            loss = linear_cross_entropy(h, w_shard, labels, b_shard, tp_group="fleet", backend=arg,
                                        **{**opts, **extra})
            g_h, g_w, g_b = paddle.grad(loss, [h, w_shard, b_shard])
        assert_close(f"{backend} tp loss", loss.numpy(), dense.numpy(), "float32")
        assert_close(f"{backend} tp dh", g_h.numpy(), d_h.numpy(), "float32")
        assert_close(f"{backend} tp dW", g_w.numpy(), d_w.numpy()[:, cols], "float32")
        assert_close(f"{backend} tp dbias", g_b.numpy(), d_b.numpy()[cols], "float32")

    # sequence parallel: this rank's half of the tokens, gathered inside; dh comes back as its rows
    rows = slice(rank * n_tok // 2, (rank + 1) * n_tok // 2)
    layer = LinearCrossEntropy(D, V, has_bias=True, sequence_parallel=True, **{k: v for k, v in opts.items()})
    assert layer.tp_group is not None and list(layer.weight.shape) == [D, V // 2] and layer.weight.is_distributed
    layer.weight.set_value(weight.numpy()[:, cols])
    layer.bias.set_value(bias.numpy()[cols])
    h_local = paddle.to_tensor(hidden.numpy()[rows])
    h_local.stop_gradient = False
    loss = layer(h_local, labels[rows])
    loss.backward()
    assert_close("sp loss", loss.numpy(), dense.numpy(), "float32")
    assert_close("sp dh", h_local.grad.numpy(), d_h.numpy()[rows], "float32")
    assert_close("sp dW", layer.weight.grad.numpy(), d_w.numpy()[:, cols], "float32")
    assert dist.get_world_size() == 2


def test_vocab_parallel_equals_dense_in_two_processes():
    run_distributed(_vocab_parallel_body)
